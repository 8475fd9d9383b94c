"""A plain loop that resumes the usual way: ``if os.path.exists("out/ckpt.pt")`` it loads it and goes on from its
step; it saves ``out/ckpt.pt`` every ``--every`` steps (the output folder is hard-coded: the guard learns it only from
the first ``torch.save``). ``--no-load`` never loads (a restart from scratch). Prints ``resumed from step N`` or
``starting fresh``.
"""

import argparse
import os
import time

import torch
from plain_sgd import PlainSGD

parser = argparse.ArgumentParser()
parser.add_argument("--every", type=int, default=10)
parser.add_argument("--steps", type=int, default=100000)
parser.add_argument("--step_s", type=float, default=0.05)
parser.add_argument("--no-load", action="store_true")
args = parser.parse_args()
path = os.path.join("out", "ckpt.pt")

torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
optimizer = PlainSGD(model.parameters(), lr=1e-2)
start = 0
if os.path.exists(path) and not args.no_load:
    state = torch.load(path)
    model.load_state_dict(state["model"])
    start = state["step"]
    print(f"resumed from step {start}", flush=True)
else:
    print("starting fresh", flush=True)
os.makedirs("out", exist_ok=True)
for step in range(start + 1, args.steps + 1):
    x = torch.randn(4, 8)
    loss = (model(x).squeeze(-1) - x.sum(-1)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if step % args.every == 0:
        torch.save({"model": model.state_dict(), "step": step}, path)
    time.sleep(args.step_s)
print("training finished", flush=True)
