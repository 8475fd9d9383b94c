"""Writes N log lines with ``print()``, as a chatty training script does, for ``bench_run.py``'s passthrough.

Run: ``python benchmarks/jobs/print_lines.py [--lines 1000000]``
"""

import argparse

parser = argparse.ArgumentParser()
parser.add_argument("--lines", type=int, default=1_000_000)
args = parser.parse_args()

for i in range(args.lines):
    print(f"line {i}: epoch 0 batch {i % 1000} of 1000, samples/s 1234.5, lr 3.0e-04")
