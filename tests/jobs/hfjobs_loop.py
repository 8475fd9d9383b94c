# /// script
# requires-python = ">=3.10"
# dependencies = []
#
# [tool.hf-jobs]
# flavor = "cpu-basic"
# timeout = "40s"
# secrets = ["MY_JOB_SECRET"]
# ///
"""A stdlib-only loop that carries its HF Jobs settings; --output-dir DIR; checkpoints when the guard asks."""

import argparse
import os
import time

import guard

parser = argparse.ArgumentParser()
parser.add_argument("--output-dir", required=True)
parser.add_argument("--steps", type=int, default=100000)
args = parser.parse_args()
for step in range(1, args.steps + 1):
    guard.report(step=step, loss=2.0 / step)
    time.sleep(0.1)
    if guard.should_checkpoint():
        folder = os.path.join(args.output_dir, f"checkpoint-{step}")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "state.txt"), "w") as handle:
            handle.write(str(step))
        guard.checkpoint_saved(folder, step)
    if guard.should_stop():
        break
print("done", flush=True)
