"""A loop that saves as timm's ``CheckpointSaver`` does (timm PR #693): each epoch ``torch.save`` into
``OUT/tmp.pth.tar``, then ``os.replace`` to ``OUT/last.pth.tar`` and a hard link ``OUT/checkpoint-E.pth.tar`` (the
best ``--keep`` are kept). Exits 0 after ``--epochs``. Arguments: ``OUT [--epochs N] [--steps-per-epoch N]
[--step-s S] [--keep N]``.
"""

import argparse
import os
import time

import torch
from plain_sgd import PlainSGD

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--steps-per-epoch", type=int, default=10)
parser.add_argument("--step-s", type=float, default=0.02)
parser.add_argument("--keep", type=int, default=2)
args = parser.parse_args()
os.makedirs(args.out, exist_ok=True)
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
optimizer = PlainSGD(model.parameters(), lr=1e-2)
kept = []
for epoch in range(1, args.epochs + 1):
    for _ in range(args.steps_per_epoch):
        x = torch.randn(4, 8)
        loss = (model(x).squeeze(-1) - x.sum(-1)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        time.sleep(args.step_s)
    tmp, last = os.path.join(args.out, "tmp.pth.tar"), os.path.join(args.out, "last.pth.tar")
    torch.save({"epoch": epoch, "state_dict": model.state_dict()}, tmp)
    os.replace(tmp, last)
    named = os.path.join(args.out, f"checkpoint-{epoch}.pth.tar")
    os.link(last, named)
    kept.append(named)
    while len(kept) > args.keep:
        os.remove(kept.pop(0))
    print(f"epoch {epoch} saved", flush=True)
print("training finished", flush=True)
