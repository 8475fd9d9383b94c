"""A plain loop of ``--steps`` optimizer steps (``torch.optim.SGD``) that saves ``out/ckpt.pt`` at its last step and,
when that file exists, loads it and goes on from its step: run again after it finished (``--resume on``), it has
nothing left to train and exits 0 having made no step. ``--summary``: after the loop, print the last step's loss, as
transformers' ``run_clm_no_trainer.py`` prints the perplexity its loop computed: with no step run, that variable was
never set and the job crashes (``NameError`` here, ``UnboundLocalError`` in its function)."""

import argparse
import os

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--summary", action="store_true")
args = parser.parse_args()
path = os.path.join("out", "ckpt.pt")
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
start = 0
if os.path.exists(path):
    state = torch.load(path)
    model.load_state_dict(state["model"])
    start = state["step"]
    print(f"resumed from step {start}", flush=True)
os.makedirs("out", exist_ok=True)
for step in range(start + 1, args.steps + 1):
    x = torch.randn(8, 4)
    loss = (model(x).squeeze(-1) - x.sum(-1)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
    last = loss.item()
    if step == args.steps:
        torch.save({"model": model.state_dict(), "step": step}, path)
if args.summary:
    print(f"last loss {last:.4f}")  # set only by the loop, as in run_clm_no_trainer.py
