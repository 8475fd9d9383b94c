"""A plain loop with gradient accumulation, as nanoGPT's: ``--accum`` micro-batches per ``torch.optim.SGD`` step,
``OUT/ckpt-ITER.pt`` saved every ``--every`` iterations (``{"model", "iter"}``), the loss NaN from iteration
``--nan-at`` (0: never). It prints each iteration's loss (its micro-batches' mean) and never talks to the guard.

Usage: ``accumulating_loop.py OUT [--iters 30] [--accum 8] [--every 5] [--nan-at 0] [--step-s 0]``
"""

import argparse
import os
import time

import torch

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--iters", type=int, default=30)
parser.add_argument("--accum", type=int, default=8)
parser.add_argument("--every", type=int, default=5)
parser.add_argument("--nan-at", type=int, default=0)
parser.add_argument("--step-s", type=float, default=0.0)
args = parser.parse_args()
os.makedirs(args.out, exist_ok=True)
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
for iter_num in range(1, args.iters + 1):
    step_loss = 0.0
    for _ in range(args.accum):
        x = torch.randn(4, 8)
        loss = (model(x).squeeze(-1) - x.sum(-1)).pow(2).mean() / args.accum
        if args.nan_at and iter_num >= args.nan_at:
            loss = loss * float("nan")
        loss.backward()
        step_loss += loss.item()
    print(f"iter {iter_num}: loss {step_loss:.6f}", flush=True)  # the mean of its micro-batches, as nanoGPT says
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    time.sleep(args.step_s)
    if iter_num % args.every == 0:
        torch.save({"model": model.state_dict(), "iter": iter_num}, os.path.join(args.out, f"ckpt-{iter_num}.pt"))
print("training finished", flush=True)
