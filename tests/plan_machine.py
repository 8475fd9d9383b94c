"""A hypothesis state machine over the securing plan: random orders of the events the supervisor's loop feeds it,
with a fake clock, a fake pusher (durations and failures under the test's control) and a fake job; the plan's
invariants are checked after every step.

The machine talks to a plan through a *driver* (``NewDriver`` for ``guard.secure.plan.Plan``; the same machine runs
against an older plan through another driver, see ``tests/plan_old_check.py``), fed as ``guard.secure.securing``
feeds it: a non-finite loss before any decision is a taint plus a ``non_finite_loss`` failure, after one a taint
only; a crash is a failure, then the job's exit.
"""

from __future__ import annotations

import logging
import math
import signal
from collections.abc import Callable
from typing import Any

from fakes import FakeClock, FakePusher, ckpt
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from guard.secure.budget import MarginEstimator
from guard.secure.events import (
    CheckpointSeen,
    DeadlineMoved,
    DeadlineNear,
    Decide,
    Failure,
    JobExited,
    KillPush,
    SignalReceived,
    StartPush,
    StopJob,
    Tainted,
    Tick,
)
from guard.secure.outcome import Verdict, checkpoint_fields
from guard.secure.plan import SAFETY_S, Plan, State

TICK_S = 0.5  # the loop's timers run at least this often in the machine
SIZES = (1_000_000, 50_000_000, 400_000_000, 2_000_000_000)
RATE_BYTES_PER_S = 20e6  # the estimator's default: true durations never exceed its estimates


class NewDriver:
    """``guard.secure.plan.Plan`` through its one entry ``Plan.on``."""

    def __init__(self, clock: FakeClock, pusher: FakePusher, estimator: MarginEstimator, deadline_at: float | None,
                 grace_s: float) -> None:
        self.plan = Plan(clock=clock, pusher=pusher, estimator=estimator, deadline_at=deadline_at, grace_s=grace_s,
                         push_interval_s=5.0, final_output_dir="/out", unchanged=lambda info: True, stall_s=5.0)

    def checkpoint(self, info: Any, requested: bool | None = None) -> list[Any]:
        return self.plan.on(CheckpointSeen(info, requested=requested))

    def deadline_due(self, now: float) -> bool:
        return self.plan.deadline_due(now)

    def deadline_near(self, can_save: bool) -> list[Any]:
        return self.plan.on(DeadlineNear(can_save=can_save))

    def deadline_moved(self, deadline_at: float) -> list[Any]:
        return self.plan.on(DeadlineMoved(deadline_at))

    def signal(self, signum: int, can_save: bool) -> list[Any]:
        return self.plan.on(SignalReceived(signum, can_save=can_save))

    def failure(self, reason: str) -> list[Any]:
        return self.plan.on(Failure(reason))

    def taint(self, step: int, *, decided: bool) -> list[Any]:
        actions = self.plan.on(Tainted(step))
        return actions if decided else actions + self.plan.on(Failure("non_finite_loss"))

    def job_exit(self, *, ok: bool, complete: bool) -> list[Any]:
        return self.plan.on(JobExited(ok=ok, complete=complete, has_final_model=True))

    def tick(self) -> list[Any]:
        return self.plan.on(Tick())

    def due_at(self, now: float) -> float:
        return self.plan.due_at(now)

    @property
    def busy(self) -> bool:
        return self.plan.busy

    @property
    def secure_by(self) -> float:
        return self.plan.secure_by

    def secured(self) -> tuple[str, int | None] | None:
        secured = self.plan.report().secured
        return None if secured is None or secured.path is None else (secured.path, secured.step)

    def status(self, decided: str | None) -> str:
        """The VERDICT's status as the run would end now."""
        verdict = Verdict(decided or "PASS", "deadline" if decided == "TIMEOUT" else "ok", 0)
        return checkpoint_fields(self.plan.report(), verdict, step=None, nothing_found_hint="").verdict.status


