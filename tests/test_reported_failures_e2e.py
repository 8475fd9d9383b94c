"""End to end: the verdict and the cause for failures users report (issue 21), on tiny real jobs."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from conftest import JOBS, GuardRun, kill_quietly, run_guard, start_guard

from guard.run.supervisor import SAMPLE_EVERY_S

pytestmark = pytest.mark.slow


# -- zero training steps ---------------------------------------------------------------------------------------------


def test_an_empty_dataloader_that_saves_and_exits_0_is_incomplete(tmp_path: Path) -> None:
    run = run_guard([str(JOBS / "empty_loader.py"), "--out", str(tmp_path / "out")], cwd=tmp_path)
    fields = run.fields()
    assert (fields["status"], fields["reason"], run.returncode) == ("FAIL", "incomplete", 7), run.stdout + run.stderr
    assert "no training step" in fields["hint"] and "AdamW" in fields["hint"]
    assert "3 sample(s) with batch_size=8 and drop_last=True" in fields["hint"]
    assert (tmp_path / "out" / "model.pt").exists()  # the job did save; the verdict is the guard's


def test_an_evaluation_script_that_never_trains_passes_and_says_it_ran_no_step(tmp_path: Path) -> None:
    run = run_guard([str(JOBS / "empty_loader.py"), "--eval", "--samples", "16"], cwd=tmp_path)
    fields = run.fields()
    assert (fields["status"], fields["reason"], run.returncode) == ("PASS", "ok", 0), run.stdout + run.stderr
    assert fields["steps"] == "0"
    assert "step" not in fields


# -- a DataLoader worker killed for memory -----------------------------------------------------------------------


def test_a_dataloader_worker_sigkilled_while_holding_the_most_memory_is_oom_with_its_size(tmp_path: Path) -> None:
    ready = tmp_path / "worker.pid"
    proc = start_guard([str(JOBS / "worker_memory.py"), "--mb", "400", "--ready", str(ready)], cwd=tmp_path)
    try:
        deadline = time.monotonic() + 90
        while not ready.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert ready.exists(), proc.communicate(timeout=30)
        time.sleep(SAMPLE_EVERY_S * 2.5)  # the guard samples every process's memory
        os.kill(int(ready.read_text()), signal.SIGKILL)  # as the kernel's OOM killer would
        stdout, stderr = proc.communicate(timeout=90)
    finally:
        kill_quietly(proc)
    fields = GuardRun(proc.returncode, stdout, stderr).fields()
    assert (fields["status"], fields["reason"]) == ("FAIL", "oom"), stdout + stderr[-3000:]
    assert f"DataLoader worker (pid {ready.read_text()}) was killed by SIGKILL holding" in fields["hint"]
    assert "MB resident" in fields["hint"] and "the job's peak" in fields["hint"]
    assert "num_workers" in fields["hint"]
    assert "Connection reset" not in fields["hint"] and "ConnectionResetError" not in fields["hint"]
