"""accelerate's own checkpointing, unmodified calls: ``Accelerator(project_config=ProjectConfiguration(project_dir=
OUT, automatic_checkpoint_naming=True))`` and ``accelerator.save_state()`` every ``--every`` steps, which writes
``OUT/checkpoints/checkpoint_N/`` (model.safetensors, optimizer.bin, scheduler.bin, sampler, random_states_0.pkl
last) (awslabs/awsome-distributed-ai #190). On the CPU. Arguments: ``OUT [--every N] [--step_s S]``.
"""

import argparse
import time

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--every", type=int, default=20)
parser.add_argument("--step_s", type=float, default=0.05)
args = parser.parse_args()
accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=args.out,
                                                                         automatic_checkpoint_naming=True,
                                                                         total_limit=2))
torch.manual_seed(0)
model = torch.nn.Linear(16, 1)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100)
model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
for step in range(1, 100000):
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
