"""Two ranks under torchrun (gloo), each with its own model (no collective per step): rank 1's loss is 10,000 times
rank 0's, and rank 0 starts --delay-s later, so rank 1's first steps reach the guard first."""

import argparse
import time

import torch
import torch.distributed as dist
from plain_sgd import PlainSGD

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--delay-s", type=float, default=1.5)
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
if rank == 0:
    time.sleep(args.delay_s)
torch.manual_seed(rank)
model = torch.nn.Linear(4, 1)
opt = PlainSGD(model.parameters(), lr=1e-7 if rank == 1 else 1e-3)  # the same updates
x, y = torch.randn(16, 4), torch.randn(16, 1)
for _step in range(args.steps):
    loss = torch.nn.functional.mse_loss(model(x), y) * (10_000.0 if rank == 1 else 1.0)
    opt.zero_grad()
    loss.backward()
    opt.step()
dist.barrier()
dist.destroy_process_group()
