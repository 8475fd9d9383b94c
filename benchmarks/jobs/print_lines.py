"""Writes N log lines with ``print()``, as a chatty training script does, for ``bench_run.py``'s passthrough.

With ``--gate PATH`` the lines are written in turns, ``--segment-lines`` at a time, each when the benchmark says so
(``gate.py``), with ``sys.stdout.flush()`` at the end of every turn so that a turn's lines have left the process
(to the file, or into the guard's pipe) within its time; ``--cpu`` pins every thread of the process to one core.
The CPU time the process used between turns is printed to stderr at the end: ``bench: wait_cpu_s=SECONDS``.

Run: ``python benchmarks/jobs/print_lines.py [--lines 1000000] [--gate PATH --label NAME --cpu N
--segment-lines 100000]``
"""

import argparse
import sys

from gate import Gate, pin_threads, run_in_turns

parser = argparse.ArgumentParser()
parser.add_argument("--lines", type=int, default=1_000_000)
parser.add_argument("--gate", help="write in turns, told by the benchmark on this Unix socket")
parser.add_argument("--label", default="job")
parser.add_argument("--cpu", type=int, help="pin every thread of this process to this CPU")
parser.add_argument("--segment-lines", type=int, default=100_000)
args = parser.parse_args()


def write(start: int, stop: int) -> None:
    for i in range(start, stop):
        print(f"line {i}: epoch 0 batch {i % 1000} of 1000, samples/s 1234.5, lr 3.0e-04")


if args.gate is None:
    write(0, args.lines)
else:
    if args.cpu is not None:
        pin_threads(args.cpu)

    def turn(start: int, count: int) -> None:
        write(start, start + count)
        sys.stdout.flush()

    gate = Gate(args.gate, args.label)
    run_in_turns(gate, args.lines, args.segment_lines, turn)
    print(f"bench: wait_cpu_s={gate.wait_cpu_s:.6f}", file=sys.stderr, flush=True)
