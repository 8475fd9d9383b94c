"""Leaves orphans that exit (zombies for their new parent to reap), then trains slowly and saves checkpoints."""

import argparse
import json
import os
import subprocess
import time

import guard

parser = argparse.ArgumentParser()
parser.add_argument("--output-dir", required=True)
args = parser.parse_args()

for _ in range(3):  # `sh` exits at once; its `sleep` is orphaned, re-parented to PID 1 (the guard), and exits
    subprocess.run(["sh", "-c", "sleep 0.2 & exit 0"], check=True)
print(f"pid {os.getpid()}, orphans left", flush=True)
for step in range(1, 100000):
    guard.report(step=step, loss=1.0 / step)
    if step % 5 == 0 or guard.should_checkpoint():
        path = os.path.join(args.output_dir, f"checkpoint-{step}")
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "weights.bin"), "wb") as handle:
            handle.write(os.urandom(1000))
        with open(os.path.join(path, "guard_checkpoint.json"), "w") as handle:
            json.dump({"step": step}, handle)
        guard.checkpoint_saved(path, step)
    if guard.should_stop():
        print(f"stopping at step {step}", flush=True)
        break
    time.sleep(0.1)
