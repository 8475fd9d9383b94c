"""The securing plan as a state machine, driven by a fake clock and a fake pusher, for every event order."""

from __future__ import annotations

import dataclasses
import logging
import signal
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fakes import FakeClock, FakePusher, ckpt

from guard.secure.budget import MarginEstimator
from guard.secure.checkpoints import CheckpointInfo
from guard.secure.events import (
    Action,
    AlreadySecured,
    CheckpointSeen,
    DeadlineNear,
    Decide,
    DestinationKnown,
    Failure,
    ForwardSignal,
    JobExited,
    KillPush,
    LookedOlder,
    LookOlder,
    MarkSuspect,
    ReadThrough,
    ReleaseKept,
    RequestSave,
    RestoreRecord,
    SignalReceived,
    StartPush,
    StopJob,
    Tainted,
    Tick,
    TrainingStarted,
)
from guard.secure.outcome import Verdict, checkpoint_fields
from guard.secure.plan import SAFETY_S, STOP_BEFORE_S, Plan, State


def make(clock: FakeClock, pusher: FakePusher | None, *, deadline_at: float | None = 1000.0, grace_s: float = 30.0,
         interval_s: float = 0.0, background: bool = True, final: str | None = "/out") -> Plan:
    estimator = MarginEstimator(fixed_margin_s=100.0, log_changes=False)
    return Plan(clock=clock, pusher=pusher, estimator=estimator, deadline_at=deadline_at, grace_s=grace_s,
                background=background, push_interval_s=interval_s, final_output_dir=final,
                unchanged=lambda info: True)


def seen(plan: Plan, info: CheckpointInfo) -> list[Action]:
    return plan.on(CheckpointSeen(info))


def secured_step(plan: Plan) -> int | None:
    secured = plan.report().secured
    return secured.step if secured is not None else None


def run_until(plan: Plan, clock: FakeClock, end: float, step_s: float = 0.1) -> list[Any]:
    actions: list[Any] = []
    while clock.now < end and plan.state is not State.DONE:
        clock.advance(step_s)
        actions += plan.on(Tick())
    return actions


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(0.0)


def test_background_pushes_one_at_a_time_newer_replaces_queued(clock: FakeClock) -> None:
    pusher = FakePusher(clock, rate=lambda now: 1e6)  # 1 MB checkpoint: 2 s per push
    plan = make(clock, pusher)
    seen(plan, ckpt(10))
    seen(plan, ckpt(20))
    seen(plan, ckpt(30))
    assert [h.args["step"] for h in pusher.started] == [10]
    assert [h.args["step"] for h in pusher.started] == [10]  # 20 was replaced in the queue by 30
    run_until(plan, clock, 10.0)
    assert [h.args["step"] for h in pusher.started] == [10, 30]
    assert secured_step(plan) == 30


def test_push_interval_limits_background_pushes(clock: FakeClock) -> None:
    pusher = FakePusher(clock)
    plan = make(clock, pusher, interval_s=60.0)
    seen(plan, ckpt(10))
    run_until(plan, clock, 5.0)
    seen(plan, ckpt(20))
    run_until(plan, clock, 30.0)
    assert len(pusher.started) == 1
    run_until(plan, clock, 61.0)
    assert [h.args["step"] for h in pusher.started] == [10, 20]


def test_signal_during_a_background_push_asks_for_a_save_and_ends_within_grace(clock: FakeClock) -> None:
    pusher = FakePusher(clock, rate=lambda now: 0.01e6)  # very slow: 100 s for 1 MB
    plan = make(clock, pusher, grace_s=10.0)
    seen(plan, ckpt(10))
    clock.advance(1.0)
    actions = plan.on(SignalReceived(signal.SIGTERM, can_save=True))
    assert Decide("INTERRUPTED", "signal", signal.SIGTERM) in actions and RequestSave() in actions
    assert plan.secure_by == pytest.approx(1.0 + 10.0 - SAFETY_S)
    assert pusher.started[0].deadline <= plan.secure_by
    clock.advance(1.0)
    seen(plan, ckpt(11))  # the fresh save: estimated 15 s, 7.5 s left: it cannot supersede the running push
    assert not pusher.killed and [h.args["step"] for h in pusher.started] == [10]
    run_until(plan, clock, 30.0)
    assert plan.state is State.DONE and clock.now <= plan.secure_by + 0.11
    assert plan.report().secured is None  # too slow for the grace: honestly not secured


def test_signal_to_a_job_that_cannot_save_is_forwarded_at_once_and_its_save_is_pushed(clock: FakeClock) -> None:
    pusher = FakePusher(clock)
    plan = make(clock, pusher, grace_s=20.0)
    actions = plan.on(SignalReceived(signal.SIGTERM, can_save=False))
    assert ForwardSignal(signal.SIGTERM) in actions and RequestSave() not in actions
    clock.advance(2.0)
    seen(plan, ckpt(7))  # written by the job's own SIGTERM handler
    run_until(plan, clock, 15.0)
    assert secured_step(plan) == 7


def test_signal_during_the_final_push_shortens_it_to_the_grace(clock: FakeClock) -> None:
    pusher = FakePusher(clock, rate=lambda now: 0.001e6)  # a hung transfer
    plan = make(clock, pusher, deadline_at=None, grace_s=3.0)
    plan.on(JobExited(ok=True))
    assert plan.state is State.FINAL_PUSH
    clock.advance(5.0)
    assert plan.on(SignalReceived(signal.SIGTERM, can_save=True)) == []
    assert plan.secure_by == pytest.approx(5.0 + 3.0 - SAFETY_S)
    run_until(plan, clock, 60.0)
    assert plan.state is State.DONE and clock.now <= 5.0 + 3.0
    assert plan.report().final is not None and plan.report().final.killed


def test_two_signals_the_second_never_extends(clock: FakeClock) -> None:
    pusher = FakePusher(clock)
    plan = make(clock, pusher, grace_s=30.0)
    plan.on(SignalReceived(signal.SIGTERM, can_save=True))
    first = plan.secure_by
    clock.advance(10.0)
    assert plan.on(SignalReceived(signal.SIGINT, can_save=True)) == []
    assert plan.secure_by == first  # 10 + 28.5 > 28.5: unchanged
    assert plan.report().signum == signal.SIGTERM
    plan2 = make(clock, FakePusher(clock), grace_s=30.0)
    plan2.on(DeadlineNear(can_save=True))  # deadline far away: secure_by = 998.5
    plan2.on(SignalReceived(signal.SIGTERM, can_save=True))
    assert plan2.secure_by == pytest.approx(clock.now + 30.0 - SAFETY_S)


def test_deadline_mid_push_keeps_the_push_of_the_newest_and_bounds_it(clock: FakeClock) -> None:
    pusher = FakePusher(clock, rate=lambda now: 0.1e6)  # 11 s per push
    plan = make(clock, pusher, deadline_at=50.0)
    seen(plan, ckpt(40))
    clock.advance(3.0)
    actions = plan.on(DeadlineNear(can_save=True))
    assert Decide("TIMEOUT", "deadline") in actions
    assert any(isinstance(a, StopJob) and a.at == pytest.approx(50.0 - SAFETY_S - 2.0) for a in actions)
    assert pusher.started[0].deadline <= 50.0 - SAFETY_S
    run_until(plan, clock, 60.0)
    assert plan.state is State.DONE and plan.report().secured is not None
    assert secured_step(plan) == 40  # the job never saved again


