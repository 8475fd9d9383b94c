"""A 2-process DDP loop on the CPU (gloo), for torchrun: --nan-rank R --nan-at K, --block-rank R --block-at K;
--independent: each rank trains its own model (no collective per step), so one rank can stop while the others
go on."""

import argparse
import os
import time

import torch
import torch.distributed as dist
from plain_sgd import PlainSGD

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=1000)
parser.add_argument("--step-s", type=float, default=0.1)
parser.add_argument("--nan-rank", type=int, default=-1)
parser.add_argument("--nan-at", type=int, default=0)
parser.add_argument("--block-rank", type=int, default=-1)
parser.add_argument("--block-at", type=int, default=0)
parser.add_argument("--pid-dir")
parser.add_argument("--independent", action="store_true")
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
if args.pid_dir:
    with open(os.path.join(args.pid_dir, f"rank{rank}.pid"), "w") as handle:
        handle.write(str(os.getpid()))
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
if not args.independent:
    model = torch.nn.parallel.DistributedDataParallel(model)
opt = PlainSGD(model.parameters(), lr=0.01)
x, y = torch.randn(32, 8), torch.randn(32, 1)
for step in range(1, args.steps + 1):
    if rank == args.block_rank and step == args.block_at:
        print(f"rank {rank}: stuck at step {step}", flush=True)
        time.sleep(3600)
    loss = torch.nn.functional.mse_loss(model(x), y)
    if rank == args.nan_rank and step == args.nan_at:
        loss = loss * float("nan")
    opt.zero_grad()
    loss.backward()
    opt.step()
    if rank == 0:
        print(f"step {step}", flush=True)
    time.sleep(args.step_s)
dist.destroy_process_group()
