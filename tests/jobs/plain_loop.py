"""A plain PyTorch loop: --steps N, --step-s seconds per step, --nan-at K (that step's loss is NaN)."""

import argparse
import time

import torch
from plain_sgd import PlainSGD

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--step-s", type=float, default=0.0)
parser.add_argument("--nan-at", type=int, default=0)
parser.add_argument("--print-every", type=int, default=1)
args = parser.parse_args()

torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = PlainSGD(model.parameters(), lr=0.05)
x, y = torch.randn(64, 8), torch.randn(64, 1)
for step in range(1, args.steps + 1):
    loss = torch.nn.functional.mse_loss(model(x), y)
    if step == args.nan_at:
        loss = loss * float("nan")
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % args.print_every == 0:
        print(f"step {step} done", flush=True)
    if args.step_s:
        time.sleep(args.step_s)
print("training finished", flush=True)
