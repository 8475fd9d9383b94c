"""Two ranks (gloo, a 5 s collective timeout) that all-reduce every step; --late-rank R stops reaching the
collective at step --late-at (a rank held up: uneven data, a save on one rank only), so the others time out waiting
for it."""

import argparse
import datetime
import time

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--late-rank", type=int, default=1)
parser.add_argument("--late-at", type=int, default=10)
args = parser.parse_args()

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=5))
rank = dist.get_rank()
for step in range(1, 100000):
    if rank == args.late_rank and step == args.late_at:
        print(f"rank {rank}: held up at step {step}", flush=True)
        time.sleep(3600)
    value = torch.ones(1)
    dist.all_reduce(value)
    if rank == 0:
        print(f"step {step} loss {1.0 / step:.4f}", flush=True)
    time.sleep(0.02)
