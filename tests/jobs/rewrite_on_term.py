"""A plain loop that saves ``OUT/ckpt.pt`` with ``torch.save`` every ``--every`` steps and, on SIGTERM, rewrites
``ckpt.pt`` in place with raw writes, chunk by chunk over ``--write_s`` seconds (longer than the guard's
``--grace``), as a handler that serializes a large model to a file it streams would (petuum/adaptdl #70).

The file is cut short while the guard would push it: it must never be secured nor replace a secured copy.
Arguments: ``OUT_DIR [--every N] [--write_s S] [--step_s S] [--ready PATH]``.
"""

import argparse
import io
import os
import signal
import sys
import time

import torch

parser = argparse.ArgumentParser()
parser.add_argument("out_dir")
parser.add_argument("--every", type=int, default=10)
parser.add_argument("--write_s", type=float, default=20.0)
parser.add_argument("--ready", default="")
parser.add_argument("--step_s", type=float, default=0.02)
args = parser.parse_args()
os.makedirs(args.out_dir, exist_ok=True)
path = os.path.join(args.out_dir, "ckpt.pt")

torch.manual_seed(0)
model = torch.nn.Linear(512, 512)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
step = 0


def state() -> dict:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}


def on_term(signum, frame):
    buffer = io.BytesIO()
    torch.save(state(), buffer)
    data = buffer.getvalue()
    chunks = 20
    print(f"SIGTERM: rewriting {path} ({len(data)} bytes) over {args.write_s}s", flush=True)
    with open(path, "wb") as file:  # in place: the good save is gone from here on
        for i in range(chunks):
            file.write(data[i * len(data) // chunks:(i + 1) * len(data) // chunks])
            file.flush()
            time.sleep(args.write_s / chunks)
    sys.exit(143)


signal.signal(signal.SIGTERM, on_term)
for step in range(1, 100000):
    x = torch.randn(4, 512)
    loss = model(x).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if step % args.every == 0:
        torch.save(state(), path)
        print(f"saved step {step}", flush=True)
        if args.ready and step >= 3 * args.every:
            open(args.ready, "a").close()
    time.sleep(args.step_s)
