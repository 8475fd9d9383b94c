"""A plain loop whose model runs under torch.compile(mode="reduce-overhead") (CUDA-graph trees on a GPU: each replay
overwrites the previous step's loss tensor), with a NaN loss at --nan-at; exits 0 if nothing stops it."""

import argparse

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--nan-at", type=int, default=37)
args = parser.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
step_fn = torch.compile(lambda x, y: torch.nn.functional.mse_loss(model(x), y), mode="reduce-overhead")
x, y = torch.randn(64, 32, device=device), torch.randn(64, 1, device=device)
for step in range(1, args.steps + 1):
    target = y * float("nan") if step == args.nan_at else y
    loss = step_fn(x, target)
    opt.zero_grad()
    loss.backward()
    opt.step()
print("training finished", flush=True)
