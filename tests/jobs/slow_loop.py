"""Prints a loss every 0.1 s for a long time; records its pid in --pid-file."""

import argparse
import os
import time

parser = argparse.ArgumentParser()
parser.add_argument("--pid-file")
args = parser.parse_args()
if args.pid_file:
    with open(args.pid_file, "w") as handle:
        handle.write(str(os.getpid()))
for step in range(1, 100000):
    print(f"step={step} loss={2.0 / step:.4f}", flush=True)
    time.sleep(0.1)
