"""Deadline safety of the REAL securing plan (``guard.secure.plan.Plan``) driven by fake collaborators.

No separate policy is simulated: the shipped ``Plan`` and ``MarginEstimator`` make every decision; only the clock,
the pusher and the job are fakes. A run draws a budget (20 min to 4 h), a step time, a save interval, a checkpoint
size and a push rate; in half the runs the push rate drops 3x at 70-90 % of the budget (near the deadline). The
fake job saves every ``save_every`` steps (each save takes ``size / disk rate``) and reports each complete checkpoint
(``Plan.checkpoint``); the plan pushes them in the background (``--push-interval`` 10 min, the default). At
``deadline - margin`` the loop calls ``Plan.deadline_near``; the job answers ``RequestSave`` at its next step end
plus the save time, and stops on ``StopJob``. A push takes ``overhead + size / rate`` (rate read when it starts and
re-read each second, so a drop mid-push slows it); the fake pusher's handles behave like the worker's: killed at
their deadline. The platform kills everything at the deadline.

Reported: deadlines missed (a push still running, or securing not over, at the kill: target 0, also with the rate
drop), how often the fresh save was secured vs an older one vs none, and the median steps lost at the kill
(the job's last step minus the secured checkpoint's step).

``--job own-saves``: a nanoGPT-like job that cannot answer the request (``deadline_near(can_save=False)``) and saves
every budget/60 to budget/10 on its own schedule until it is stopped; "newest own save secured" counts runs whose
secured checkpoint is the last save the job completed.

Run: ``python benchmarks/bench_deadline.py [--runs 1000] [--seed 0] [--per-run] [--job answers|own-saves]``.
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from guard.secure.budget import MarginEstimator
from guard.secure.checkpoints import CheckpointInfo
from guard.secure.plan import Plan, RequestSave, State, StopJob

MB = 1e6
DT_S = 0.5  # the loop's tick


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Result:
    ok: bool
    size_bytes: int
    elapsed_s: float
    error: str | None = None
    error_type: str | None = None
    files: tuple[str, ...] = ("model.safetensors",)
    attempts: int = 1
    pushed: str | None = "bench@rev"

    @property
    def killed(self) -> bool:
        return self.error_type in ("deadline", "killed")


@dataclass
class Handle:
    clock: Clock
    rate: Any
    size: int
    deadline: float
    overhead_s: float
    started: float = 0.0
    done_bytes: float = 0.0
    last: float = 0.0
    result: Result | None = None

    def poll(self) -> Result | None:
        if self.result is not None:
            return self.result
        now = self.clock()
        if now - self.started >= self.overhead_s:  # bytes flow after the fixed costs, at the rate of the moment
            self.done_bytes += (now - max(self.last, self.started + self.overhead_s)) * self.rate(now)
        self.last = now
        if self.done_bytes >= self.size:
            self.result = Result(True, self.size, now - self.started)
        elif now >= self.deadline:
            self.result = Result(False, self.size, now - self.started, "killed at its deadline", "deadline")
        return self.result

    def kill(self, why: str = "killed") -> Result:
        if self.result is None:
            self.result = Result(False, self.size, self.clock() - self.started, "killed", why)
        return self.result


@dataclass
class Pusher:
    clock: Clock
    rate: Any
    sizes: dict[str, int]
    overhead_s: float
    handles: list[Handle] = field(default_factory=list)

    def start(self, op: str, args: dict[str, Any], deadline: float) -> Handle:
        now = self.clock()
        handle = Handle(self.clock, self.rate, self.sizes[str(args["local_dir"])], deadline, self.overhead_s,
                        started=now, last=now)
        self.handles.append(handle)
        return handle


def one_run(rng: random.Random, drop: bool, answers: bool = True) -> dict[str, Any]:
    budget_s = rng.uniform(20 * 60, 4 * 3600)
    step_s = rng.uniform(0.2, 5.0)
    size = int(rng.uniform(50 * MB, 5000 * MB))
    base_rate = rng.uniform(5 * MB, 200 * MB)
    while size / base_rate > 0.1 * budget_s:  # no user runs a job whose checkpoint takes >10 % of it to upload
        size = int(size / 2)
    save_s = size / rng.uniform(100 * MB, 1000 * MB)
    save_every = max(1, int(rng.uniform(budget_s / 12, budget_s / 3) / step_s))
    drop_at = rng.uniform(0.7, 0.9) * budget_s
    if not answers:  # a nanoGPT-like loop saves more often (every eval interval), on its own schedule only
        save_every = max(1, int(rng.uniform(budget_s / 60, budget_s / 10) / step_s))

    def rate(now: float) -> float:
        return base_rate / 3 if drop and now >= drop_at else base_rate

    clock = Clock()
    sizes: dict[str, int] = {}
    pusher = Pusher(clock, rate, sizes, overhead_s=rng.uniform(2.0, 10.0))
    estimator = MarginEstimator(log_changes=False, floor_s=min(60.0, 0.25 * budget_s), max_margin_s=0.5 * budget_s)
    plan = Plan(clock=clock, pusher=pusher, estimator=estimator, deadline_at=budget_s, grace_s=30.0,
                background=True, push_interval_s=600.0)
    step, next_step_at, saving_until, save_step, last_saved = 0, step_s, None, 0, None
    requested = stopped = False
    stop_at = None
    while clock.now < budget_s:
        clock.now = round(clock.now + DT_S, 6)
        if not stopped:
            if saving_until is not None and clock.now >= saving_until:
                path = f"/out/checkpoint-{save_step}"
                sizes[path] = size
                estimator.observe_save(save_s, size)
                plan.checkpoint(CheckpointInfo(Path(path), save_step, size, ("model.safetensors",), clock.now))
                saving_until, last_saved = None, save_step
                if requested:
                    stopped = True  # the agent ends the job once the requested save is done
            while saving_until is None and not stopped and clock.now >= next_step_at:
                step += 1
                estimator.observe_step(step_s)
                plan.training_started = True  # what the supervisor's securing glue sets at the first step
                next_step_at += step_s
                if step % save_every == 0 or requested:
                    saving_until, save_step = clock.now + save_s, step
            if stop_at is not None and clock.now >= stop_at:
                stopped = True
        actions: list[Any] = []
        if plan.deadline_due(clock.now):
            actions += plan.deadline_near(can_save=answers)
        actions += plan.tick()
        for action in actions:
            if isinstance(action, RequestSave):
                requested = True
            elif isinstance(action, StopJob):
                stop_at = action.at
        if plan.state is State.DONE and stopped:
            break
    missed = plan.state is not State.DONE or any(h.result is None for h in pusher.handles)
    secured = plan.secured.info.step if plan.secured is not None and plan.secured.info is not None else None
    fresh = secured == step and requested if answers else secured is not None and secured == last_saved
    return {"missed": missed, "secured_step": secured, "last_step": step, "fresh": fresh,
            "lost": step - secured if secured is not None else step, "drop": drop, "budget_s": budget_s,
            "left_s": budget_s - clock.now, "pushes": len(pusher.handles)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--per-run", action="store_true")
    parser.add_argument("--job", choices=("answers", "own-saves"), default="answers",
                        help="answers: the job answers the checkpoint request (a Trainer, the guard's API); own-saves: "
                             "it cannot (nanoGPT-like) and saves every budget/60 to budget/10 on its own schedule")
    args = parser.parse_args()
    logging.getLogger("guard").addHandler(logging.NullHandler())
    logging.getLogger("guard").propagate = False  # the plan's log lines are not the benchmark's output
    rng = random.Random(args.seed)
    started = time.perf_counter()
    runs = [one_run(rng, drop=i % 2 == 1, answers=args.job == "answers") for i in range(args.runs)]
    took_s = time.perf_counter() - started
    if args.per_run:
        for i, r in enumerate(runs):
            print(i, r)
    for label, subset in (("all", runs), ("3x rate drop near the deadline", [r for r in runs if r["drop"]]),
                          ("steady rate", [r for r in runs if not r["drop"]])):
        missed = sum(r["missed"] for r in subset)
        fresh = sum(r["fresh"] for r in subset)
        older = sum(r["secured_step"] is not None and not r["fresh"] for r in subset)
        none = sum(r["secured_step"] is None for r in subset)
        lost = statistics.median(r["lost"] for r in subset)
        lost_older = [r["lost"] for r in subset if r["secured_step"] is not None and not r["fresh"]]
        older_text = f" ({statistics.median(lost_older):g} when an older one)" if lost_older else ""
        pushes = statistics.median(r["pushes"] for r in subset)
        fresh_text = "fresh save secured" if args.job == "answers" else "newest own save secured"
        print(f"{label}: {len(subset)} runs, deadlines missed {missed}, {fresh_text} {fresh}, an older one "
              f"{older}, none {none}; median steps lost at the kill {lost:g}{older_text}; median pushes {pushes:g}")
    print(f"({args.runs} runs in {took_s:.1f}s, seed {args.seed}, job: {args.job})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
