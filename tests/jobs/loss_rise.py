"""A plain loop whose loss jumps --factor times at step --rise-at and stays there (finite all along), saving
out/ckpt-STEP.pt every --save-every steps; exits 0."""

import argparse
import os

import torch
from plain_sgd import PlainSGD

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=80)
parser.add_argument("--rise-at", type=int, default=25)
parser.add_argument("--factor", type=float, default=35.0)
parser.add_argument("--save-every", type=int, default=10)
parser.add_argument("--out", default="out")
args = parser.parse_args()

torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = PlainSGD(model.parameters(), lr=1e-4)
x, y = torch.randn(64, 8), torch.randn(64, 1)
os.makedirs(args.out, exist_ok=True)
for step in range(1, args.steps + 1):
    loss = torch.nn.functional.mse_loss(model(x), y)
    if step >= args.rise_at:
        loss = loss * args.factor
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % args.save_every == 0:
        torch.save(model.state_dict(), os.path.join(args.out, f"ckpt-{step}.pt"))
