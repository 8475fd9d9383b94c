"""Deadline safety of the REAL securing plan (``guard.secure.plan.Plan``) driven by fake collaborators.

No separate policy is simulated: the shipped ``Plan`` and ``MarginEstimator`` make every decision; only the clock,
the pusher and the job are fakes, and every event enters through ``Plan.on`` as the supervisor feeds it. A run draws
a budget (20 min to 4 h), a step time, a save interval, a checkpoint size and a push rate; in half the runs the push
rate drops 3x at 70-90 % of the budget (near the deadline). The fake job saves every ``save_every`` steps (each save
takes ``size / disk rate``) and reports each complete checkpoint (``CheckpointSeen``); the plan pushes them in the
background (``--push-interval`` 10 min, the default). At ``deadline - margin`` the loop sends ``DeadlineNear``; the
job answers ``RequestSave`` at its next step end plus the save time, and stops on ``StopJob``. A push takes
``overhead + size / rate`` (rate re-read each tick, so a drop mid-push slows it); the fake pusher's handles behave
like the worker's: killed at their deadline; ``--fail-rate`` makes that share of pushes end in an error after a
few seconds. The platform kills everything at the deadline (or ``--grace`` after a signal).

Scenarios (``--scenario``):

- ``deadline``: the budget runs out.
- ``signal``: SIGTERM less than ``--grace`` (30 s to 5 min) before the deadline (a pod's grace period, Slurm's
  ``--signal=USR1@90`` with a long ``--grace``): the kill is at the deadline, not ``grace`` after the signal.
- ``failure``: the job crashes while a background push runs (after half the budget); securing ends within
  ``--grace``. Counted: pushes that would have finished in time but were killed (target 0).
- ``nan``: the loss goes non-finite right after the deadline's request, before the requested save: counted, runs
  whose secured checkpoint was saved after the first non-finite step (target 0).
- ``finishes``: a loop that never reads the request trains its last step inside the margin (between the request
  and the deadline) and exits 0: counted, runs ending ``PASS`` with the final model pushed, and ``TIMEOUT`` (target
  0; a final model too large to push in the time left ends ``FAIL push_failed``, honestly).

Reported: deadlines missed (securing not over, or a push still running, at the kill: target 0), how often the fresh
save was secured vs an older one vs none, and the median steps lost at the kill.

``--job own-saves``: a nanoGPT-like job that cannot answer the request (``DeadlineNear(can_save=False)``) and saves
every budget/60 to budget/10 on its own schedule until it is stopped.

Run: ``python benchmarks/bench_deadline.py [--runs 1000] [--seed 0] [--scenario all|deadline|signal|failure|nan|
finishes] [--job answers|own-saves] [--fail-rate 0.0] [--per-run]``.
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
from guard.secure.events import (
    CheckpointSeen,
    DeadlineNear,
    Failure,
    JobExited,
    KillPush,
    RequestSave,
    SignalReceived,
    StartPush,
    StopJob,
    Tainted,
    Tick,
    TrainingStarted,
)
from guard.secure.outcome import Verdict, checkpoint_fields
from guard.secure.plan import SAFETY_S, Plan, State

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
    destination: str | None = "bench"
    hint: str | None = None

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
    fail_after_s: float | None = None
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
        if self.fail_after_s is not None and now - self.started >= self.fail_after_s:
            self.result = Result(False, self.size, now - self.started, "push failed: HTTP 503", "HubError")
        elif self.done_bytes >= self.size:
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
    rng: random.Random
    fail_rate: float = 0.0
    handles: list[Handle] = field(default_factory=list)

    def start(self, op: str, args: dict[str, Any], deadline: float) -> Handle:
        now = self.clock()
        size = self.sizes[str(args.get("local_dir") or args.get("output_dir"))]
        fail = self.rng.uniform(2.0, 20.0) if self.rng.random() < self.fail_rate else None
        handle = Handle(self.clock, self.rate, size, deadline, self.overhead_s, fail, started=now, last=now)
        self.handles.append(handle)
        return handle


def one_run(rng: random.Random, drop: bool, answers: bool = True, scenario: str = "deadline",
            fail_rate: float = 0.0) -> dict[str, Any]:
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
    grace_s = rng.uniform(30.0, 300.0) if scenario == "signal" else 30.0
    signal_at = budget_s - rng.uniform(0.3, 0.95) * grace_s if scenario == "signal" else None

    def rate(now: float) -> float:
        return base_rate / 3 if drop and now >= drop_at else base_rate

    clock = Clock()
    sizes: dict[str, int] = {"/out": size}
    pusher = Pusher(clock, rate, sizes, overhead_s=rng.uniform(2.0, 10.0), rng=rng, fail_rate=fail_rate)
    estimator = MarginEstimator(log_changes=False, floor_s=min(60.0, 0.25 * budget_s), max_margin_s=0.5 * budget_s)
    plan = Plan(clock=clock, pusher=pusher, estimator=estimator, deadline_at=budget_s, grace_s=grace_s,
                background=True, push_interval_s=600.0, final_output_dir="/out", unchanged=lambda info: True)
    step, next_step_at, saving_until, save_step, last_saved = 0, step_s, None, 0, None
    requested = stopped = exited = decided = False
    stop_at: float | None = None
    kill_at = budget_s
    taint_from: int | None = None
    finish_at = rng.uniform(budget_s - estimator.margin_s() + 1.0, budget_s - 5.0) if scenario == "finishes" else None
    wasted_kills = 0
    started_training = False

    def feed(actions: list[Any]) -> None:
        nonlocal requested, stop_at, wasted_kills, decided
        kills = [a for a in actions if isinstance(a, KillPush) and a.why == "superseded"]
        if kills and any(isinstance(a, StartPush) for a in actions):
            killed, new = pusher.handles[-2], pusher.handles[-1]
            left_s = plan.secure_by - clock.now
            if killed.size - killed.done_bytes <= rate(clock.now) * left_s and \
                    new.size + new.overhead_s * rate(clock.now) > rate(clock.now) * left_s:
                wasted_kills += 1
        for action in actions:
            if isinstance(action, RequestSave):
                requested = True
            elif isinstance(action, StopJob):
                stop_at = action.at if stop_at is None else min(stop_at, action.at)

    while clock.now < kill_at:
        clock.now = round(clock.now + DT_S, 6)
        if not stopped:
            if saving_until is not None and clock.now >= saving_until:
                path = f"/out/checkpoint-{save_step}"
                sizes[path] = size
                estimator.observe_save(save_s, size)
                feed(plan.on(CheckpointSeen(CheckpointInfo(Path(path), save_step, size, ("model.safetensors",),
                                                           clock.now))))
                saving_until, last_saved = None, save_step
                if requested:
                    stopped = True  # the agent ends the job once the requested save is done
            while saving_until is None and not stopped and clock.now >= next_step_at:
                step += 1
                estimator.observe_step(step_s)
                if not started_training:
                    started_training = True
                    feed(plan.on(TrainingStarted()))
                next_step_at += step_s
                if scenario == "nan" and requested and taint_from is None:
                    taint_from = step  # non-finite from the first step after the request, before its save
                    feed(plan.on(Tainted(step)))
                if step % save_every == 0 or requested:
                    saving_until, save_step = clock.now + save_s, step
            if finish_at is not None and clock.now >= finish_at:
                stopped = True  # trained its last step
                feed(plan.on(JobExited(ok=True, complete=True, has_final_model=True)))
                exited = True
            if stop_at is not None and clock.now >= stop_at:
                stopped = True
        if scenario == "failure" and not decided and clock.now >= budget_s / 2 and \
                any(h.result is None for h in pusher.handles):
            decided = stopped = True
            kill_at = min(kill_at, clock.now + grace_s)
            feed(plan.on(Failure("crash")))
        if signal_at is not None and clock.now >= signal_at:
            signal_at = None
            kill_at = min(kill_at, clock.now + grace_s)
            feed(plan.on(SignalReceived(15, can_save=answers and not stopped)))
        if stopped and not exited:
            exited = True
            feed(plan.on(JobExited(ok=False, complete=False)))
        if plan.deadline_due(clock.now) and not stopped:
            feed(plan.on(DeadlineNear(can_save=answers)))
        feed(plan.on(Tick()))
        if plan.state is State.DONE and stopped:
            break
    missed = plan.busy or any(h.result is None for h in pusher.handles) or clock.now > kill_at - SAFETY_S + DT_S
    report = plan.report()
    secured = report.secured.step if report.secured is not None else None
    fresh = secured == step and requested if answers else secured is not None and secured == last_saved
    status = checkpoint_fields(report, Verdict("TIMEOUT", "deadline", 0), step=step, nothing_found_hint="").verdict
    return {"missed": missed, "secured_step": secured, "last_step": step, "fresh": fresh,
            "lost": step - secured if secured is not None else step, "drop": drop, "budget_s": budget_s,
            "left_s": kill_at - clock.now, "pushes": len(pusher.handles),
            "suspect_secured": taint_from is not None and secured is not None and secured >= taint_from,
            "passed": status.status == "PASS" and report.final is not None and report.final.ok,
            "timeout": status.status == "TIMEOUT", "push_failed": status.reason == "push_failed",
            "wasted_kills": wasted_kills}


SCENARIOS = ("deadline", "signal", "failure", "nan", "finishes")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--per-run", action="store_true")
    parser.add_argument("--job", choices=("answers", "own-saves"), default="answers",
                        help="answers: the job answers the checkpoint request (a Trainer, the guard's API); own-saves: "
                             "it cannot (nanoGPT-like) and saves every budget/60 to budget/10 on its own schedule")
    parser.add_argument("--scenario", choices=("all", *SCENARIOS), default="all")
    parser.add_argument("--fail-rate", type=float, default=0.0, help="share of pushes that end in an error")
    args = parser.parse_args()
    logging.getLogger("guard").addHandler(logging.NullHandler())
    logging.getLogger("guard").propagate = False  # the plan's log lines are not the benchmark's output
    started = time.perf_counter()
    for scenario in SCENARIOS if args.scenario == "all" else (args.scenario,):
        rng = random.Random(args.seed)
        answers = args.job == "answers" and scenario != "finishes"  # a finishing loop never reads the request
        runs = [one_run(rng, drop=i % 2 == 1, answers=answers, scenario=scenario,
                        fail_rate=args.fail_rate) for i in range(args.runs)]
        if args.per_run:
            for i, r in enumerate(runs):
                print(scenario, i, r)
        missed = sum(r["missed"] for r in runs)
        fresh = sum(r["fresh"] for r in runs)
        older = sum(r["secured_step"] is not None and not r["fresh"] for r in runs)
        none = sum(r["secured_step"] is None for r in runs)
        lost = statistics.median(r["lost"] for r in runs)
        drop_missed = sum(r["missed"] for r in runs if r["drop"])
        extra = {"nan": f", suspect save secured {sum(r['suspect_secured'] for r in runs)}",
                 "finishes": f", PASS with the final model pushed {sum(r['passed'] for r in runs)}, FAIL push_failed "
                             f"(no time left for the final model) {sum(r['push_failed'] for r in runs)}, TIMEOUT "
                             f"{sum(r['timeout'] for r in runs)}",
                 "failure": ", in-time pushes killed for one that could not fit "
                            f"{sum(r['wasted_kills'] for r in runs)}"}.get(scenario, "")
        fresh_text = "fresh save secured" if args.job == "answers" else "newest own save secured"
        print(f"{scenario}: {len(runs)} runs, kills missed {missed} ({drop_missed} with the rate drop), {fresh_text} "
              f"{fresh}, an older one {older}, none {none}{extra}; median steps lost {lost:g}")
    took_s = time.perf_counter() - started
    print(f"({args.runs} runs per scenario in {took_s:.1f}s, seed {args.seed}, job: {args.job}, fail rate "
          f"{args.fail_rate:g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
