"""The final push's window with no deadline: --final-push-window (default 3 minutes), 3x the upload's estimate when
that is more, never past a deadline."""

from __future__ import annotations

import pytest
from fakes import FakeClock, FakePusher

from guard.run.config import FINAL_PUSH_WINDOW_S, OPTIONS
from guard.secure.budget import MarginEstimator
from guard.secure.events import JobExited, StartPush
from guard.secure.plan import SAFETY_S, Plan

ESTIMATOR = MarginEstimator(overhead_s=1.0, default_size_bytes=1e6, log_changes=False)


def make(clock: FakeClock, *, deadline_at: float | None, window_s: float | None = None) -> Plan:
    window = {} if window_s is None else {"final_window_s": window_s}
    return Plan(clock=clock, pusher=FakePusher(clock), estimator=ESTIMATOR, deadline_at=deadline_at,
                final_output_dir="/out", **window)


@pytest.mark.parametrize("window_s", [None, 20.0, 900.0])
def test_the_final_push_with_no_deadline_ends_within_its_window(window_s: float | None) -> None:
    clock = FakeClock(50.0)
    plan = make(clock, deadline_at=None, window_s=window_s)
    actions = plan.on(JobExited(ok=True, complete=True))
    start = next(a for a in actions if isinstance(a, StartPush))
    expected = max(window_s if window_s is not None else FINAL_PUSH_WINDOW_S,
                   3 * ESTIMATOR.secure_estimate_s())
    # one bound for every cause: the window's end less SAFETY_S, as for a deadline or --grace
    assert start.deadline == pytest.approx(50.0 + expected - SAFETY_S)
    assert plan.secure_by == pytest.approx(50.0 + expected - SAFETY_S)
    if window_s == 20.0:
        assert expected < 120  # no longer the old "3x the estimate plus two minutes"


def test_a_deadline_still_bounds_the_final_push() -> None:
    clock = FakeClock(50.0)
    plan = make(clock, deadline_at=100.0, window_s=900.0)
    plan.on(JobExited(ok=True, complete=True))
    assert plan.secure_by == pytest.approx(100.0 - SAFETY_S)


def test_the_window_is_an_option_with_a_few_minutes_by_default() -> None:
    option = next(o for o in OPTIONS if o.name == "final_push_window")
    assert option.default == FINAL_PUSH_WINDOW_S == 180.0 and option.default_text() == "3m"
