"""accelerate's ``Accelerator.save_state`` under torchrun on the CPU (gloo), each node on its own disk: every --every
steps ``OUT/step_N/`` (as accelerate's examples name it), where the main process writes model.safetensors,
optimizer.bin, scheduler.bin and custom_checkpoint_0.pkl (the step counter) and every process its own
``random_states_<r>.pkl`` (``accelerate/checkpointing.py``): with one process per node, node 1's folder holds only
``random_states_1.pkl``. On start it resumes with ``accelerator.load_state`` from the checkpoint the guard fetched
(``guard.resume_path()``), else from the newest ``OUT/step_N``, and prints ``rank R: resumed from step S``.
Arguments: ``OUT [--every N] [--step-s S] [--steps N]``."""

import argparse
import os
import time

import torch
from _resume import Counter, resume_from
from accelerate import Accelerator

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--every", type=int, default=20)
parser.add_argument("--step-s", type=float, default=0.05)
parser.add_argument("--steps", type=int, default=10**9)
args = parser.parse_args()


accelerator = Accelerator(cpu=True)
assert accelerator.num_processes == 2, accelerator.num_processes
torch.manual_seed(0)
model = torch.nn.Linear(16, 1)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100)
model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
counter = Counter()
accelerator.register_for_checkpointing(counter)
resume = resume_from(args.out)
if resume:
    accelerator.load_state(resume)
    print(f"rank {accelerator.process_index}: resumed from step {counter.step}", flush=True)
for step in range(counter.step + 1, args.steps + 1):
    counter.step = step
    x = torch.randn(4, 16)
    loss = model(x).pow(2).mean()
    optimizer.zero_grad()
    accelerator.backward(loss)
    optimizer.step()
    scheduler.step()
    if accelerator.is_main_process:
        print(f"step {step} loss {loss.item():.4f}", flush=True)
    if step % args.every == 0:
        accelerator.save_state(os.path.join(args.out, f"step_{step}"))
        print(f"rank {accelerator.process_index}: saved state at step {step}", flush=True)
    time.sleep(args.step_s)
accelerator.end_training()
