"""Ends in a chosen way: --code N (exit N), --raise (ValueError), --sigkill, --oom (torch.OutOfMemoryError)."""

import argparse
import os
import signal
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--code", type=int, default=0)
parser.add_argument("--raise", dest="raise_", action="store_true")
parser.add_argument("--sigkill", action="store_true")
parser.add_argument("--oom", action="store_true")
args = parser.parse_args()

print("step 1 loss 1.0", flush=True)
if args.raise_:
    raise ValueError("bad batch in shard 3")
if args.sigkill:
    os.kill(os.getpid(), signal.SIGKILL)
if args.oom:
    import torch

    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (GPU 0; 79.15 GiB total capacity)")
sys.exit(args.code)
