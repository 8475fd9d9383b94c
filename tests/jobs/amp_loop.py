"""A mixed-precision plain loop on the CPU.

Autocast + ``torch.amp.GradScaler("cpu")``, ``scaler.scale(loss).backward()``.

Prints each step's real (unscaled) loss as ``step N loss=X``. ``--collapse``: the gradients overflow at every step
(inf), so the scaler skips every optimizer step while the loss stays finite. ``--accelerate``: the same loop through
``accelerate``'s ``Accelerator(gradient_accumulation_steps=4).backward(loss)`` instead.
"""

import argparse
import time

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--step-s", type=float, default=0.0)
parser.add_argument("--collapse", action="store_true")
parser.add_argument("--accelerate", action="store_true")
args = parser.parse_args()


class Overflow(torch.autograd.Function):
    """Identity forward; its backward overflows (inf), as an fp16 activation's gradient does."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
x, y = torch.randn(64, 8), torch.randn(64, 1) * 3
if args.accelerate:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=4)
    model, opt = accelerator.prepare(model, opt)
scaler = torch.amp.GradScaler("cpu", init_scale=65536.0)
for step in range(1, args.steps + 1):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
        if args.collapse:
            out = Overflow.apply(out)
        loss = torch.nn.functional.mse_loss(out.float(), y)
    opt.zero_grad()
    if args.accelerate:
        accelerator.backward(loss)
        opt.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    print(f"step {step} loss={loss.item():.6g}", flush=True)
    if args.step_s:
        time.sleep(args.step_s)