def test_deadline_push_cut_off_is_not_secured(clock: FakeClock) -> None:
    pusher = FakePusher(clock, rate=lambda now: 0.01e6)
    plan = make(clock, pusher, deadline_at=20.0)
    plan.on(DeadlineNear(can_save=True))
    seen(plan, ckpt(5))
    run_until(plan, clock, 30.0)
    assert plan.state is State.DONE and plan.report().secured is None and clock.now <= 20.0 - SAFETY_S + 0.11
    assert pusher.killed and pusher.killed[0].result is not None and pusher.killed[0].result.error_type == "deadline"


def test_failure_while_a_push_runs_keeps_it_when_it_is_the_newest(clock: FakeClock) -> None:
    pusher = FakePusher(clock, rate=lambda now: 0.5e6)
    plan = make(clock, pusher, grace_s=10.0)
    seen(plan, ckpt(30))
    clock.advance(0.5)
    plan.on(Failure("crash"))
    assert plan.state is State.SECURING and len(pusher.started) == 1 and plan.push_running()
    assert plan.report().history[-1].kind == "securing" and plan.report().history[-1].running
    run_until(plan, clock, 20.0)
    assert secured_step(plan) == 30


def test_non_finite_loss_secures_the_checkpoint_before_it_and_names_the_later_one_suspect(clock: FakeClock) -> None:
    pusher = FakePusher(clock, rate=lambda now: 0.2e6)
    plan = make(clock, pusher, grace_s=30.0, interval_s=1000.0)
    seen(plan, ckpt(10))
    run_until(plan, clock, 10.0)  # step 10 secured in the background
    seen(plan, ckpt(20))  # queued (interval)
    seen(plan, ckpt(30))  # saved after the NaN at step 25
    (plan.on(Tainted(25)) + plan.on(Failure("non_finite_loss")))
    assert plan.report().suspect is not None and plan.report().suspect.step == 30
    run_until(plan, clock, 40.0)
    pushed = [h.args["step"] for h in pusher.started]
    assert 30 not in pushed
    assert secured_step(plan) in (10, 20)


def test_failed_push_at_the_deadline_is_reported(clock: FakeClock) -> None:
    pusher = FakePusher(clock)
    pusher.fail_next = True
    plan = make(clock, pusher, deadline_at=100.0)
    plan.on(DeadlineNear(can_save=True))
    seen(plan, ckpt(3))
    run_until(plan, clock, 99.0)
    assert plan.state is State.DONE and plan.report().secured is None and plan.report().error is not None


def test_no_destination_never_pushes(clock: FakeClock) -> None:
    plan = make(clock, None)
    seen(plan, ckpt(1))
    assert plan.on(Failure("stalled")) == [] and plan.state is State.DONE
    assert plan.report().newest is not None and plan.report().newest.step == 1


def test_early_signal_with_many_ranks_does_not_crash(clock: FakeClock) -> None:
    from fakes import FakeLink

    from guard.secure.budget import Deadline
    from guard.secure.securing import Securing

    link = FakeLink(agents=4, world_size=4)
    link.state.facts.trainer_config = {"output_dir": "/out"}
    securing = Securing(deadline=Deadline(0.0, None, None, "none"), estimator=MarginEstimator(log_changes=False),
                        securer=SimpleNamespace(destination="alice/run", token=None),  # type: ignore[arg-type]
                        clock=clock, pusher_factory=lambda dest, token: FakePusher(clock))
    assert securing.on_signal(link, signal.SIGTERM, clock.now)
    assert link.sent and link.sent[0]["t"] == "checkpoint" and link.sent[0]["at_step"] == 22
    assert link.state.outcome is not None and link.state.outcome.status == "INTERRUPTED"


def test_a_good_end_without_final_model_files_secures_the_newest_checkpoint(clock: FakeClock) -> None:
    pusher = FakePusher(clock, rate=lambda now: 0.2e6)  # 5 s for 1 MB: the background push still runs at the end
    plan = make(clock, pusher)
    seen(plan, ckpt(6))
    clock.advance(1.0)
    plan.on(JobExited(ok=True, has_final_model=False))
    assert not pusher.killed  # the running push of the newest checkpoint is kept, not superseded by a final push
    assert plan.report().final is None and plan.report().trigger == "ended"
    run_until(plan, clock, 60.0)
    assert plan.state is State.DONE
    assert secured_step(plan) == 6


def test_another_nodes_good_end_secures_its_part_and_leaves_the_final_model_to_node_0(clock: FakeClock) -> None:
    """Many nodes, each with its own disk: node 1's output folder holds final model files too (Megatron's
    .latest_checkpointed_iteration.txt); node 0's guard pushes the final model, node 1's its part of the newest
    checkpoint. Before, both guards pushed the final model files to one destination at once and node 1's failed
    (FileNotFoundError on the other's temporary file, exit 6, node 0 PASS)."""
    pusher = FakePusher(clock)
    plan = make(clock, pusher)
    seen(plan, ckpt(6))
    run_until(plan, clock, 5.0)
    plan.on(JobExited(ok=True, has_final_model=True, final_by_node_0=True))
    assert all(start.op != "push_final" for start in pusher.started)
    assert plan.report().final is None and plan.report().trigger == "ended"
    run_until(plan, clock, 60.0)
    assert plan.state is State.DONE and secured_step(plan) == 6


def test_a_good_end_with_final_model_files_pushes_them(clock: FakeClock) -> None:
    pusher = FakePusher(clock)
    plan = make(clock, pusher)
    plan.on(JobExited(ok=True, has_final_model=True))
    assert plan.state is State.FINAL_PUSH and pusher.started[-1].op == "push_final"


# -- saves during the final stretch (a job that cannot answer a checkpoint request saves on its own) -------------


def _deadline_securing(clock: FakeClock, deadline_at: float) -> tuple[Plan, FakePusher]:
    pusher = FakePusher(clock, rate=lambda now: 0.05e6)  # 1 MB: 21 s; the estimator says 15 s (20 MB/s + 15 s)
    plan = make(clock, pusher, deadline_at=deadline_at)
    clock.advance(1.0)
    actions = plan.on(DeadlineNear(can_save=False))
    assert RequestSave() not in actions and plan.state is State.AWAITING_SAVE
    clock.advance(9.0)
    seen(plan, ckpt(10))  # the job's own save: securing starts
    assert plan.state is State.SECURING and [h.args["step"] for h in pusher.started] == [10]
    clock.advance(2.0)
    return plan, pusher


def test_a_newer_save_while_securing_follows_the_running_push_when_both_fit(clock: FakeClock) -> None:
    plan, pusher = _deadline_securing(clock, deadline_at=200.0)
    seen(plan, ckpt(20))
    assert not pusher.killed and len(pusher.started) == 1  # both fit: the running push goes on
    run_until(plan, clock, 200.0)
    assert [h.args["step"] for h in pusher.ended] == [10, 20]
    assert secured_step(plan) == 20


def test_a_newer_save_while_securing_supersedes_the_running_push_when_only_it_fits(clock: FakeClock) -> None:
    plan, pusher = _deadline_securing(clock, deadline_at=40.0)  # secure_by 38.5: 13 s + 15 s > 26.5 s left
    seen(plan, ckpt(20))
    assert [h.args["step"] for h in pusher.killed] == [10] and pusher.started[-1].args["step"] == 20
    assert pusher.started[-1].deadline == plan.secure_by
    run_until(plan, clock, 40.0)
    assert plan.state is State.DONE and clock.now <= plan.secure_by + 0.11
    assert secured_step(plan) == 20


