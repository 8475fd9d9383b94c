"""End to end: a real guard process, a real job (``tests/jobs/stuck_folder.py``) whose output folder holds a file
that never answers (a named pipe without a writer, read by the scan's DeepSpeed ``latest`` check: a stand-in for a
hung NFS or Lustre hard mount, with no test hook in the guard). The scan never returns; the deadline, a signal and
the VERDICT come all the same."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from conftest import JOBS, GuardRun, run_guard, signal_when, start_guard

pytestmark = [pytest.mark.slow]

FAST = ["--no-preflight", "--grace", "5s"]


def job_args(tmp_path: Path) -> list[str]:
    return [str(JOBS / "stuck_folder.py"), "--output-dir", str(tmp_path / "out"), "--ready", str(tmp_path / "ready")]


def test_a_scan_that_never_returns_leaves_the_deadline_and_the_verdict_alone(tmp_path: Path) -> None:
    started = time.monotonic()
    run = run_guard([*FAST, "--timeout", "20s", "--push-to", str(tmp_path / "dest"), "--output-dir",
                     str(tmp_path / "out"), *job_args(tmp_path)], timeout_s=90)
    took_s = time.monotonic() - started
    assert run.verdict.startswith("VERDICT: TIMEOUT"), run.stderr[-3000:]
    fields = run.fields()
    assert (fields["reason"], fields["secured"]) == ("deadline", "no")
    assert "did not answer within" in run.stderr  # the job's end went on without the scan's answer
    assert took_s < 40, f"the guard took {took_s:.0f}s for a 20s budget"
    assert not (tmp_path / "dest").exists() or not any((tmp_path / "dest").rglob("*.pt"))


def test_a_signal_is_handled_while_a_scan_never_returns(tmp_path: Path) -> None:
    proc = start_guard([*FAST, "--push-to", str(tmp_path / "dest"), "--output-dir", str(tmp_path / "out"),
                        *job_args(tmp_path)])
    stdout, stderr = signal_when(proc, tmp_path / "ready", signal.SIGTERM, settle_s=7.0, timeout_s=60.0)
    run = GuardRun(proc.returncode, stdout, stderr)
    assert run.verdict.startswith("VERDICT: INTERRUPTED"), stderr[-3000:]
    assert run.fields()["reason"] == "signal" and run.fields()["secured"] == "no"
