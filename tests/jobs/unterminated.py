"""A job whose last output is a carriage-return progress bar with no newline (on stdout, or --stream stderr)."""

import argparse
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--stream", default="stdout", choices=["stdout", "stderr"])
parser.add_argument("--code", type=int, default=0)
args = parser.parse_args()

stream = sys.stdout if args.stream == "stdout" else sys.stderr
print("starting", flush=True)
for pct in (0, 50, 100):
    bar = "#" * (pct // 25)
    stream.write(f"\rprogress {pct}%|{bar:<4}| loss=0.5")
    stream.flush()
sys.exit(args.code)
