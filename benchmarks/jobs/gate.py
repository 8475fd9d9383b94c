"""Turns for ``bench_run.py``'s gated benchmarks (imported by the job scripts beside it, never by the guard).

Two jobs, one plain and one guarded, pinned to the same core, run their measured work in turns when the benchmark
says so: a job connects to the benchmark's Unix socket, says ``hello LABEL``, then for every ``g`` it reads runs
one segment and answers ``seg WALL_S CPU_S``; ``q`` (or the socket closing) ends it. Both then see the machine at
the same speed within tens of milliseconds. The CPU time the process used while it waited for its turn (its
other threads: under the guard, the agent's) is kept as ``wait_cpu_s`` and charged to the job.
"""

import os
import socket
import time
from collections.abc import Callable


def pin_threads(cpu: int) -> None:
    """Pin every thread the process has now (``/proc/self/task``: the agent's too, not only this one) to ``cpu``."""
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), {cpu})
        except OSError:
            pass


class Gate:
    """One job's end of the turns: ``while gate.wait(): ...; gate.done(wall_s, cpu_s)``."""

    def __init__(self, path: str, label: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.sock.sendall(f"hello {label}\n".encode())
        self.wait_cpu_s = 0.0

    def wait(self) -> bool:
        """Block until the next turn; False when the benchmark says ``q`` or is gone."""
        waited = time.process_time()
        order = self.sock.recv(1)
        self.wait_cpu_s += time.process_time() - waited
        return order == b"g"

    def done(self, wall_s: float, cpu_s: float) -> None:
        self.sock.sendall(f"seg {wall_s:.6f} {cpu_s:.6f}\n".encode())

    def close(self) -> None:
        self.sock.close()


def run_in_turns(gate: Gate, total: int, per_turn: int, work: Callable[[int, int], None]) -> tuple[float, float]:
    """Run ``work(start, count)`` over ``total`` units, ``per_turn`` a turn, each when ``gate`` says so; answer each
    turn's wall and CPU seconds. Returns the turns' summed (wall_s, cpu_s). Raises SystemExit when the gate closed
    before ``total`` units were done."""
    wall_s = cpu_s = 0.0
    done = 0
    while gate.wait():
        count = min(per_turn, total - done)
        started, cpu_started = time.perf_counter(), time.process_time()
        work(done, count)
        turn_s, turn_cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
        wall_s, cpu_s, done = wall_s + turn_s, cpu_s + turn_cpu_s, done + count
        gate.done(turn_s, turn_cpu_s)
    gate.close()
    if done != total:
        raise SystemExit(f"the gate closed after {done} of {total}")
    return wall_s, cpu_s