def test_a_newer_save_while_a_nodes_part_is_pushed_never_replaces_it(clock: FakeClock) -> None:
    """Many nodes: node 0 replaced its push of step 220's part (waiting for node 2) by step 240's; nodes 1 and 2 then
    made 220 whole and said secured_step=220 while node 0 said 180. A part's push goes on; the newer one follows if
    it fits."""
    pusher = FakePusher(clock, rate=lambda now: 0.05e6)
    plan = make(clock, pusher, deadline_at=40.0)  # as _deadline_securing, with parts
    clock.advance(1.0)
    plan.on(DeadlineNear(can_save=False))
    clock.advance(9.0)
    seen(plan, dataclasses.replace(ckpt(10), part=True))
    clock.advance(2.0)
    seen(plan, dataclasses.replace(ckpt(20), part=True))  # only it would fit: the whole-checkpoint rule replaces
    assert not pusher.killed and [h.args["step"] for h in pusher.started] == [10]


@pytest.mark.parametrize("recorded", [False, True])
def test_a_push_killed_at_secure_by_counts_by_what_the_destination_records(clock: FakeClock,
                                                                          recorded: bool) -> None:
    """Issue 33 item 3 (accelerate's complete_nlp_example under --timeout 90s): the push of step 10 is killed at
    secure_by; killed in its cleanup, after the destination's record had moved to step 10, the destination holds
    step 10, so that is what is secured (before: nothing, while the destination held it); killed before, nothing."""
    plan, pusher = _deadline_securing(clock, deadline_at=20.0)  # secure_by 18.5: the 21 s push cannot end
    pusher.started[0].recorded = recorded
    run_until(plan, clock, 20.0)
    assert [h.args["step"] for h in pusher.killed] == [10] and plan.state is State.DONE
    report = plan.report()
    assert secured_step(plan) == (10 if recorded else None)
    assert (report.error is None) == recorded


def test_a_newer_save_too_late_to_push_keeps_the_running_push(clock: FakeClock) -> None:
    plan, pusher = _deadline_securing(clock, deadline_at=40.0)
    big = ckpt(20, size_bytes=500_000_000)  # 25 s at 20 MB/s, x1.5 + 15 s: more than the 26.5 s left
    pusher.sizes[str(big.path)] = big.size_bytes
    seen(plan, big)
    assert not pusher.killed and len(pusher.started) == 1
    run_until(plan, clock, 40.0)
    assert plan.state is State.DONE
    assert secured_step(plan) == 10


def test_a_save_in_place_with_no_step_is_pushed_again_when_newer(clock: FakeClock) -> None:
    from pathlib import Path

    from guard.secure.checkpoints import CheckpointInfo

    pusher = FakePusher(clock)
    plan = make(clock, pusher, deadline_at=300.0)
    first = CheckpointInfo(Path("/out/ckpt.pt"), None, 1_000_000, ("ckpt.pt",), 5.0, root=Path("/out"))
    seen(plan, first)
    run_until(plan, clock, 5.0)
    assert plan.report().secured is not None and plan.report().secured.info == first
    plan.on(DeadlineNear(can_save=False))
    clock.advance(1.0)
    again = CheckpointInfo(Path("/out/ckpt.pt"), None, 1_000_000, ("ckpt.pt",), 20.0, root=Path("/out"))
    seen(plan, again)  # torch.save over ckpt.pt during the final stretch
    run_until(plan, clock, 300.0)
    assert plan.report().secured is not None and plan.report().secured.info == again and len(pusher.started) == 2


def test_a_push_that_slows_down_raises_the_margin_before_it_ends(clock: FakeClock) -> None:
    pusher = FakePusher(clock, rate=lambda now: 10e6, overhead_s=0.0)
    estimator = MarginEstimator(log_changes=False, floor_s=0.0)
    plan = Plan(clock=clock, pusher=pusher, estimator=estimator, deadline_at=10_000.0, push_interval_s=0.0)
    pusher.sizes["/out/checkpoint-1"] = pusher.sizes["/out/checkpoint-2"] = 100_000_000
    seen(plan, ckpt(1, size_bytes=100_000_000))
    run_until(plan, clock, 11.0)  # 10 s at 10 MB/s: measured
    assert estimator.push_bytes_per_s == pytest.approx(10e6, rel=0.02)
    margin_before = estimator.margin_s()
    pusher.rate = lambda now: 10e6 / 3  # the uplink slows down 3x: the next push takes 30 s
    seen(plan, ckpt(2, size_bytes=100_000_000))
    run_until(plan, clock, 11.0 + 20.0)
    assert plan.report().history[-1].running  # still running ...
    assert estimator.push_bytes_per_s < 10e6 / 1.8  # ... and already counted as slow
    assert estimator.margin_s() > margin_before


def test_deadline_a_job_that_cannot_save_has_every_later_save_secured_until_it_is_stopped(clock: FakeClock) -> None:
    # nanoGPT's shape: no guard API, it saves ckpt.pt on its own every few seconds and runs until the guard stops it
    # at secure_by - STOP_BEFORE_S; a save made after the first secured one must not be lost.
    pusher = FakePusher(clock, rate=lambda now: 2e6)  # 0.5 s per push
    plan = make(clock, pusher, deadline_at=60.0, interval_s=600.0)
    seen(plan, ckpt(20))  # secured in the background
    run_until(plan, clock, 5.0)
    clock.now = 35.0
    actions = plan.on(DeadlineNear(can_save=False))
    assert RequestSave() not in actions and any(isinstance(a, StopJob) for a in actions)
    clock.advance(2.0)
    seen(plan, ckpt(80))
    run_until(plan, clock, 40.0)
    assert secured_step(plan) == 80
    assert plan.state is State.AWAITING_SAVE  # the job still runs: its next save is awaited, not dropped
    clock.now = 45.0
    seen(plan, ckpt(100))
    clock.now = 50.0
    seen(plan, ckpt(120))  # saved while the push of 100 runs: pushed after it
    run_until(plan, clock, 55.0)
    assert [h.args["step"] for h in pusher.started] == [20, 80, 100, 120]
    assert secured_step(plan) == 120
    clock.now = 56.5
    plan.on(JobExited(ok=False))  # stopped by the guard
    assert plan.state is State.DONE


def test_deadline_a_job_that_cannot_save_and_saves_nothing_more_ends_by_secure_by(clock: FakeClock) -> None:
    pusher = FakePusher(clock)
    plan = make(clock, pusher, deadline_at=30.0)
    seen(plan, ckpt(5))
    run_until(plan, clock, 5.0)
    plan.on(DeadlineNear(can_save=False))
    run_until(plan, clock, 40.0)
    assert plan.state is State.DONE and clock.now <= 30.0 - SAFETY_S + 0.11
    assert secured_step(plan) == 5
    assert [h.args["step"] for h in pusher.started] == [5]


def test_a_resumed_checkpoint_fetched_from_the_destination_stands_as_secured(clock: FakeClock) -> None:
    # resumed from the destination's step 13, the deadline comes before the job's first save: exit 75 material
    pusher = FakePusher(clock)
    plan = make(clock, pusher, deadline_at=30.0)
    plan.on(AlreadySecured(ckpt(13), "/dest", "/dest/last-checkpoint"))
    assert plan.report().secured is not None and plan.report().secured.pushed == "/dest/last-checkpoint"
    plan.on(DeadlineNear(can_save=False))
    run_until(plan, clock, 40.0)
    assert pusher.started == []  # never pushed again
    assert secured_step(plan) == 13
    plan2 = make(clock, FakePusher(clock), deadline_at=1000.0)
    plan2.on(AlreadySecured(ckpt(13), "/dest", "/dest/last-checkpoint"))
    seen(plan2, ckpt(20))  # a newer save replaces it as it is secured
    run_until(plan2, clock, clock.now + 10.0)
    assert secured_step(plan2) == 20


