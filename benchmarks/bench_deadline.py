"""Deadline safety: does the guard's policy secure a checkpoint before the kill, and how much time does it waste?

50 simulated runs on an injected clock (seeded RNG, no sleeping). Each run draws a budget, a step time, a checkpoint
size, a disk speed for saves and a push throughput on both sides of the estimator's 20 MB/s default. The job saves
a checkpoint every ``budget / U(4, 12)``; the guard times each save (``observe_save``), secures each new checkpoint
in the background when no push is in flight (``observe_push`` when it ends, ``observe_push_progress`` while it
runs) and sees every step (``observe_step``). At every step end the job checks ``should_checkpoint()``: once
``checkpoint_due`` says so, it saves, and the guard pushes that checkpoint (an in-flight background push is
abandoned). The platform kills the job at the deadline; a push that ends later is a missed deadline.

Scenarios (by run index): every 10th run from 3 has its push throughput drop 3x at 55-80 % of the budget; every
10th from 7 has it rise 3x at 30-60 %; every 10th from 5 is a job that never answers the request (a plain loop
without the agent): the guard waits ``save_wait_limit_s`` and secures the newest complete checkpoint on disk.
Every push and save also varies by +-25 %.

Draws are kept physically sensible: one push of a checkpoint takes at most 10 % of the budget at the base
throughput (otherwise the size is drawn again), as a user would not run a job whose checkpoint takes longer to
upload than a tenth of its time.

Run: ``python benchmarks/bench_deadline.py [--runs 50] [--seed 0] [--seeds 1] [--per-run]``; ``--seeds N`` repeats
the 50 runs with seeds ``seed .. seed+N-1`` and pools them.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from guard.secure.budget import Deadline, MarginEstimator, checkpoint_due, save_wait_limit_s  # noqa: E402

MB = 1e6


def log_uniform(rng: random.Random, low: float, high: float) -> float:
    return math.exp(rng.uniform(math.log(low), math.log(high)))


@dataclass(frozen=True)
class RunSpec:
    index: int
    scenario: str
    budget_s: float
    step_s: float
    size_bytes: float
    disk_bytes_per_s: float
    push_bytes_per_s: float
    push_overhead_s: float
    save_every_s: float
    change_at_s: float | None = None
    change_factor: float = 1.0
    responsive: bool = True


@dataclass(frozen=True)
class RunResult:
    spec: RunSpec
    secured_at_s: float | None  # None: nothing secured before the kill
    margin_s: float

    @property
    def missed(self) -> bool:
        return self.secured_at_s is None or self.secured_at_s > self.spec.budget_s

    @property
    def left_s(self) -> float:
        return self.spec.budget_s - (self.secured_at_s if self.secured_at_s is not None else self.spec.budget_s)


def draw(index: int, rng: random.Random) -> RunSpec:
    scenario = {3: "push drops 3x late", 7: "push rises 3x", 5: "job never answers"}.get(index % 10, "steady")
    budget_s = log_uniform(rng, 15 * 60, 8 * 3600)
    push_bytes_per_s = log_uniform(rng, 5 * MB, 300 * MB)
    while True:
        size_bytes = log_uniform(rng, 20 * MB, 15e9)
        if size_bytes / push_bytes_per_s <= 0.1 * budget_s:
            break
    change_at_s, factor = None, 1.0
    if scenario == "push drops 3x late":
        change_at_s, factor = rng.uniform(0.55, 0.8) * budget_s, 1 / 3
    elif scenario == "push rises 3x":
        change_at_s, factor = rng.uniform(0.3, 0.6) * budget_s, 3.0
    return RunSpec(index, scenario, budget_s, step_s=log_uniform(rng, 0.5, 45), size_bytes=size_bytes,
                   disk_bytes_per_s=log_uniform(rng, 80 * MB, 1500 * MB), push_bytes_per_s=push_bytes_per_s,
                   push_overhead_s=rng.uniform(2, 8), save_every_s=budget_s / rng.uniform(4, 12),
                   change_at_s=change_at_s, change_factor=factor, responsive=scenario != "job never answers")


class World:
    """The job, the disk and the network of one run, on simulated time (seconds since the job's start)."""

    def __init__(self, spec: RunSpec, rng: random.Random) -> None:
        self.spec, self.rng = spec, rng

    def step_s(self) -> float:
        return self.spec.step_s * self.rng.uniform(0.8, 1.25)

    def save_s(self) -> float:
        return (0.5 + self.spec.size_bytes / self.spec.disk_bytes_per_s) * self.rng.uniform(0.75, 1.25)

    def push_s(self, start_s: float) -> float:
        """Overhead, then the bytes at the (piecewise) throughput of the moment, with this push's jitter."""
        spec, jitter = self.spec, self.rng.uniform(0.75, 1.25)
        t, left = start_s + spec.push_overhead_s, spec.size_bytes
        rate = spec.push_bytes_per_s * jitter
        if spec.change_at_s is not None and t < spec.change_at_s:
            if (spec.change_at_s - t) * rate >= left:
                return t + left / rate - start_s
            left -= (spec.change_at_s - t) * rate
            t = spec.change_at_s
        if spec.change_at_s is not None and t >= spec.change_at_s:
            rate *= spec.change_factor
        return t + left / rate - start_s


def simulate(spec: RunSpec, seed: int) -> RunResult:
    rng = random.Random(seed)
    world = World(spec, rng)
    estimator = MarginEstimator()
    deadline = Deadline(0.0, spec.budget_s, spec.budget_s, "simulated --timeout")
    on_disk: list[tuple[float, float | None]] = []  # (complete at, secured at or None)
    observations: list[tuple[float, float]] = []  # (push ends at, push duration)
    push_busy_until_s = push_started_s = 0.0
    fallback_at_s: float | None = None
    t = last_save_s = 0.0

    while t < spec.budget_s:
        step = world.step_s()
        t += step
        estimator.observe_step(step)
        for done_s, duration_s in [o for o in observations if o[0] <= t]:
            estimator.observe_push(spec.size_bytes, duration_s)
            observations.remove((done_s, duration_s))
        if push_busy_until_s > t:  # a background push still running tells its throughput is at most size/elapsed
            estimator.observe_push_progress(spec.size_bytes, t - push_started_s)
        if fallback_at_s is not None and t >= fallback_at_s:
            return RunResult(spec, fall_back(world, on_disk, fallback_at_s), estimator.margin_s())
        if fallback_at_s is None and checkpoint_due(t, deadline, estimator.margin_s()):
            if spec.responsive:  # the job sees should_checkpoint() at this step end and saves
                ready_s = t + world.save_s()
                return RunResult(spec, ready_s + world.push_s(ready_s), estimator.margin_s())
            newest = on_disk[-1] if on_disk else None
            wait_s = save_wait_limit_s(t, deadline, estimator, spec.size_bytes if newest else None)
            fallback_at_s = t + wait_s
        if t - last_save_s >= spec.save_every_s:  # the job's own periodic checkpoint
            save_s = world.save_s()
            t += save_s
            last_save_s = t
            estimator.observe_save(save_s, spec.size_bytes)
            secured_s = None
            if push_busy_until_s <= t:
                push_s = world.push_s(t)
                push_started_s = t
                push_busy_until_s = secured_s = t + push_s
                observations.append((secured_s, push_s))
            on_disk.append((t, secured_s))
    return RunResult(spec, None, estimator.margin_s())


def fall_back(world: World, on_disk: list[tuple[float, float | None]], at_s: float) -> float | None:
    """Secure the newest checkpoint complete at ``at_s``: already secured, being pushed, or pushed now."""
    complete = [entry for entry in on_disk if entry[0] <= at_s]
    if not complete:
        return None
    _, secured_s = complete[-1]
    if secured_s is not None:  # already secured, or its background push is still running: wait for it
        return max(secured_s, at_s)
    return at_s + world.push_s(at_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=1, help="pool this many seeds (seed, seed+1, ...)")
    parser.add_argument("--per-run", action="store_true", help="also print one row per run")
    args = parser.parse_args(argv)

    results = []
    for seed in range(args.seed, args.seed + args.seeds):
        for index in range(args.runs):
            rng = random.Random(f"{seed}-{index}")
            spec = draw(index, rng)
            results.append(simulate(spec, seed=rng.randrange(2**32)))

    if args.per_run:
        print("| run | scenario | budget | step s | size MB | push MB/s | margin s | left s | missed |")
        print("|---:|---|---:|---:|---:|---:|---:|---:|---|")
        for r in results:
            s = r.spec
            missed = "MISSED" if r.missed else ""
            print(f"| {s.index} | {s.scenario} | {s.budget_s / 60:.0f}m | {s.step_s:.1f} | {s.size_bytes / MB:.0f} "
                  f"| {s.push_bytes_per_s / MB:.0f} | {r.margin_s:.0f} | {r.left_s:.0f} | {missed} |")
        print()

    print("| scenario | runs | deadlines missed | median left unused (s) | median left unused (% of budget) "
          "| least left (s) |")
    print("|---|---:|---:|---:|---:|---:|")
    groups = {}
    for r in results:
        groups.setdefault(r.spec.scenario, []).append(r)
    groups["all"] = results
    for name, rows in groups.items():
        secured = [r for r in rows if not r.missed]
        left = [r.left_s for r in secured]
        pct = [100 * r.left_s / r.spec.budget_s for r in secured]
        print(f"| {name} | {len(rows)} | {sum(r.missed for r in rows)} | "
              f"{statistics.median(left) if left else float('nan'):.0f} | "
              f"{statistics.median(pct) if pct else float('nan'):.1f} | {min(left) if left else float('nan'):.0f} |")
    return 1 if any(r.missed for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
