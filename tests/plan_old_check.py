"""Run the plan's property test (``plan_machine.PlanMachine``) against the plan of an older commit (default
``afd27c5``, before the plan was closed), through a thin driver that feeds it as that commit's ``Securing`` did.
Prints the first counterexample hypothesis finds for each invariant. Not collected by pytest: run it by hand,

    PYTHONPATH=$PWD:tests python tests/plan_old_check.py [COMMIT [TRIES]]

Against afd27c5 (2026-12-01) every invariant fails; the first counterexample of each:

    [bound] secure_by 88.5 is past the deadline 60.0 less 1.5s          (a signal less than --grace before it)
    [finished] the job finished its training but the VERDICT would be TIMEOUT
    [in_time] securing still runs at 59.5, the kill is at 60.0
    [kill_bound] secure_by 58.5 is past the earliest kill 2.0 less 1.5s  (a deadline moved earlier while securing)
    [secured] secured names /out/checkpoint-0 (step 0), saved after the non-finite step 0
    [supersede] a push that would end at 1.1 (in time for 3.5) was killed for one that ends at 21.0
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings
from plan_machine import PlanMachine, quiet_plan_logs

from guard.secure.events import Decide, KillPush, StartPush

REPO = Path(__file__).resolve().parent.parent


def load_old_plan(commit: str) -> Any:
    source = subprocess.run(["git", "-C", str(REPO), "show", f"{commit}:guard/secure/plan.py"], check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "old_plan.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("old_plan", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_plan"] = module
    spec.loader.exec_module(module)
    module._unchanged = lambda info: True  # the machine's checkpoints are not on disk
    return module


OLD: Any = None
WHY = {"a newer checkpoint supersedes it": "superseded", "the final model supersedes it": "final"}


class OldDriver:
    def __init__(self, clock: Any, pusher: Any, estimator: Any, deadline_at: float | None, grace_s: float) -> None:
        self.plan = OLD.Plan(clock=clock, pusher=pusher, estimator=estimator, deadline_at=deadline_at,
                             grace_s=grace_s, push_interval_s=5.0, final_output_dir="/out")
        self.decided = False

    def _map(self, actions: list[Any]) -> list[Any]:
        out: list[Any] = []
        for action in actions:
            if isinstance(action, OLD.Decide):
                self.decided = True
                out.append(Decide(action.status, action.reason, action.signum))
            elif isinstance(action, OLD.KillPush):
                out.append(KillPush(WHY.get(action.why, action.why)))
            elif isinstance(action, OLD.StartPush):
                out.append(StartPush(action.kind, action.path, action.step, action.deadline))
        return out

    def checkpoint(self, info: Any, requested: bool | None = None) -> list[Any]:  # the old plan had no word on it
        return self._map(self.plan.checkpoint(info))

    def deadline_due(self, now: float) -> bool:
        return bool(self.plan.deadline_due(now))

    def deadline_near(self, can_save: bool) -> list[Any]:
        return self._map(self.plan.deadline_near(can_save=can_save))

    def deadline_moved(self, deadline_at: float) -> list[Any]:
        if self.plan.state is OLD.State.WATCHING:  # the old Securing moved it only then
            self.plan.deadline_at = deadline_at
        return []

    def signal(self, signum: int, can_save: bool) -> list[Any]:
        if self.plan.state is OLD.State.DONE:
            return []
        return self._map(self.plan.signal(signum, can_save=can_save))

    def failure(self, reason: str) -> list[Any]:
        self.decided = True
        return self._map(self.plan.failure(reason))

    def taint(self, step: int, *, decided: bool) -> list[Any]:
        self.decided = True
        return self._map(self.plan.failure("non_finite_loss", bad_from_step=step))

    def job_exit(self, *, ok: bool, complete: bool) -> list[Any]:
        return self._map(self.plan.job_exit(ok=ok and not self.decided, has_final_model=True))

    def tick(self) -> list[Any]:
        return self._map(self.plan.tick())

    @property
    def busy(self) -> bool:
        return bool(self.plan.busy)

    @property
    def secure_by(self) -> float:
        return float(self.plan.secure_by)

    def secured(self) -> tuple[str, int | None] | None:
        secured = self.plan.secured
        return None if secured is None or secured.info is None else (str(secured.info.path), secured.info.step)

    def status(self, decided: str | None) -> str:
        return decided or "PASS"


def main() -> int:
    global OLD
    OLD = load_old_plan(sys.argv[1] if len(sys.argv) > 1 else "afd27c5")
    tries = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    quiet_plan_logs()

    found: dict[str, str] = {}
    for check in sorted(PlanMachine.checks):
        class OldMachine(PlanMachine):
            driver_factory = OldDriver
            checks = frozenset({check})

        machine_test = OldMachine.TestCase
        machine_test.settings = settings(max_examples=2000, stateful_step_count=30, deadline=None, database=None,
                                         derandomize=False, suppress_health_check=list(HealthCheck))
        for _ in range(tries):  # random runs (not derandomized): each try explores other orders
            try:
                machine_test("runTest").runTest()
            except AssertionError as exc:
                found[check] = str(exc).splitlines()[0]
                break
        else:
            print(f"holds on the old plan in {tries} x 2000 examples: {check}")
    for text in found.values():
        print(f"FAILS on the old plan: {text}")
    return 0 if found else 1


if __name__ == "__main__":
    sys.exit(main())
