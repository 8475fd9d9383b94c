"""Hangs after one line; starts a grandchild that ignores SIGTERM and records its pid in --pid-file."""

import argparse
import subprocess
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--pid-file", required=True)
parser.add_argument("--after-steps", type=int, default=0)
args = parser.parse_args()

child = subprocess.Popen([sys.executable, "-c",
                          "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
with open(args.pid_file, "w") as handle:
    handle.write(str(child.pid))
for step in range(1, args.after_steps + 1):
    print(f"step={step} loss={1.0 / step}", flush=True)
print("waiting forever", flush=True)
time.sleep(600)
