"""Leaves a complete checkpoint-10 and keeps writing a partial checkpoint-20; never talks to the guard.

It ignores the guard's requests (it has no loop the agent could steer) and handles SIGTERM by carrying on.
"""

import argparse
import json
import os
import signal
import time

parser = argparse.ArgumentParser()
parser.add_argument("--output-dir", required=True)
args = parser.parse_args()

signal.signal(signal.SIGTERM, lambda *a: print("job: SIGTERM, still writing", flush=True))
done = os.path.join(args.output_dir, "checkpoint-10")
os.makedirs(done, exist_ok=True)
with open(os.path.join(done, "model.bin"), "wb") as handle:
    handle.write(b"complete weights" * 1000)
with open(os.path.join(done, "trainer_state.json"), "w") as handle:
    json.dump({"global_step": 10}, handle)
old = time.time() - 60
for name in os.listdir(done):
    os.utime(os.path.join(done, name), (old, old))
partial = os.path.join(args.output_dir, "checkpoint-20")
os.makedirs(partial, exist_ok=True)
print("step=10 loss=0.5", flush=True)
for _ in range(10000):
    with open(os.path.join(partial, "model.bin"), "ab") as handle:
        handle.write(b"partial" * 100)
    time.sleep(0.1)
