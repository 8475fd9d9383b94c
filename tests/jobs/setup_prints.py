"""A healthy plain loop that prints set-up numbers before its first step: `best loss: inf`, a placeholder
`loss=nan` (nothing trained yet), then trains --steps steps and prints each real loss."""

import argparse

import torch
from plain_sgd import PlainSGD

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=12)
args = parser.parse_args()

best = float("inf")
print(f"best loss: {best}", flush=True)
print(f"resuming: no checkpoint, loss={float('nan')}", flush=True)  # a placeholder before any step
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = PlainSGD(model.parameters(), lr=0.05)
x, y = torch.randn(32, 4), torch.randn(32, 1)
for step in range(1, args.steps + 1):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    best = min(best, loss.item())
    print(f"step {step} loss={loss.item():.4f} best loss: {best:.4f}", flush=True)
