"""A tiny CPU training loop with ~7-10 ms steps (one torch thread), for ``bench_run.py``'s step overhead.

It times only its own loop (``time.perf_counter`` around the steps, after the model is built and one warm-up
step is done) and prints it as the last line: ``bench: steps=N loop_s=SECONDS cpu_s=SECONDS step_ms=MS ...``,
so that start-up (interpreter, torch import, the guard) does not count. Nothing is printed inside the loop: output
costs are measured by ``print_lines.py``. ``cpu_s`` is the process's CPU time over the loop (``time.process_time``,
every thread of the process).

With ``--gate PATH`` the loop runs in turns, ``--segment-steps`` steps at a time, each when the benchmark says so
(``gate.py``, the protocol on the Unix socket ``PATH``); ``--cpu`` pins every thread of the process to one core.

Run: ``python benchmarks/jobs/train_loop.py [--steps 300] [--hidden 512] [--batch 256] [--threads 1]
[--gate PATH --label NAME --cpu N --segment-steps 10]``
"""

import argparse
import time

import torch
from gate import Gate, pin_threads, run_in_turns

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--hidden", type=int, default=512)
parser.add_argument("--batch", type=int, default=256)
parser.add_argument("--threads", type=int, default=1)
parser.add_argument("--gate", help="run in turns, told by the benchmark on this Unix socket")
parser.add_argument("--label", default="job")
parser.add_argument("--cpu", type=int, help="pin every thread of this process to this CPU")
parser.add_argument("--segment-steps", type=int, default=10)
args = parser.parse_args()

torch.set_num_threads(args.threads)
torch.manual_seed(0)
width = args.hidden
model = torch.nn.Sequential(
    torch.nn.Linear(width, width), torch.nn.ReLU(),
    torch.nn.Linear(width, width), torch.nn.ReLU(),
    torch.nn.Linear(width, 1),
)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x, y = torch.randn(args.batch, width), torch.randn(args.batch, 1)


def step() -> torch.Tensor:
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss


loss = step()  # warm-up: first-call allocations; under the guard this is the first sanity step
if args.cpu is not None:
    pin_threads(args.cpu)
if args.gate is None:
    started, cpu_started = time.perf_counter(), time.process_time()
    for _ in range(args.steps):
        loss = step()
    loop_s, cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
    wait_cpu_s = 0.0
else:
    def steps(start: int, count: int) -> None:
        global loss
        for _ in range(count):
            loss = step()

    gate = Gate(args.gate, args.label)
    loop_s, cpu_s = run_in_turns(gate, args.steps, args.segment_steps, steps)
    wait_cpu_s = gate.wait_cpu_s
print(f"bench: steps={args.steps} loop_s={loop_s:.6f} cpu_s={cpu_s:.6f} wait_cpu_s={wait_cpu_s:.6f} "
      f"step_ms={loop_s / args.steps * 1000:.3f} final_loss={loss.item():.4f}", flush=True)
