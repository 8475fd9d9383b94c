"""A plain loop for the securing plan's event orders: it saves OUT/checkpoint-N/ every --save-every steps (reported
with guard.checkpoint_saved) and, with --answer, saves when the guard asks (guard.should_checkpoint).

--nan-after-s S: the loss is NaN from S seconds after the first step on, and periodic saves stop then (the NaN sits
in an unread --check-every window until the guard's request is answered: the weights saved then are NaN).
--slow-answer-s S: a requested save takes S seconds more (a long step before it).
--until-epoch E: train until the wall clock passes E, then write the final model (OUT/model.pt) and exit 0.
--plain: save with torch.save only (the guard sees the files), never call the guard's API.
"""

import argparse
import os
import time

import torch
from plain_sgd import PlainSGD

import guard

parser = argparse.ArgumentParser()
parser.add_argument("--output-dir", required=True)
parser.add_argument("--step-s", type=float, default=0.05)
parser.add_argument("--save-every", type=int, default=20)
parser.add_argument("--answer", action="store_true")
parser.add_argument("--nan-after-s", type=float, default=0.0)
parser.add_argument("--slow-answer-s", type=float, default=0.0)
parser.add_argument("--until-epoch", type=float, default=0.0)
parser.add_argument("--plain", action="store_true", help="save with torch.save only, no guard API")
args = parser.parse_args()

torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = PlainSGD(model.parameters(), lr=0.05)
x, y = torch.randn(64, 8), torch.randn(64, 1)


def save(step: int) -> None:
    folder = os.path.join(args.output_dir, f"checkpoint-{step}")
    os.makedirs(folder, exist_ok=True)
    torch.save({"model": model.state_dict(), "step": step}, os.path.join(folder, "model.pt"))
    if not args.plain:
        guard.checkpoint_saved(folder, step=step)


first = None
step = 0
while True:
    step += 1
    now = time.time()
    first = first or now
    if args.until_epoch and now >= args.until_epoch:
        break
    nan = bool(args.nan_after_s) and now - first >= args.nan_after_s
    loss = torch.nn.functional.mse_loss(model(x), y)
    if nan:
        loss = loss * float("nan")
    opt.zero_grad()
    loss.backward()
    opt.step()
    if args.answer and guard.should_checkpoint():
        time.sleep(args.slow_answer_s)
        save(step)  # ends the process when the guard asked for a stop
    elif step % args.save_every == 0 and not nan:
        save(step)
    time.sleep(args.step_s)

torch.save(model.state_dict(), os.path.join(args.output_dir, "model.pt"))
print(f"training complete at step {step}", flush=True)
