"""ModernBERT #233 replayed on the CPU: a "NaN-safe" masked mean (``torch.where(count > 0, total / count, 0.0)``)
keeps the loss finite (0.0) on a batch with nothing to predict, but its backward is 0 * (0/0) = NaN: the gradients
and then the weights go NaN, and with each error passed through ``nan_to_num`` every later loss is 0.0, finite.
Saves OUT/checkpoint-N/model.pt with torch.save every --save-every steps; the batch of step --empty-at has no
labelled token; OUT/model.pt at the end. ``--format safetensors``: OUT/checkpoint-N/model.safetensors and
OUT/model.safetensors written with ``safetensors.torch.save_file`` instead (a save the agent does not see: the guard
finds the folders on disk and reads their weights itself). ``--nan-on-term``: on SIGTERM, the next step's batch is the
empty one, its save (NaN weights, finite loss) is the last, and the job ends without a final model."""

import argparse
import os
import signal
import time

import torch
from plain_sgd import PlainSGD
from safetensors.torch import save_file

parser = argparse.ArgumentParser()
parser.add_argument("--output-dir", required=True)
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--save-every", type=int, default=10)
parser.add_argument("--empty-at", type=int, default=25)
parser.add_argument("--step-s", type=float, default=0.05)
parser.add_argument("--format", choices=("torch", "safetensors"), default="torch")
parser.add_argument("--nan-on-term", action="store_true")
args = parser.parse_args()
stopping = []
if args.nan_on_term:
    signal.signal(signal.SIGTERM, lambda signum, frame: stopping.append(signum))

torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = PlainSGD(model.parameters(), lr=0.05)
x, y = torch.randn(64, 8), torch.randn(64)
for step in range(1, args.steps + 1):
    last = bool(stopping)
    mask = torch.zeros(64) if step == args.empty_at or last else (torch.rand(64) > 0.5).float()
    errors = torch.nan_to_num((model(x).squeeze(-1) - y) ** 2) * mask  # "NaN-safe": a NaN error counts 0
    count = mask.sum()
    loss = torch.where(count > 0, errors.sum() / count, torch.zeros(()))
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss={loss.item():.4f}", flush=True)
    if step % args.save_every == 0 or last:
        folder = os.path.join(args.output_dir, f"checkpoint-{step}")
        os.makedirs(folder, exist_ok=True)
        if args.format == "safetensors":
            save_file(model.state_dict(), os.path.join(folder, "model.safetensors"))
        else:
            torch.save({"model": model.state_dict(), "step": step}, os.path.join(folder, "model.pt"))
    if last:
        print(f"stopped at step {step}", flush=True)
        raise SystemExit(0)
    time.sleep(args.step_s)
if args.format == "safetensors":
    save_file(model.state_dict(), os.path.join(args.output_dir, "model.safetensors"))
else:
    torch.save(model.state_dict(), os.path.join(args.output_dir, "model.pt"))
print("done", flush=True)