def test_before_the_first_step_the_deadline_request_waits_until_late(clock: FakeClock) -> None:
    """A slow start (imports, preflight) must not be stopped for a save it cannot make yet: the margin rests on a
    guessed 1 GB checkpoint; before the first step the request waits until LATE_REQUEST_S before the deadline."""
    from guard.secure.plan import LATE_REQUEST_S

    pusher = FakePusher(clock)
    plan = make(clock, pusher, deadline_at=1000.0)  # margin fixed at 100 s by make()
    clock.now = 1000.0 - 100.0
    assert not plan.deadline_due(clock.now) and plan.due_at(clock.now) == pytest.approx(1000.0 - LATE_REQUEST_S)
    plan.on(TrainingStarted())
    assert plan.deadline_due(clock.now)
    plan2 = make(clock, pusher, deadline_at=1000.0)
    clock.now = 1000.0 - LATE_REQUEST_S
    assert plan2.deadline_due(clock.now)  # never started training: still stopped in time before the deadline


def test_a_job_that_saves_on_sigterm_gets_it_at_deadline_minus_margin(clock: FakeClock) -> None:
    plan = make(clock, FakePusher(clock))
    clock.now = 900.0
    actions = plan.on(DeadlineNear(can_save=False, handles_term=True))
    assert ForwardSignal(signal.SIGTERM) in actions
    plan2 = make(clock, FakePusher(clock))
    assert not any(isinstance(a, ForwardSignal) for a in plan2.on(DeadlineNear(can_save=False)))


# -- the orders of issue 17 ----------------------------------------------------------------------------------------


def test_nan_then_the_deadlines_request_never_secures_the_fresh_save(clock: FakeClock) -> None:
    pusher = FakePusher(clock)
    plan = make(clock, pusher, deadline_at=200.0)
    seen(plan, ckpt(50))
    run_until(plan, clock, 5.0)  # step 50 secured in the background
    clock.now = 150.0
    plan.on(DeadlineNear(can_save=True))
    actions = plan.on(Tainted(1030))  # the NaN of step 1030 is read after the request (flushed before the save)
    actions += seen(plan, ckpt(1032))  # the save the guard asked for
    assert MarkSuspect("/out/checkpoint-1032", 1032, 1030) in actions
    run_until(plan, clock, 200.0)
    report = plan.report()
    assert secured_step(plan) == 50 and report.non_finite_from_step == 1030
    assert report.suspect is not None and report.suspect.step == 1032
    assert [h.args["step"] for h in pusher.started] == [50]


def test_the_request_then_nan_before_the_save_stops_waiting_and_keeps_the_older_one(clock: FakeClock) -> None:
    pusher = FakePusher(clock)
    plan = make(clock, pusher, deadline_at=200.0)
    seen(plan, ckpt(50))
    run_until(plan, clock, 5.0)
    clock.now = 150.0
    plan.on(DeadlineNear(can_save=True))
    assert plan.state is State.AWAITING_SAVE
    actions = plan.on(Tainted(1292))  # asked at 1291, NaN for the next steps: the save it waits for would be suspect
    looks = [a for a in actions if isinstance(a, LookOlder)]
    assert [look.before_step for look in looks] == [1291] and plan.state is State.SECURING  # a save never seen?
    plan.on(LookedOlder(None))  # none on disk
    assert plan.state is State.DONE and secured_step(plan) == 50


def test_a_good_save_found_on_disk_after_the_newest_was_refused_is_secured(clock: FakeClock) -> None:
    """The scans hand the plan the newest complete save only. Before, a refused newest save with no older one seen
    ended securing with nothing ("no complete checkpoint to secure"), though the save one step before lay whole on
    disk."""
    pusher = FakePusher(clock)
    plan = make(clock, pusher, deadline_at=200.0)
    clock.now = 150.0
    plan.on(DeadlineNear(can_save=False))
    # the newest save, its weights NaN: nothing older was seen
    actions = plan.on(CheckpointSeen(ckpt(37), finite=False))
    looks = [a for a in actions if isinstance(a, LookOlder)]
    assert [look.before_step for look in looks] == [37] and 150.0 < looks[0].until <= 150.0 + (200.0 - 150.0) / 2
    assert plan.state is State.SECURING and not pusher.started  # waiting for the look, not done
    actions = plan.on(LookedOlder(ckpt(36)))
    assert any(isinstance(a, StartPush) and a.step == 36 for a in actions)
    run_until(plan, clock, 190.0)
    assert secured_step(plan) == 36 and plan.state is State.DONE


def test_a_look_that_never_answers_ends_at_its_bound(clock: FakeClock) -> None:
    pusher = FakePusher(clock)
    plan = make(clock, pusher, deadline_at=200.0)
    seen(plan, ckpt(10))
    run_until(plan, clock, 5.0)
    actions = plan.on(Tainted(30))  # as securing feeds a non-finite loss: the taint, then the failure
    actions += plan.on(Failure("non_finite_loss"))
    until = next(a.until for a in actions if isinstance(a, LookOlder))
    assert plan.state is State.SECURING and plan.due_at(clock.now) <= until
    clock.now = until
    plan.on(Tick())
    assert plan.state is State.DONE and secured_step(plan) == 10
    plan.on(LookedOlder(ckpt(28)))  # too late: securing is over
    assert secured_step(plan) == 10 and len(pusher.started) == 1


def test_a_running_push_of_a_suspect_save_is_killed(clock: FakeClock) -> None:
    pusher = FakePusher(clock, rate=lambda now: 0.05e6)
    plan = make(clock, pusher, deadline_at=None)
    seen(plan, ckpt(20))
    clock.advance(1.0)
    actions = plan.on(Tainted(20))
    assert any(isinstance(a, KillPush) and a.why == "suspect" for a in actions)
    assert plan.report().secured is None


def test_a_signal_less_than_grace_before_the_deadline_ends_before_the_deadline(clock: FakeClock) -> None:
    plan = make(clock, FakePusher(clock), deadline_at=40.0, grace_s=30.0)
    clock.now = 22.0
    actions = plan.on(SignalReceived(signal.SIGTERM, can_save=True))
    assert plan.secure_by == pytest.approx(40.0 - SAFETY_S)  # not 22 + 30 - 1.5
    assert StopJob(40.0 - SAFETY_S - STOP_BEFORE_S) in actions
    run_until(plan, clock, 60.0)
    assert plan.state is State.DONE and clock.now <= 40.0 - SAFETY_S + 0.11


def test_a_signal_during_deadline_securing_moves_the_stop_earlier(clock: FakeClock) -> None:
    plan = make(clock, FakePusher(clock), deadline_at=1000.0, grace_s=10.0)
    clock.now = 900.0
    plan.on(DeadlineNear(can_save=True))
    clock.now = 901.0
    actions = plan.on(SignalReceived(signal.SIGTERM, can_save=True))
    assert StopJob(901.0 + 10.0 - SAFETY_S - STOP_BEFORE_S) in actions


def test_a_failure_while_an_older_push_is_nearly_done_lets_it_finish(clock: FakeClock) -> None:
    # 5 GB at 50 MB/s: 100 s; the crash comes 90 s in, with 28.5 s of --grace left
    estimator = MarginEstimator(fixed_margin_s=100.0, log_changes=False, default_push_bytes_per_s=50e6)
    pusher = FakePusher(clock, rate=lambda now: 50e6, overhead_s=0.0)
    plan = Plan(clock=clock, pusher=pusher, estimator=estimator, deadline_at=None, grace_s=30.0,
                push_interval_s=0.0, unchanged=lambda info: True)
    big = ckpt(100, size_bytes=5_000_000_000)
    pusher.sizes[str(big.path)] = pusher.sizes["/out/checkpoint-200"] = big.size_bytes
    seen(plan, big)
    run_until(plan, clock, 60.0)
    seen(plan, ckpt(200, size_bytes=5_000_000_000))  # queued: the background push of 100 runs
    run_until(plan, clock, 90.0)
    plan.on(Failure("crash"))
    assert not pusher.killed  # the newer one (150 s) cannot fit in 28.5 s: the running push goes on
    run_until(plan, clock, 150.0)
    assert secured_step(plan) == 100


