"""A plain loop that trains --steps steps (one .backward() each), then hangs."""

import argparse
import time

import torch
from plain_sgd import PlainSGD

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=21)
args = parser.parse_args()

model = torch.nn.Linear(4, 1)
opt = PlainSGD(model.parameters(), lr=0.01)
x, y = torch.randn(8, 4), torch.randn(8, 1)
for _step in range(args.steps):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
print("waiting forever", flush=True)
time.sleep(3600)
