"""A plain loop whose loss explodes while staying finite (the learning rate jumps from 0.01 to --lr at step 11),
then fails in its own perplexity code (``math.exp(loss)`` -> OverflowError), as word_language_model does with a
large learning rate."""

import argparse
import math

import torch
from plain_sgd import PlainSGD

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--lr", type=float, default=2.0)
parser.add_argument("--log-every", type=int, default=20)
args = parser.parse_args()

torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = PlainSGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 8), torch.randn(64, 1) * 2.6
for step in range(1, args.steps + 1):
    if step == 11:
        for group in opt.param_groups:
            group["lr"] = args.lr
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % args.log_every == 0:
        print(f"step {step} loss {loss.item():.2f} ppl {math.exp(loss.item()):.2f}", flush=True)
