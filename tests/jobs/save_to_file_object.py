"""Saves the way pytorch/examples' word_language_model does: ``--save FILE`` names a file, and the whole model is
written with ``torch.save(model, f)`` to a file object opened by the script, after every "epoch" of
``--epoch_steps`` steps, and loaded back with ``torch.load`` once training is over (``--steps`` ends it; the script
never resumes from a checkpoint of its own). Arguments: ``[--save FILE] [--epoch_steps N] [--step_s S] [--steps N]``.
"""

import argparse
import time

import torch
from plain_sgd import PlainSGD

parser = argparse.ArgumentParser()
parser.add_argument("--save", default="model.pt")
parser.add_argument("--epoch_steps", type=int, default=20)
parser.add_argument("--step_s", type=float, default=0.05)
parser.add_argument("--steps", type=int, default=100000)
args = parser.parse_args()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
optimizer = PlainSGD(model.parameters(), lr=1e-2)
for step in range(1, args.steps + 1):
    x = torch.randn(4, 8)
    loss = (model(x).squeeze(-1) - x.sum(-1)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if step % args.epoch_steps == 0:
        with open(args.save, "wb") as f:
            torch.save(model, f)
        print(f"epoch end at step {step}: saved {args.save}", flush=True)
    time.sleep(args.step_s)
with open(args.save, "rb") as f:  # the best model, for the test run that follows training
    model = torch.load(f, weights_only=False)
print(f"loaded {args.save} back", flush=True)
