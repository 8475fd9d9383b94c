"""accelerate's examples' own checkpointing with ``--checkpointing_steps epoch``: ``accelerator.save_state(
f"{OUT}/epoch_{epoch}")`` at the end of each epoch (accelerate's ``examples/complete_nlp_example.py``, transformers'
``run_*_no_trainer.py``), which writes model.safetensors (with safetensors, not ``torch.save``), optimizer.bin,
scheduler.bin and random_states_0.pkl last. On the CPU. ``--resume_from_checkpoint DIR``: ``accelerator.load_state(
DIR)`` first, training going on from the epoch after the one its name says (as the examples read ``epoch_N``; a
name without one starts at epoch 0); prints ``resumed from DIR at step S`` (S: the optimizer's step count loaded).
Arguments: ``OUT [--epochs N] [--steps_per_epoch N] [--step_s S] [--resume_from_checkpoint DIR]``.
"""

import argparse
import os
import re
import time

import torch
from accelerate import Accelerator

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--steps_per_epoch", type=int, default=20)
parser.add_argument("--step_s", type=float, default=0.02)
parser.add_argument("--resume_from_checkpoint", default=None)
args = parser.parse_args()

accelerator = Accelerator(cpu=True)
torch.manual_seed(0)
model = torch.nn.Linear(16, 1)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100)
model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
start = 0
if args.resume_from_checkpoint:
    accelerator.load_state(args.resume_from_checkpoint)
    named = re.fullmatch(r"epoch_([0-9]+)", os.path.basename(os.path.normpath(args.resume_from_checkpoint)))
    start = int(named[1]) + 1 if named else 0
    step = max(int(s["step"]) for s in optimizer.state_dict()["state"].values())
    print(f"resumed from {args.resume_from_checkpoint} at step {step}", flush=True)
for epoch in range(start, args.epochs):
    for _ in range(args.steps_per_epoch):
        loss = model(torch.randn(4, 16)).pow(2).mean()
        optimizer.zero_grad()
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        time.sleep(args.step_s)
    accelerator.save_state(os.path.join(args.out, f"epoch_{epoch}"))
    print(f"saved state at epoch {epoch}", flush=True)
