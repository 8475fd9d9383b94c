"""A plain loop over a DataLoader that yields nothing (--samples N < --batch-size with drop_last), saving its model
and exiting 0; --eval: an evaluation script (no optimizer, no training) over the same data."""

import argparse
import os

import torch
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--samples", type=int, default=3)
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--eval", action="store_true")
parser.add_argument("--out", default="out")
args = parser.parse_args()

data = TensorDataset(torch.randn(args.samples, 4), torch.randn(args.samples, 1))
loader = DataLoader(data, batch_size=args.batch_size, drop_last=True)
model = torch.nn.Linear(4, 1)
if args.eval:
    with torch.no_grad():
        total = sum(float(torch.nn.functional.mse_loss(model(x), y)) for x, y in loader)
    print(f"evaluated {len(loader)} batches, total {total}")
else:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _epoch in range(2):
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    os.makedirs(args.out, exist_ok=True)
    torch.save(model.state_dict(), os.path.join(args.out, "model.pt"))
    print("training done")
