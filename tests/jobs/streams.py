"""Output shapes: --lines N numbered lines; --partial (a prompt without newline, then a pause); --verdict; --cr."""

import argparse
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--lines", type=int, default=0)
parser.add_argument("--partial", action="store_true")
parser.add_argument("--verdict", action="store_true")
parser.add_argument("--cr", action="store_true")
args = parser.parse_args()

if args.lines:
    out = sys.stdout
    for i in range(args.lines):
        out.write(f"line {i}\n")
    out.flush()
if args.partial:
    sys.stdout.write("Enter a value: ")
    sys.stdout.flush()
    time.sleep(3)
    sys.stdout.write("42\n")
if args.verdict:
    print("VERDICT: PASS my own verdict accuracy=0.9")
    print("VERDICT: FAIL printed by the job", file=sys.stderr)
if args.cr:
    for i in range(5):
        sys.stdout.write(f"\rprogress {i}/5")
        sys.stdout.flush()
    sys.stdout.write("\n")
