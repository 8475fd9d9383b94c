"""A loop whose output folder has a file that never answers: ``OUT/latest`` is a named pipe (FIFO) with no writer,
so opening it blocks forever, as a ``stat()`` or ``open()`` on a hung NFS or Lustre hard mount does. Beside it a
DeepSpeed-like ``global_step5`` folder, whose completeness check reads ``latest``: the guard's scan of the folder
never returns. The loop prints a loss every ``--step-s`` seconds until stopped; it never talks to the guard.

--output-dir OUT, --ready FILE (written once the folder is in place), --step-s seconds per step (default 0.2).
"""

import argparse
import os
import time

parser = argparse.ArgumentParser()
parser.add_argument("--output-dir", required=True)
parser.add_argument("--ready", default="")
parser.add_argument("--step-s", type=float, default=0.2)
args = parser.parse_args()

step_dir = os.path.join(args.output_dir, "global_step5")
os.makedirs(step_dir, exist_ok=True)
weights = os.path.join(step_dir, "mp_rank_00_model_states.pt")
with open(weights, "wb") as handle:
    handle.write(b"weights" * 100)
old = time.time() - 60
os.utime(weights, (old, old))
os.mkfifo(os.path.join(args.output_dir, "latest"))  # DeepSpeed writes the saved step's name here; this one hangs
if args.ready:
    with open(args.ready, "w") as handle:
        handle.write("ready\n")
step = 0
while True:
    step += 1
    print(f"step={step} loss={1.0 / step:.4f}", flush=True)
    time.sleep(args.step_s)
