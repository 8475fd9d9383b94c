"""Tests for ``guard.run.timers`` driven with plain numbers (no clock, no sleeping)."""

from __future__ import annotations

import math

import pytest

from guard.run.timers import Escalation, StallWatch


def test_no_output_at_all_is_a_stall_after_the_timeout() -> None:
    watch = StallWatch(timeout_s=30.0, now=100.0)
    assert watch.due_at() == 130.0
    assert not watch.expired(129.9)
    assert watch.expired(130.0)
    assert watch.silent_for_s(131.0) == 31.0


def test_output_counts_as_progress_before_the_first_step() -> None:
    watch = StallWatch(30.0, 0.0)
    watch.output(20.0)
    assert not watch.expired(45.0)
    assert watch.due_at() == 50.0


def test_output_no_longer_counts_after_the_first_step() -> None:
    watch = StallWatch(30.0, 0.0)
    watch.step(10.0)
    assert watch.first_step_seen
    watch.output(35.0)  # a chatty but stuck job
    assert watch.due_at() == 40.0
    assert watch.expired(40.0)
    watch.step(39.0)
    assert not watch.expired(40.0)
    assert watch.due_at() == 69.0


def test_pause_stops_the_watch() -> None:
    watch = StallWatch(30.0, 0.0)
    watch.pause()
    assert watch.due_at() == math.inf
    assert not watch.expired(1e9)


def test_escalation_not_started_is_never_due() -> None:
    esc = Escalation(grace_s=30.0)
    assert not esc.started
    assert esc.due_at() == math.inf
    assert not esc.kill_due(1e9)


def test_escalation_term_then_kill_once_after_the_grace() -> None:
    esc = Escalation(grace_s=30.0)
    assert esc.start(100.0) is True  # the caller sends SIGTERM
    assert esc.started
    assert esc.start(105.0) is False  # idempotent: no second SIGTERM, no new grace
    assert esc.due_at() == 130.0
    assert not esc.kill_due(129.99)
    assert esc.kill_due(130.0) is True  # the caller sends SIGKILL
    assert esc.kill_due(131.0) is False  # once
    assert esc.due_at() == math.inf


def test_escalation_with_its_own_grace() -> None:
    esc = Escalation(grace_s=30.0)
    esc.start(0.0, grace_s=5.0)
    assert esc.due_at() == 5.0
    assert esc.kill_due(5.0)


def test_no_sigkill_and_no_line_for_a_job_that_ended_within_its_grace(caplog: pytest.LogCaptureFixture) -> None:
    """Issue 36: "job exited: signal SIGTERM" was followed by "did not end within 1s of SIGTERM: SIGKILL"."""
    from types import SimpleNamespace

    from guard.run.upkeep import Upkeep

    sent: list[int] = []
    job = SimpleNamespace(alive=lambda: False, signal_all=sent.append)
    escalation = Escalation(1.0)
    escalation.start(0.0)
    link = SimpleNamespace(job=job, escalation=escalation, settings=SimpleNamespace(grace_s=1.0))
    upkeep = Upkeep(link, started=0.0)  # type: ignore[arg-type]
    with caplog.at_level("INFO", logger="guard.supervisor"):
        upkeep.stop_stragglers(2.0)
    assert sent == [] and "did not end within" not in caplog.text
    job.alive = lambda: True  # one that still runs gets it
    escalation.killed = False
    with caplog.at_level("INFO", logger="guard.supervisor"):
        upkeep.stop_stragglers(2.0)
    assert sent == [9] and "did not end within 1s of SIGTERM" in caplog.text
