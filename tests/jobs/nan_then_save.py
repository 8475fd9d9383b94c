"""A plain loop that saves OUT/ckpt-N.pt with torch.save only (no guard API) every --save-every steps; the loss is
NaN from step --nan-at on (and so are the weights after the next update). Exits 0 after --steps steps."""

import argparse
import os
import time

import torch
from plain_sgd import PlainSGD

parser = argparse.ArgumentParser()
parser.add_argument("--output-dir", required=True)
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--step-s", type=float, default=0.05)
parser.add_argument("--save-every", type=int, default=5)
parser.add_argument("--nan-at", type=int, default=12)
args = parser.parse_args()

torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = PlainSGD(model.parameters(), lr=0.05)
x, y = torch.randn(64, 8), torch.randn(64, 1)
os.makedirs(args.output_dir, exist_ok=True)
for step in range(1, args.steps + 1):
    loss = torch.nn.functional.mse_loss(model(x), y)
    if step >= args.nan_at:
        loss = loss * float("nan")
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step}", flush=True)
    if step % args.save_every == 0:
        torch.save({"model": model.state_dict(), "step": step}, os.path.join(args.output_dir, f"ckpt-{step}.pt"))
    time.sleep(args.step_s)
