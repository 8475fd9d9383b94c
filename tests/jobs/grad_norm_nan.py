"""A loop whose gradients go NaN at step ``--bad-at`` while its loss stays finite, as in ModernBERT #233 where
``clip_grad_norm_`` returned nan: the gradient of one step is made NaN after ``.backward()`` (a NaN-safe
``nan_to_num`` on the loss would hide it), then clipped (``torch.nn.utils.clip_grad_norm_``, which returns the
NaN total norm and, with ``error_if_nonfinite`` off, scales every gradient by it) and applied. The loss of that
step is finite; every later loss is NaN unless ``--hide`` (``nan_to_num`` on the loss: 0.0). Saves
OUT/ckpt-N.pt every ``--every`` steps.

Usage: ``grad_norm_nan.py OUT [--steps 40] [--bad-at 22] [--every 10] [--hide]``
"""

import argparse
import os
import time

import torch
from torch.nn.utils import clip_grad_norm_

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--bad-at", type=int, default=22)
parser.add_argument("--every", type=int, default=10)
parser.add_argument("--hide", action="store_true")
args = parser.parse_args()
os.makedirs(args.out, exist_ok=True)
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
for step in range(1, args.steps + 1):
    x = torch.randn(4, 8)
    loss = (model(x).squeeze(-1) - x.sum(-1)).pow(2).mean()
    if args.hide:
        loss = torch.nan_to_num(loss, nan=0.0)
    optimizer.zero_grad()
    loss.backward()
    if step == args.bad_at:
        model.weight.grad[0, 0] = float("nan")
    clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    time.sleep(0.02)
    if step % args.every == 0:
        torch.save({"model": model.state_dict(), "step": step}, os.path.join(args.out, f"ckpt-{step}.pt"))
print("training finished", flush=True)
