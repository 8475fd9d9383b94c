"""accelerate's own checkpointing, unmodified calls: ``Accelerator(project_config=ProjectConfiguration(project_dir=
OUT, automatic_checkpoint_naming=True))`` and ``accelerator.save_state()`` every ``--every`` steps, which writes
``OUT/checkpoints/checkpoint_N/`` (model.safetensors, optimizer.bin, scheduler.bin, sampler, random_states_0.pkl
last) (awslabs/awsome-distributed-ai #190). On the CPU. ``--resume``: ``accelerator.load_state()`` first (accelerate
picks the highest-numbered ``checkpoint_N``), the step counter registered for checkpointing, the next save named
after the loaded one; prints ``resumed from DIR at step S``. Arguments: ``OUT [--every N] [--step_s S] [--resume]
[--steps N]``.
"""

import argparse
import os
import re
import time

import torch
from _resume import Counter
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--every", type=int, default=20)
parser.add_argument("--step_s", type=float, default=0.05)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--steps", type=int, default=100000)
args = parser.parse_args()


accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=args.out,
                                                                         automatic_checkpoint_naming=True,
                                                                         total_limit=2))
torch.manual_seed(0)
model = torch.nn.Linear(16, 1)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100)
model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
counter = Counter()
accelerator.register_for_checkpointing(counter)
saved = os.path.join(args.out, "checkpoints")
if args.resume and os.path.isdir(saved) and os.listdir(saved):
    accelerator.load_state()
    newest = max(os.listdir(saved), key=lambda name: int(re.findall(r"[0-9]+", name)[0]))  # as accelerate sorts
    accelerator.project_configuration.iteration = int(re.findall(r"[0-9]+", newest)[0]) + 1
    print(f"resumed from {os.path.join(saved, newest)} at step {counter.step}", flush=True)
for step in range(counter.step + 1, args.steps + 1):
    counter.step = step
    x = torch.randn(4, 16)
    loss = model(x).pow(2).mean()
    optimizer.zero_grad()
    accelerator.backward(loss)
    optimizer.step()
    scheduler.step()
    if step % args.every == 0:
        accelerator.save_state()
        print(f"saved state at step {step}", flush=True)
    time.sleep(args.step_s)
