"""A tiny causal self-attention model that keeps its additive mask in the state dict, as GPT-style and ALiBi code
does: ``register_buffer("mask", torch.full((T, T), -inf).triu(1))``. The mask holds -inf by design; the weights
train to finite values. Saves OUT/checkpoint-N/model.pt (``torch.save``) or model.safetensors (``--format
safetensors``, a save the agent does not see) every ``--save-every`` steps, and OUT/model.pt (or .safetensors) at
the end. ``--minus-inf-at N``: right after step N's update, one element of a trained weight is set to -inf (an
overflow that gave -inf and nothing else), and the save of that step holds it."""

import argparse
import math
import os
import time

import torch
from plain_sgd import PlainSGD
from safetensors.torch import save_file

parser = argparse.ArgumentParser()
parser.add_argument("--output-dir", required=True)
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--save-every", type=int, default=5)
parser.add_argument("--minus-inf-at", type=int, default=0)
parser.add_argument("--step-s", type=float, default=0.05)
parser.add_argument("--format", choices=("torch", "safetensors"), default="torch")
args = parser.parse_args()

T, D = 6, 8


class CausalAttention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(D, 3 * D)
        self.out = torch.nn.Linear(D, 1)
        self.register_buffer("mask", torch.full((T, T), -math.inf).triu(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(D) + self.mask
        return self.out(scores.softmax(-1) @ v).squeeze(-1)


def write(state: dict[str, torch.Tensor], folder: str, stem: str) -> None:
    if args.format == "safetensors":
        save_file(state, os.path.join(folder, f"{stem}.safetensors"))
    else:
        torch.save({"model": state, "step": step}, os.path.join(folder, f"{stem}.pt"))


torch.manual_seed(0)
model = CausalAttention()
opt = PlainSGD(model.parameters(), lr=0.05)
x = torch.randn(16, T, D)
y = x.cumsum(1).mean(-1)  # depends on the past only
for step in range(1, args.steps + 1):
    loss = (model(x) - y).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step == args.minus_inf_at:
        with torch.no_grad():
            model.qkv.weight[0, 0] = -math.inf
    print(f"step {step} loss={loss.item():.4f}", flush=True)
    if step % args.save_every == 0:
        folder = os.path.join(args.output_dir, f"checkpoint-{step}")
        os.makedirs(folder, exist_ok=True)
        write(model.state_dict(), folder, "model")
    time.sleep(args.step_s)
write(model.state_dict(), args.output_dir, "model")
print("done", flush=True)