class PlanMachine(RuleBasedStateMachine):
    """Random event orders against one plan; ``driver_factory`` builds the driver."""

    driver_factory: Callable[..., Any] = NewDriver
    #: the invariants checked (all by default); a run against an older plan checks one at a time
    checks: frozenset[str] = frozenset({"bound", "in_time", "secured", "supersede", "finished", "kill_bound",
                                        "stalled", "estimate", "waits", "follows", "labelled"})

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock(0.0)
        self.pusher = FakePusher(self.clock, rate=lambda now: RATE_BYTES_PER_S, overhead_s=1.0)
        self.step = 0
        self.decided: str | None = None
        self.signal_kill_at = math.inf
        self.taint_from: int | None = None
        self.job_running = True
        self.finished = False  # the job ended having trained to its end, nothing decided against it
        self.signalled = self.failed = False
        self.asked = self.answered = False  # the job was asked for a save (deadline, signal); it answered
        self.violations: list[str] = []
        self.stop_at = math.inf  # the guard SIGKILLs the job by then (the plan's StopJob: at + grace_s)

    @initialize(deadline_s=st.sampled_from([None, 60.0, 120.0, 400.0, 3600.0]),
                grace_s=st.sampled_from([5.0, 10.0, 30.0, 90.0]), can_save=st.booleans(),
                margin_s=st.sampled_from([20.0, 60.0, 150.0]), measured=st.sampled_from((None, *SIZES)))
    def start(self, deadline_s: float | None, grace_s: float, can_save: bool, margin_s: float,
              measured: int | None = None) -> None:
        self.deadline_at = deadline_s
        self.grace_s = grace_s
        self.can_save = can_save
        estimator = MarginEstimator(fixed_margin_s=margin_s, log_changes=False)
        if measured is not None:  # an earlier push of this size, measured at its true cost: estimates from it
            true_s = self.pusher.overhead_s + measured / RATE_BYTES_PER_S
            estimator.observe_push(measured, true_s)
            estimator.observe_push_cost(measured, true_s)
        self.driver = type(self).driver_factory(self.clock, self.pusher, estimator, deadline_s, grace_s)

    # -- what the loop feeds ---------------------------------------------------------------------------------

    def _record(self, actions: list[Any], now: float) -> None:
        for action in actions:
            if isinstance(action, Decide) and self.decided is None:
                self.decided = action.status
            if isinstance(action, StopJob):  # an earlier stop already set stands
                self.stop_at = min(self.stop_at, action.at + action.grace_s)
        # a suspect push is killed whatever its timing (a taint): not a supersede
        kills = [a for a in actions if isinstance(a, KillPush) and a.why not in ("deadline", "killed", "suspect")]
        starts = [a for a in actions if isinstance(a, StartPush)]
        for start in starts:  # the supersede rule rests on it: a push never takes longer than estimated
            handle = next((h for h in reversed(self.pusher.started) if h.args.get("local_dir") == start.path), None)
            if start.kind != "final" and handle is not None and handle.duration_s > start.estimate_s + 1e-6:
                self._violate("estimate", f"the push of {start.path} takes {handle.duration_s:.1f}s, estimated "
                              f"{start.estimate_s:.1f}s (measured pushes: the estimate is what they cost)")
        if kills and starts:
            killed = self.pusher.killed[-1]
            new = self.pusher.started[-1]
            bound = self.driver.secure_by
            if not killed.stalled and killed.started + killed.duration_s <= bound \
                    and new.started + new.duration_s > bound:
                self._violate("supersede", f"a push that would end at {killed.started + killed.duration_s:.1f} "
                              f"(in time for {bound:.1f}) was killed for one that ends at "
                              f"{new.started + new.duration_s:.1f}")
        for kill in kills:
            if kill.why == "stalled" and not any(s.step is not None and kill.step is not None and s.step > kill.step
                                                 for s in starts):
                self._violate("stalled", f"the stalled push of step {kill.step} was killed with no newer push "
                              f"started ({starts})")
            if kill.why == "stalled" and not self.pusher.killed[-1].stalled:
                self._violate("stalled", f"the push of step {kill.step} was killed as stalled but made progress")

    def _violate(self, kind: str, text: str) -> None:
        if kind in self.checks:
            self.violations.append(text)
            raise AssertionError(f"[{kind}] {text}")

    @rule(steps=st.integers(1, 200))
    def train(self, steps: int) -> None:
        if self.job_running:
            self.step += steps

    @precondition(lambda self: self.job_running)
    @rule(size=st.sampled_from(SIZES), requested=st.sampled_from([None, True, False]))
    def save(self, size: int, requested: bool | None = None) -> None:
        # requested: the job's word on whether the save answered the guard's request (None: found on disk)
        # a save at a step saved before is that checkpoint again (ckpt(): same path and mtime), of the same size
        size = self.pusher.sizes.setdefault(str(ckpt(self.step).path), size)
        info = ckpt(self.step, size_bytes=size)
        self.answered = self.answered or (self.asked and requested is True)
        self._record(self.driver.checkpoint(info, requested), self.clock.now)

    @rule(seconds=st.sampled_from([0.5, 1.0, 3.0, 10.0, 30.0, 90.0]))
    def advance(self, seconds: float) -> None:
        end = self.clock.now + seconds
        while self.clock.now < end - 1e-9:
            self.clock.advance(TICK_S)
            now = self.clock.now
            if self.job_running and self.decided is None and self.driver.deadline_due(now):
                self.asked = self.asked or self.can_save
                self._record(self.driver.deadline_near(self.can_save), now)
            self._record(self.driver.tick(), now)
            if self.job_running and now >= self.stop_at:  # the supervisor stopped it: it is gone, not saving on
                self.job_running = False
                self._record(self.driver.job_exit(ok=False, complete=False), now)
            self._check_decided_in_time()
            self._check_waits(now)

    @precondition(lambda self: self.deadline_at is not None)
    @rule(delta_s=st.sampled_from([-60.0, -20.0, 15.0, 120.0]))
    def deadline_moved(self, delta_s: float) -> None:
        assert self.deadline_at is not None
        self.deadline_at = max(self.clock.now + 2.0, self.deadline_at + delta_s)
        self._record(self.driver.deadline_moved(self.deadline_at), self.clock.now)

    @rule(signum=st.sampled_from([signal.SIGTERM, signal.SIGUSR1]))
    def signal(self, signum: int) -> None:
        self.signalled = True
        self.signal_kill_at = min(self.signal_kill_at, self.clock.now + self.grace_s)
        self.asked = self.asked or (self.can_save and self.job_running and self.decided is None)
        self._record(self.driver.signal(signum, self.can_save and self.job_running), self.clock.now)

    @precondition(lambda self: self.job_running and self.decided is None)
    @rule(reason=st.sampled_from(["stalled", "oom"]))
    def failure(self, reason: str) -> None:
        self.decided, self.failed = "FAIL", True
        self._record(self.driver.failure(reason), self.clock.now)

    @precondition(lambda self: self.job_running)
    @rule(back=st.integers(0, 20))
    def non_finite(self, back: int) -> None:
        at = max(0, self.step - back)
        self.taint_from = at if self.taint_from is None else min(self.taint_from, at)
        decided = self.decided is not None
        if not decided:
            self.decided, self.failed = "FAIL", True
        self._record(self.driver.taint(at, decided=decided), self.clock.now)

    @rule()
    def push_fails(self) -> None:
        self.pusher.fail_next = True

    @rule()
    def push_refused_as_rewritten(self) -> None:
        """The next push finds its file saved over since the save it was started for (a loop that saves ckpt.pt in
        place) and is refused (``CheckpointRewrittenError``)."""
        self.pusher.rewritten_next = True

    @rule()
    def push_stalls(self) -> None:
        """The running push (else the next one) moves no byte from now on and never ends on its own (a commit the
        Hub never answers)."""
        running = [h for h in self.pusher.started if h.result is None]
        if running:
            running[-1].stall()
        else:
            self.pusher.stall_next = True

    @precondition(lambda self: self.job_running)
    @rule(complete=st.booleans(), crash=st.booleans())
    def job_exit(self, complete: bool, crash: bool) -> None:
        self.job_running = False
        if crash:
            if self.decided is None:
                self.decided, self.failed = "FAIL", True
                self._record(self.driver.failure("crash"), self.clock.now)
            self._record(self.driver.job_exit(ok=False, complete=False), self.clock.now)
            return
        ok = self.decided is None or self.decided == "TIMEOUT"
        self.finished = complete and not (self.signalled or self.failed or self.taint_from is not None)
        self._record(self.driver.job_exit(ok=ok and (self.decided is None or complete), complete=complete),
                     self.clock.now)

    # -- invariants ------------------------------------------------------------------------------------------

    def _earliest_kill(self) -> float:
        return min(self.deadline_at if self.deadline_at is not None else math.inf, self.signal_kill_at)

    def _check_decided_in_time(self) -> None:
        kill = self._earliest_kill()
        if self.driver.busy and self.clock.now >= kill - SAFETY_S + TICK_S + 1e-6:
            self._violate("in_time", f"securing still runs at {self.clock.now:.1f}, the kill is at {kill:.1f}")

    def _check_waits(self, now: float) -> None:
        """After a tick at ``now`` the plan's next due time is later: a time already passed would make the loop
        turn without waiting (a busy loop on one core, for as long as the plan says so)."""
        due_at = getattr(self.driver, "due_at", None)
        if due_at is not None and due_at(now) <= now:
            self._violate("waits", f"after the tick at {now:.1f} the plan is due again at {due_at(now):.1f}")

    @invariant()
    def bound_within_the_deadline(self) -> None:
        if hasattr(self, "driver") and self.deadline_at is not None and self.driver.busy \
                and self.driver.secure_by > self.deadline_at - SAFETY_S + 1e-6:
            self._violate("bound", f"secure_by {self.driver.secure_by:.1f} is past the deadline "
                          f"{self.deadline_at:.1f} less {SAFETY_S}s")

    @invariant()
    def secured_is_good(self) -> None:
        if not hasattr(self, "driver"):
            return
        secured = self.driver.secured()
        if secured is None:
            return
        path, step = secured
        if self.taint_from is not None and step is not None and step >= self.taint_from:
            self._violate("secured", f"secured names {path} (step {step}), saved after the non-finite step "
                          f"{self.taint_from}")
        ends = [h.result for h in self.pusher.started if h.args.get("local_dir") == path and h.result is not None]
        if not any(r.ok for r in ends):
            self._violate("secured", f"secured names {path}, whose push never ended well ({ends})")

    @invariant()
    def every_push_carries_its_saves_mtime(self) -> None:
        """Every checkpoint push names the mtime of the save it is for (``ckpt(step)``: ``step`` seconds), so that
        the push refuses a file saved over since, whatever came before (a non-finite loss or none): secured under
        this step, a later save's content would be named by an older step."""
        if not hasattr(self, "driver"):
            return
        for handle in self.pusher.started:
            if handle.op == "push_checkpoint" and handle.args.get("saved_by_s") != float(handle.args["step"]):
                self._violate("labelled", f"the push of step {handle.args['step']} carries saved_by_s "
                              f"{handle.args.get('saved_by_s')}, not its save's mtime {float(handle.args['step'])}")

    @invariant()
    def follows_the_job_until_it_stops(self) -> None:
        """Securing for the deadline or a signal goes on while the job runs and has not answered: a job that
        cannot be asked, or that was asked and did not answer, goes on saving until it is stopped at ``secure_by``,
        and each of those saves is secured (the plan ending early left them all on the machine)."""
        if not hasattr(self, "driver") or self.driver.busy or not self.job_running or self.answered:
            return
        if self.decided not in ("TIMEOUT", "INTERRUPTED") or self.failed or self.taint_from is not None:
            return
        if self.clock.now < self.driver.secure_by - TICK_S:
            self._violate("follows", f"securing ended at {self.clock.now:.1f} while the job runs on unanswered, "
                          f"{self.driver.secure_by - self.clock.now:.1f}s before secure_by: its next saves are lost")

    @invariant()
    def finished_is_never_timeout(self) -> None:
        if hasattr(self, "driver") and self.finished and self.driver.status(self.decided) == "TIMEOUT":
            self._violate("finished", "the job finished its training but the VERDICT would be TIMEOUT")

    @invariant()
    def kill_bound(self) -> None:
        if hasattr(self, "driver") and self.driver.busy and self.driver.secure_by > self._earliest_kill() - SAFETY_S \
                + 1e-6:
            self._violate("kill_bound", f"secure_by {self.driver.secure_by:.1f} is past the earliest kill "
                          f"{self._earliest_kill():.1f} less {SAFETY_S}s")


def quiet_plan_logs() -> None:
    """The plan logs every decision; thousands of runs need none of it."""
    for name in ("guard.secure", "guard.budget"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


__all__ = ["NewDriver", "PlanMachine", "State", "quiet_plan_logs"]