def test_a_job_that_finishes_inside_the_margin_is_a_pass_with_its_final_push(clock: FakeClock) -> None:
    from guard.secure.outcome import Verdict, checkpoint_fields

    pusher = FakePusher(clock)
    plan = make(clock, pusher, deadline_at=60.0)
    clock.now = 40.0
    plan.on(DeadlineNear(can_save=False))
    clock.now = 57.0
    plan.on(JobExited(ok=True, complete=True, has_final_model=True))
    assert plan.state is State.FINAL_PUSH and pusher.started[-1].op == "push_final"
    run_until(plan, clock, 60.0)
    report = plan.report()
    assert report.training_complete and report.final is not None and report.final.ok
    fields = checkpoint_fields(report, Verdict("TIMEOUT", "deadline", 0), step=280, nothing_found_hint="")
    assert (fields.verdict.status, fields.verdict.reason, fields.verdict.exit_code) == ("PASS", "ok", 0)


def test_a_stopped_job_that_did_not_finish_stays_a_timeout(clock: FakeClock) -> None:
    plan = make(clock, FakePusher(clock), deadline_at=60.0)
    seen(plan, ckpt(5))
    clock.now = 40.0
    plan.on(DeadlineNear(can_save=True))
    seen(plan, ckpt(6))
    plan.on(JobExited(ok=False, complete=False))
    run_until(plan, clock, 60.0)
    assert plan.report().trigger == "deadline" and not plan.report().training_complete


def test_a_failed_push_never_raises_the_margin(clock: FakeClock) -> None:
    estimator = MarginEstimator(log_changes=False, floor_s=0.0)
    pusher = FakePusher(clock, rate=lambda now: 1e3, overhead_s=0.0)  # an unreachable Hub: retries, then an error
    pusher.fail_next = True
    plan = Plan(clock=clock, pusher=pusher, estimator=estimator, deadline_at=None, push_interval_s=0.0,
                unchanged=lambda info: True)
    before = estimator.margin_s()
    seen(plan, ckpt(1, size_bytes=1_000))
    pusher.started[-1].duration_s = 7.5
    run_until(plan, clock, 10.0)
    assert pusher.started[-1].result is not None and not pusher.started[-1].result.ok
    assert estimator.margin_s() == pytest.approx(before)


