"""Property-based tests of the securing plan: random event orders (``plan_machine.PlanMachine``), invariants after
every step. The CI profile is derandomized (the same examples every run) and sized to find the orders the issue
names (a NaN after the deadline's request, a signal less than --grace before the deadline, a failure while a push
is nearly done, a job that finishes inside the margin) in well under a minute."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings
from plan_machine import PlanMachine, quiet_plan_logs

settings.register_profile("plan-ci", max_examples=500, stateful_step_count=25, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    levels = {name: logging.getLogger(name).level for name in ("guard.secure", "guard.budget")}
    quiet_plan_logs()
    yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


TestPlanInvariants = PlanMachine.TestCase
TestPlanInvariants.settings = settings.get_profile("plan-ci")
