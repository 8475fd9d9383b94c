"""A plain loop (``torch.save`` only) that saves each checkpoint into a new folder, ``OUT/run-N/model.pt``, every
``--every`` steps and exits 0 after ``--steps``; with ``--dev-null`` it first saves a throwaway copy to ``/dev/null``
(a save timed, not kept) each time. Arguments: ``OUT [--steps N] [--every N] [--step-s S] [--dev-null]``.
"""

import argparse
import os
import time

import torch
from plain_sgd import PlainSGD

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--steps", type=int, default=50)
parser.add_argument("--every", type=int, default=10)
parser.add_argument("--step-s", type=float, default=0.02)
parser.add_argument("--dev-null", action="store_true")
args = parser.parse_args()
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
optimizer = PlainSGD(model.parameters(), lr=1e-2)
for step in range(1, args.steps + 1):
    x = torch.randn(4, 8)
    loss = (model(x).squeeze(-1) - x.sum(-1)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if step % args.every == 0:
        state = {"model": model.state_dict(), "step": step}
        if args.dev_null:
            torch.save(state, "/dev/null")
        folder = os.path.join(args.out, f"run-{step}")
        os.makedirs(folder, exist_ok=True)
        torch.save(state, os.path.join(folder, "model.pt"))
        print(f"saved {folder}", flush=True)
    time.sleep(args.step_s)
print("training finished", flush=True)
