"""A plain DeepSpeed loop: ``engine, *_ = deepspeed.initialize(...)``, ``engine.backward(loss)``, ``engine.step()``,
with fp16 loss scaling (2**16) and 4 gradient accumulation steps. DeepSpeed itself is not installed here: the loop
imports the stand-in in ``tests/jobs/_fake_deepspeed`` (its API and its scaling as DeepSpeed's) unless a real one is.

Prints each micro-step's real loss as ``step N loss=X``. Arguments: ``[--steps N]``.
"""

import argparse
import os
import sys

try:
    import deepspeed
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "_fake_deepspeed"))
    import deepspeed
import torch

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=12)
args = parser.parse_args()

torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
config = {"train_micro_batch_size_per_gpu": 64, "gradient_accumulation_steps": 4,
          "fp16": {"enabled": True, "initial_scale_power": 16}, "optimizer": {"type": "SGD", "params": {"lr": 0.05}}}
engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
x, y = torch.randn(64, 8), torch.randn(64, 1) * 3
for step in range(1, args.steps + 1):
    loss = torch.nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    print(f"step {step} loss={loss.item():.6g}", flush=True)