def test_an_event_a_state_does_not_accept_is_logged_and_counted(clock: FakeClock,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    plan = make(clock, FakePusher(clock))
    plan.on(Failure("crash"))
    with caplog.at_level(logging.DEBUG, logger="guard.secure"):
        assert plan.on(DeadlineNear(can_save=True)) == []
    assert "DeadlineNear not accepted" in caplog.text
    assert plan.report().ignored[-1].endswith("/DeadlineNear")


def test_the_report_is_frozen_and_the_plan_has_no_public_fields(clock: FakeClock) -> None:
    plan = make(clock, FakePusher(clock))
    report = plan.report()
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.trigger = "deadline"  # type: ignore[misc]
    assert not [name for name in vars(plan) if not name.startswith("_")]


def test_every_state_accepts_a_taint_and_every_table_handler_exists() -> None:
    from guard.secure.plan import TRANSITIONS

    for state in State:
        assert (state, Tainted) in TRANSITIONS and (state, JobExited) in TRANSITIONS
    assert (State.DONE, SignalReceived) not in TRANSITIONS


def test_a_job_that_cannot_be_asked_has_its_next_save_secured_after_a_failed_push(clock: FakeClock) -> None:
    # nanoGPT's shape in the final stretch: ckpt.pt rewritten in place every few seconds; one push reads the file
    # while it is cut short (fails by format). The next save is still secured: a failed push does not end securing.
    pusher = FakePusher(clock)
    plan = make(clock, pusher, deadline_at=300.0)
    seen(plan, ckpt(10))
    run_until(plan, clock, 5.0)
    assert secured_step(plan) == 10
    plan.on(DeadlineNear(can_save=False))
    pusher.fail_next = True
    seen(plan, ckpt(20))
    run_until(plan, clock, 10.0)
    assert secured_step(plan) == 10 and plan.state is State.AWAITING_SAVE  # the failed push: waits for the next
    seen(plan, ckpt(30))
    run_until(plan, clock, 15.0)
    assert secured_step(plan) == 30


def test_the_hub_interval_follows_the_measured_push_time(clock: FakeClock) -> None:
    # without --push-interval: 225 s (the Hub's commit rate limit, guard.secure.cadence), widened to 3x the last
    # measured push once a push took longer than 75 s
    pusher = FakePusher(clock, rate=lambda now: 0.01e6, overhead_s=1.0)  # 1 MB: 101 s
    estimator = MarginEstimator(fixed_margin_s=100.0, log_changes=False)
    plan = Plan(clock=clock, pusher=pusher, estimator=estimator, deadline_at=None, push_interval_s=None,
                destination_kind="hub", final_output_dir="/out", unchanged=lambda info: True)
    seen(plan, ckpt(10))
    run_until(plan, clock, 150.0)
    assert secured_step(plan) == 10
    seen(plan, ckpt(20))
    run_until(plan, clock, 290.0)
    assert len(pusher.started) == 1  # 225 s after the first start would have been 225: now 3 x 101 s = 303 s
    run_until(plan, clock, 304.0)
    assert [h.args["step"] for h in pusher.started] == [10, 20]


def test_a_destination_found_later_gets_the_derived_interval(clock: FakeClock) -> None:
    pusher = FakePusher(clock)
    estimator = MarginEstimator(fixed_margin_s=100.0, log_changes=False)
    plan = Plan(clock=clock, pusher=None, estimator=estimator, deadline_at=None, push_interval_s=None,
                unchanged=lambda info: True)
    plan.on(DestinationKnown(pusher, kind="folder"))  # a folder: every complete save
    seen(plan, ckpt(10))
    run_until(plan, clock, 5.0)
    seen(plan, ckpt(20))
    run_until(plan, clock, 10.0)
    assert [h.args["step"] for h in pusher.started] == [10, 20]


def test_a_background_push_with_no_progress_is_logged_and_replaced_by_a_newer_checkpoint(
        clock: FakeClock, caplog: pytest.LogCaptureFixture) -> None:
    # huggingface_hub #1502: a hung background push held every newer one back, with no log line
    pusher = FakePusher(clock)
    plan = make(clock, pusher, deadline_at=None, interval_s=0.0)
    pusher.stall_next = True
    with caplog.at_level(logging.WARNING, logger="guard.secure"):
        seen(plan, ckpt(10))
        run_until(plan, clock, 10.0)
        seen(plan, ckpt(20))  # queued behind the stalled push
        run_until(plan, clock, 29.0)
        assert len(pusher.started) == 1 and not pusher.killed
        actions = run_until(plan, clock, 31.0)
    assert "push of step 10 (/out/checkpoint-10) made no progress for 30s" in caplog.text
    assert KillPush("stalled", "/out/checkpoint-10", 10) in actions
    assert [h.args["step"] for h in pusher.started] == [10, 20]
    run_until(plan, clock, 40.0)
    assert secured_step(plan) == 20


def test_a_stalled_push_with_nothing_newer_is_logged_once_and_goes_on(clock: FakeClock,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    pusher = FakePusher(clock)
    estimator = MarginEstimator(fixed_margin_s=100.0, log_changes=False)
    plan = Plan(clock=clock, pusher=pusher, estimator=estimator, deadline_at=None, push_interval_s=0.0,
                stall_s=5.0, unchanged=lambda info: True)
    pusher.stall_next = True
    with caplog.at_level(logging.WARNING, logger="guard.secure"):
        seen(plan, ckpt(10))
        run_until(plan, clock, 20.0)
    assert caplog.text.count("made no progress") == 1 and not pusher.killed
    pusher.stall_next = True  # the replacement stalls too: the bound doubles (10 s), so the Hub gets its chance
    seen(plan, ckpt(20))
    run_until(plan, clock, 20.5)
    assert [h.args["step"] for h in pusher.started] == [10, 20]
    seen(plan, ckpt(30))
    run_until(plan, clock, 29.0)
    assert len(pusher.started) == 2
    run_until(plan, clock, 31.0)
    assert [h.args["step"] for h in pusher.started] == [10, 20, 30]


def test_a_stalled_securing_push_is_replaced_by_the_newer_save(clock: FakeClock) -> None:
    pusher = FakePusher(clock)
    plan = make(clock, pusher, deadline_at=None, grace_s=600.0)
    pusher.stall_next = True
    seen(plan, ckpt(10))
    plan.on(Failure("stalled"))  # securing: the running push of step 10 now ends the run
    clock.advance(1.0)
    seen(plan, ckpt(20))  # both fit by the estimates: the running one would go first
    assert len(pusher.started) == 1
    run_until(plan, clock, 35.0)
    assert [h.args["step"] for h in pusher.started] == [10, 20]
    assert secured_step(plan) == 20


def test_at_the_deadline_a_newer_complete_checkpoint_that_fits_replaces_the_older_push(clock: FakeClock) -> None:
    # issue 18: checkpoint-570 was secured although checkpoint-597 was complete with time left; the supersede
    # estimate counted the margin's 15 s overhead on top of a push measured at 2 s, so 597 "did not fit"
    pusher = FakePusher(clock, rate=lambda now: 10e6)  # 10 MB: 1 s + 1 s overhead
    plan = make(clock, pusher, deadline_at=1000.0)
    small, big = 10_000_000, 200_000_000
    pusher.sizes.update({"/out/checkpoint-500": small, "/out/checkpoint-570": big, "/out/checkpoint-597": small})
    seen(plan, ckpt(500, size_bytes=small))
    run_until(plan, clock, 10.0)
    assert secured_step(plan) == 500  # measured: about 2 s for 10 MB
    clock.now = 900.0
    plan.on(TrainingStarted())
    plan.on(DeadlineNear(can_save=True))
    clock.now = 980.0
    seen(plan, ckpt(570, size_bytes=big))  # would end after secure_by (998.5) by the measured rate: not started
    assert [h.args["step"] for h in pusher.started] == [500]
    run_until(plan, clock, 986.5)
    assert plan.secure_by - clock.now == pytest.approx(12.0)
    actions = seen(plan, ckpt(597, size_bytes=small))  # complete, 12 s left, costs about 3 s
    assert any(isinstance(a, StartPush) and a.step == 597 for a in actions)
    run_until(plan, clock, 1000.0)
    assert secured_step(plan) == 597
    assert plan.state is State.DONE and all(h.result is not None for h in pusher.started)


def test_a_restarts_early_save_never_replaces_the_resumed_checkpoint(clock: FakeClock) -> None:
    # resumed from the destination's step 400, the job did not load it and started over: its early saves (lower
    # steps) are of another training and are never pushed over the secured copy, nor at the deadline
    pusher = FakePusher(clock)
    plan = make(clock, pusher, deadline_at=100.0)
    plan.on(AlreadySecured(ckpt(400), "/dest", "/dest/last-checkpoint"))
    seen(plan, ckpt(10))
    run_until(plan, clock, 5.0)
    plan.on(DeadlineNear(can_save=True))
    seen(plan, ckpt(20))
    run_until(plan, clock, 100.0)
    assert pusher.started == [] and secured_step(plan) == 400


def test_a_save_under_way_when_asked_is_secured_and_the_requested_one_after_it_too(clock: FakeClock) -> None:
    # issue 18: at SIGTERM a periodic checkpoint-210 was being saved; it was secured as if it were the answer, and
    # securing ended: the requested checkpoint-227, complete with time left, was left
    pusher = FakePusher(clock)
    plan = make(clock, pusher, grace_s=30.0)
    seen(plan, ckpt(190))
    run_until(plan, clock, 3.0)
    plan.on(SignalReceived(signal.SIGTERM, can_save=True))
    plan.on(CheckpointSeen(ckpt(210), requested=False))  # the job's own save, under way when asked
    run_until(plan, clock, 8.0)
    assert secured_step(plan) == 210 and plan.state is State.AWAITING_SAVE  # the answer is still waited for
    clock.advance(2.0)
    plan.on(CheckpointSeen(ckpt(227), requested=True))
    run_until(plan, clock, 40.0)
    assert secured_step(plan) == 227 and plan.state is State.DONE
    assert [h.args["step"] for h in pusher.started] == [190, 210, 227]


def test_the_answer_is_waited_for_only_until_the_wait_for_it_ends(clock: FakeClock) -> None:
    pusher = FakePusher(clock)
    plan = make(clock, pusher, grace_s=20.0)
    plan.on(SignalReceived(signal.SIGTERM, can_save=True))
    plan.on(CheckpointSeen(ckpt(30), requested=False))
    run_until(plan, clock, 40.0)  # no answer comes: the wait's end ends securing, before the grace is over
    assert plan.state is State.DONE and clock.now <= 20.0 - SAFETY_S + 0.11 and secured_step(plan) == 30


def test_a_job_asked_too_early_to_tell_that_never_answers_has_every_later_save_secured(clock: FakeClock) -> None:
    # seen at load 5 (a nanoGPT-shaped loop without the API, still starting at the deadline's request): asked, it
    # saved ckpt.pt on its own (found, requested None), that save was secured and securing ended; its 13 later saves
    # before the guard stopped it were never pushed
    pusher = FakePusher(clock, rate=lambda now: 2e6)  # 0.5 s per push
    plan = make(clock, pusher, deadline_at=60.0, interval_s=600.0)
    clock.now = 35.0
    actions = plan.on(DeadlineNear(can_save=True))  # too early to tell: asked
    assert RequestSave() in actions
    clock.advance(2.0)
    seen(plan, ckpt(10))
    run_until(plan, clock, 40.0)
    assert secured_step(plan) == 10 and plan.state is State.AWAITING_SAVE  # the job runs on: followed
    for step, at in ((20, 42.0), (30, 47.0)):
        clock.now = at
        seen(plan, ckpt(step))
        run_until(plan, clock, at + 2.0)
    assert [h.args["step"] for h in pusher.started] == [10, 20, 30] and secured_step(plan) == 30
    clock.now = 56.5
    plan.on(JobExited(ok=False))  # stopped by the guard at secure_by - STOP_BEFORE_S
    assert plan.state is State.DONE


def test_a_job_that_answers_ends_securing_with_its_answer(clock: FakeClock) -> None:
    pusher = FakePusher(clock)
    plan = make(clock, pusher, deadline_at=60.0)
    clock.now = 35.0
    plan.on(DeadlineNear(can_save=True))
    plan.on(CheckpointSeen(ckpt(40), requested=True))
    run_until(plan, clock, 45.0)
    assert secured_step(plan) == 40 and plan.state is State.DONE and clock.now < 45.0


@pytest.mark.parametrize("requested", [None, False])
def test_after_the_wait_for_an_answer_ends_the_jobs_later_saves_are_secured_too(clock: FakeClock,
                                                                                 requested: bool | None) -> None:
    # the order of a run at load 5: asked, the job (no API, found too early to tell) did not answer within the
    # wait; the newest older save was secured instead and securing ended, though the job ran on and saved 13 more
    # times before its stop
    pusher = FakePusher(clock, rate=lambda now: 100e6)
    plan = make(clock, pusher, deadline_at=60.0, background=False)
    seen(plan, ckpt(5, size_bytes=200_000_000))  # not pushed in the background: the fallback
    clock.now = 35.0
    assert RequestSave() in plan.on(DeadlineNear(can_save=True))
    run_until(plan, clock, 52.0)  # the wait ends, the fallback is secured
    assert secured_step(plan) == 5 and plan.state is State.AWAITING_SAVE
    for step, at in ((10, 52.0), (20, 54.0)):
        clock.now = at
        plan.on(CheckpointSeen(ckpt(step), requested=requested))
        run_until(plan, clock, at + 1.5)
    assert [h.args["step"] for h in pusher.started] == [5, 10, 20] and secured_step(plan) == 20


def test_a_save_written_over_before_its_push_is_refused_and_the_newer_one_secured_under_its_own_step(
        clock: FakeClock, caplog: pytest.LogCaptureFixture) -> None:
    # A loop that saves ckpt.pt in place: each push carries the mtime of the save it was reported for, so that a
    # file written again since then is refused by the push instead of secured under the older step (a step-50
    # content secured as step 30 let the next run's step-30 save replace it as "newer").
    from fakes import FakeResult

    from guard.secure.report import REWRITTEN

    pusher = FakePusher(clock, overhead_s=2.0)
    plan = make(clock, pusher)

    def in_place(step: int) -> CheckpointInfo:
        return CheckpointInfo(path=Path("/out/ckpt.pt"), step=step, size_bytes=1000, files=("ckpt.pt",),
                              newest_mtime_s=100.0 + step, root=Path("/out"))

    seen(plan, in_place(30))
    first = pusher.started[0]
    assert first.args["saved_by_s"] == 130.0  # without a non-finite loss too
    seen(plan, in_place(40))  # queued behind the running push
    first.result = FakeResult("push_checkpoint", False, error="cannot secure checkpoint step 30: /out/ckpt.pt was "
                              "rewritten after that save", error_type=REWRITTEN)
    with caplog.at_level(logging.INFO, logger="guard"):
        run_until(plan, clock, 10.0)
    assert [h.args["step"] for h in pusher.started] == [30, 40]
    assert pusher.started[1].args["saved_by_s"] == 140.0
    report = plan.report()
    assert secured_step(plan) == 40 and report.error is None
    assert report.history[0].rewritten and not report.history[1].rewritten
    refused = [r for r in caplog.records if "rewritten after that save" in r.getMessage()]
    assert [r.levelno for r in refused] == [logging.INFO]  # not the destination's failure: no error line


# -- a push is provisional until its step's losses are read (issue 33) ----------------------------------------------


def test_a_save_past_the_losses_read_is_held_until_its_step_is_read(clock: FakeClock) -> None:
    pusher = FakePusher(clock)
    plan = make(clock, pusher, deadline_at=None)
    plan.on(ReadThrough(100))
    assert seen(plan, ckpt(108)) == [] and pusher.started == []  # the window 101-110 is not read yet
    actions = plan.on(ReadThrough(110))
    assert [a.step for a in actions if isinstance(a, StartPush)] == [108]
    run_until(plan, clock, 5.0)
    assert secured_step(plan) == 108


def test_a_nan_read_after_a_save_in_its_window_makes_the_held_save_suspect(clock: FakeClock) -> None:
    """The NaN-window push: ``checkpoint-108`` is reported before the window holding step 107's NaN is read."""
    pusher = FakePusher(clock)
    plan = make(clock, pusher, deadline_at=None)
    plan.on(ReadThrough(100))
    seen(plan, ckpt(100))
    run_until(plan, clock, 3.0)
    seen(plan, ckpt(105))
    seen(plan, ckpt(108))
    actions = plan.on(Tainted(107))
    assert [a.step for a in actions if isinstance(a, MarkSuspect)] == [108]
    assert [h.args["step"] for h in pusher.started] == [100, 105]  # 105: before the NaN, read with it
    plan.on(Failure("non_finite_loss"))
    run_until(plan, clock, 10.0)
    assert secured_step(plan) == 105 and all(h.args["step"] != 108 for h in pusher.started)


def test_the_saves_held_are_taken_when_the_job_exits(clock: FakeClock) -> None:
    pusher = FakePusher(clock)
    plan = make(clock, pusher, deadline_at=None, final=None)
    plan.on(ReadThrough(10))
    seen(plan, ckpt(20))
    assert pusher.started == []
    plan.on(JobExited(ok=False))  # no more losses will be read
    run_until(plan, clock, 5.0)
    assert [h.args["step"] for h in pusher.started] == [20]


def test_a_save_in_another_unit_is_taken_at_the_second_read_after_it(clock: FakeClock) -> None:
    """``ckpt-32000.pt`` named by samples: two reads sent after the save cover it, whatever its number says."""
    pusher = FakePusher(clock)
    plan = make(clock, pusher, deadline_at=None)
    plan.on(ReadThrough(10))
    seen(plan, ckpt(32000))
    plan.on(ReadThrough(20))
    assert pusher.started == []
    plan.on(ReadThrough(30))
    assert [h.args["step"] for h in pusher.started] == [32000]


def test_a_save_with_non_finite_weights_taints_its_step(clock: FakeClock, caplog: pytest.LogCaptureFixture) -> None:
    """The weights are a witness (ModernBERT #233: the loss stayed finite, the weights went NaN); the log says
    so, not "the loss went non-finite" (the loss never did)."""
    pusher = FakePusher(clock)
    plan = make(clock, pusher, deadline_at=None)
    with caplog.at_level(logging.WARNING):
        actions = plan.on(CheckpointSeen(ckpt(30), finite=False))
    assert "the weights saved at step 30 are not finite" in caplog.text and "loss went" not in caplog.text
    assert any(isinstance(a, MarkSuspect) and a.step == 30 for a in actions) and pusher.started == []
    assert plan.report().non_finite_from_step == 30
    seen(plan, ckpt(40))
    assert pusher.started == []


def test_a_taint_that_reaches_a_recorded_push_puts_the_newest_good_checkpoint_back(clock: FakeClock) -> None:
    """A witness read late (a rank behind, the job's exit) names a step the destination's record is from: the record
    is moved back to the newest good one (``RestoreRecord``, no upload), and nothing counts as secured until that
    ends well."""
    pusher = FakePusher(clock)
    plan = make(clock, pusher, deadline_at=None)
    seen(plan, ckpt(10))
    run_until(plan, clock, 3.0)
    seen(plan, ckpt(20))
    run_until(plan, clock, 6.0)
    assert secured_step(plan) == 20
    actions = plan.on(Tainted(15))
    assert MarkSuspect("/out/checkpoint-20", 20, 15) in actions
    restores = [a for a in actions if isinstance(a, RestoreRecord)]
    assert [(a.step, a.revision, a.from_step) for a in restores] == [(10, "0" * 40, 20)]
    assert not any(isinstance(a, StartPush) for a in actions)
    assert secured_step(plan) is None  # the destination holds step 20 until the record is moved back
    assert plan.report().suspect_held is not None and plan.report().suspect_held.step == 20
    run_until(plan, clock, 9.0)
    assert secured_step(plan) == 10 and plan.report().suspect_held is None
    assert [(h.op, h.args["step"]) for h in pusher.started] == [
        ("push_checkpoint", 10), ("push_checkpoint", 20), ("restore_checkpoint", 10)]


def _recorded_then_tainted(clock: FakeClock, pusher: FakePusher, grace_s: float = 30.0) -> Plan:
    """Steps 10 and 20 pushed and recorded, then the loss of step 21 is NaN: the save of step 20 is suspect."""
    plan = make(clock, pusher, deadline_at=None, grace_s=grace_s)
    seen(plan, ckpt(10))
    run_until(plan, clock, 7.0)
    seen(plan, ckpt(20))
    run_until(plan, clock, 14.0)
    assert secured_step(plan) == 20
    return plan


def test_a_recorded_suspect_push_is_moved_back_where_no_time_is_left_to_push_again(clock: FakeClock) -> None:
    """The NaN of step 21 is read after the save of step 20 was recorded; --grace leaves 3.5 s, a push takes 6 s:
    before, the good step 10 was pushed again, killed at the end of the window, and the destination kept step 20
    (``secured=no``); the record is moved back instead (1 s, nothing uploaded)."""
    pusher = FakePusher(clock, rate=lambda now: 2e5, sizes={"": 0})  # a push 6 s, a restore 1 s
    plan = _recorded_then_tainted(clock, pusher, grace_s=5.0)
    plan.on(Tainted(21))
    plan.on(Failure("non_finite_loss"))
    run_until(plan, clock, 30.0)
    assert plan.state is State.DONE and secured_step(plan) == 10, plan.report()
    assert [h.op for h in pusher.started][2:] == ["restore_checkpoint"]
    assert plan.report().suspect_held is None and plan.report().secured.pushed == "hf://alice/run@" + "0" * 40


def test_a_restore_the_store_cannot_do_falls_back_to_pushing_the_good_checkpoint_again(clock: FakeClock) -> None:
    pusher = FakePusher(clock)
    plan = _recorded_then_tainted(clock, pusher)
    pusher.fail_next = True  # the restore: the store keeps no older copy
    plan.on(Tainted(21))
    run_until(plan, clock, 20.0)
    assert [(h.op, h.args["step"]) for h in pusher.started][2:] == [("restore_checkpoint", 10), ("push_checkpoint", 10)]
    assert secured_step(plan) == 10 and plan.report().suspect_held is None


def test_a_restore_out_of_time_leaves_nothing_secured_and_says_the_destination_holds_the_suspect_save(
        clock: FakeClock) -> None:
    pusher = FakePusher(clock, rate=lambda now: 2e5, sizes={"": 0})
    plan = _recorded_then_tainted(clock, pusher, grace_s=5.0)
    pusher.stall_next = True  # the restore never answers
    plan.on(Tainted(21))
    plan.on(Failure("non_finite_loss"))
    run_until(plan, clock, 30.0)
    report = plan.report()
    assert report.state is State.DONE and report.secured is None
    assert report.suspect_held is not None and report.suspect_held.step == 20
    verdict = Verdict("FAIL", "non_finite_loss", 4, "the loss went non-finite at step 21", None)
    fields = checkpoint_fields(report, verdict, step=21, nothing_found_hint="-")
    assert fields.extra.get("secured") == "no"
    assert "the destination still holds checkpoint step 20" in (fields.verdict.hint or ""), fields.verdict.hint
    assert "was pushed before that loss was read)" in (fields.verdict.hint or "")  # never "was not pushed"
    # run_clm_no_trainer.py at lr 1e6 read '(the save of out/step_1 (step 1), made from the step before the first
    # non-finite loss on, was not pushed)'
    assert "(step 20), saved at or after the step before the first non-finite loss, was pushed" in \
        (fields.verdict.hint or ""), fields.verdict.hint
    assert fields.details["suspect_at_destination"]["step"] == 20


def test_a_taint_before_the_resumed_record_moves_the_destination_back_to_it(clock: FakeClock) -> None:
    """A resumed run's first push is recorded, then tainted: the record goes back to the one it was fetched from."""
    pusher = FakePusher(clock)
    plan = make(clock, pusher, deadline_at=None)
    plan.on(AlreadySecured(ckpt(100), "hf://alice/run", "a" * 40))
    seen(plan, ckpt(110))
    run_until(plan, clock, 3.0)
    assert secured_step(plan) == 110
    actions = plan.on(Tainted(111))
    assert [(a.step, a.revision) for a in actions if isinstance(a, RestoreRecord)] == [(100, "a" * 40)]
    run_until(plan, clock, 6.0)
    assert secured_step(plan) == 100


def test_a_record_whose_next_loss_was_read_finite_releases_the_older_record_kept_aside(clock: FakeClock) -> None:
    """Step 10's record can turn suspect until step 11's loss is read (its weights give that loss); once read
    finite, the older record kept aside to move back to may go, once."""
    pusher = FakePusher(clock)
    plan = make(clock, pusher, deadline_at=None)
    plan.on(ReadThrough(10))
    seen(plan, ckpt(10))
    run_until(plan, clock, 3.0)
    assert secured_step(plan) == 10
    assert not any(isinstance(a, ReleaseKept) for a in plan.on(ReadThrough(10)))
    assert ReleaseKept(10) in plan.on(ReadThrough(11))
    assert not any(isinstance(a, ReleaseKept) for a in plan.on(ReadThrough(12)))
    seen(plan, ckpt(20))  # read through 12 only: held, not pushed
    assert not any(isinstance(a, ReleaseKept) for a in plan.on(ReadThrough(20)))  # its push runs now
    run_until(plan, clock, 6.0)
    assert secured_step(plan) == 20 and ReleaseKept(20) in plan.on(ReadThrough(21))


def test_a_save_whose_step_is_not_known_is_logged_as_such(clock: FakeClock,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """A file the scan found with no step of its own (a ``model.pt`` no agent reported) is pushed and logged as
    "step not known", never "step None" (the new-user trial read "securing out/model.pt (step None, ...)")."""
    pusher = FakePusher(clock, rate=lambda now: 1e6)
    plan = make(clock, pusher)
    info = dataclasses.replace(ckpt(10), path=Path("/out/model.pt"), step=None, files=("model.pt",))
    with caplog.at_level(logging.INFO, logger="guard.secure"):
        seen(plan, info)
        run_until(plan, clock, 10.0)
    assert pusher.started, "the save was not pushed"
    assert "securing /out/model.pt (step not known" in caplog.text
    assert "step None" not in caplog.text


def test_a_non_finite_gradient_norm_taints_like_a_loss_and_says_so(clock: FakeClock,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """nanoGPT at lr 1e6: clip_grad_norm_ returned nan at step 3, its loss finite; the plan logged 'the loss went
    non-finite at step 3' beside the watchdog's 'its loss was finite'."""
    pusher = FakePusher(clock)
    plan = make(clock, pusher, deadline_at=None)
    with caplog.at_level(logging.WARNING):
        plan.on(Tainted(3, witness="grad_norm"))
    assert "the gradient norm went non-finite at step 3 (its loss was finite)" in caplog.text
    assert "loss went" not in caplog.text
    assert Tainted(3, witness="grad_norm").saves_from == 2  # the save at step 2 gave that step's gradients
