"""A plain loop that saves ``OUT/checkpoint-N/model.pt`` with ``torch.save`` and a ``trainer_state.json`` beside it
every ``--every`` steps, keeping only the newest folder (as ``save_total_limit=1`` does). With ``--tmp`` each save
goes into ``OUT/tmp-checkpoint-N`` first and is renamed into place (transformers #29399). ``--nan-at N``: the loss
is NaN from step N on (the weights after the next update); ``--steps N``: exit 0 after N steps.
Arguments: ``OUT [--every N] [--step_s S] [--tmp] [--nan-at N] [--steps N]``.
"""

import argparse
import json
import os
import shutil
import time

import torch
from plain_sgd import PlainSGD

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--every", type=int, default=10)
parser.add_argument("--step_s", type=float, default=0.05)
parser.add_argument("--tmp", action="store_true")
parser.add_argument("--nan-at", type=int, default=0)
parser.add_argument("--steps", type=int, default=100000)
args = parser.parse_args()
os.makedirs(args.out, exist_ok=True)
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
optimizer = PlainSGD(model.parameters(), lr=1e-2)
for step in range(1, args.steps + 1):
    x = torch.randn(4, 8)
    loss = (model(x).squeeze(-1) - x.sum(-1)).pow(2).mean()
    if args.nan_at and step >= args.nan_at:
        loss = loss * float("nan")
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if step % args.every == 0:
        final = os.path.join(args.out, f"checkpoint-{step}")
        where = os.path.join(args.out, f"tmp-checkpoint-{step}") if args.tmp else final
        os.makedirs(where, exist_ok=True)
        torch.save({"model": model.state_dict(), "step": step}, os.path.join(where, "model.pt"))
        with open(os.path.join(where, "trainer_state.json"), "w") as file:
            json.dump({"global_step": step}, file)
        if args.tmp:
            os.rename(where, final)
        for name in os.listdir(args.out):
            if name.startswith("checkpoint-") and name != f"checkpoint-{step}":
                shutil.rmtree(os.path.join(args.out, name), ignore_errors=True)
    time.sleep(args.step_s)
