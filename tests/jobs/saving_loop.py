"""A plain loop that saves OUT/checkpoint-N/ every --save-every steps and reports it with guard.checkpoint_saved;
--nan-at, --crash-at or --hang-at K make step K fail (NaN loss from then on, an exception, a hang); --blow-at K
leaves finite weights of 1e30 after step K's update (an Adam step at a learning rate of 1e6 does the like), so step
K's checkpoint holds finite tensors only and step K+1's loss, their forward pass, is inf. --keep N deletes all but
the newest N checkpoint folders after each save, --save-pause-s sleeps after each save; with the guard's --resume
it loads the checkpoint the guard fetched and says "resumed at step N" (with "weights sane": finite and below 1e20,
else "weights blown up or not finite")."""

import argparse
import os
import shutil
import time

import torch
from plain_sgd import PlainSGD

try:
    import guard
except ImportError:  # run without the guard
    guard = None

parser = argparse.ArgumentParser()
parser.add_argument("--output-dir", required=True)
parser.add_argument("--steps", type=int, default=100000)
parser.add_argument("--step-s", type=float, default=0.05)
parser.add_argument("--save-every", type=int, default=10)
parser.add_argument("--nan-at", type=int, default=0)
parser.add_argument("--crash-at", type=int, default=0)
parser.add_argument("--hang-at", type=int, default=0)
parser.add_argument("--blow-at", type=int, default=0)
parser.add_argument("--keep", type=int, default=0)
parser.add_argument("--save-pause-s", type=float, default=0.0)
args = parser.parse_args()

torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = PlainSGD(model.parameters(), lr=0.05)
x, y = torch.randn(64, 8), torch.randn(64, 1)
start = 1
resume = guard.resume_path() if guard is not None else None
if resume:
    state = torch.load(os.path.join(resume, "model.pt"), weights_only=True)
    model.load_state_dict(state["model"])
    sane = all(bool(torch.isfinite(t).all()) and float(t.abs().max()) < 1e20 for t in state["model"].values())
    print(f"resumed at step {state['step']} ({'weights sane' if sane else 'weights blown up or not finite'})",
          flush=True)
    start = state["step"] + 1
for step in range(start, args.steps + 1):
    if step == args.crash_at:
        raise RuntimeError(f"boom at step {step}")
    if step == args.hang_at:
        time.sleep(3600)
    loss = torch.nn.functional.mse_loss(model(x), y)
    if args.nan_at and step >= args.nan_at:
        loss = loss * float("nan")
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step == args.blow_at:
        with torch.no_grad():
            model.weight.fill_(1e30)
    print(f"step {step} loss={loss.item():.4f}", flush=True)
    if step % args.save_every == 0:
        folder = os.path.join(args.output_dir, f"checkpoint-{step}")
        os.makedirs(folder, exist_ok=True)
        torch.save({"model": model.state_dict(), "step": step}, os.path.join(folder, "model.pt"))
        if guard is not None:
            guard.checkpoint_saved(folder, step=step)
        if args.keep:
            folders = sorted((f for f in os.listdir(args.output_dir) if f.startswith("checkpoint-")),
                             key=lambda f: int(f.split("-")[1]))
            for old in folders[:-args.keep]:
                shutil.rmtree(os.path.join(args.output_dir, old))
        time.sleep(args.save_pause_s)
    time.sleep(args.step_s)
