"""End to end: failures secure the newest complete checkpoint saved before them (folder destination)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest
from conftest import JOBS, kill_quietly, loaded_s, run_guard, start_guard

pytestmark = [pytest.mark.slow]

FAST = ["--skip-check", "python=imports are checked by the other tests", "--grace", "8s", "--check-every", "1"]


def secured_step(dest: Path) -> int:
    return json.loads((dest / "last-checkpoint" / "guard_manifest.json").read_text())["step"]


def loop(tmp_path: Path, *extra: str) -> list[str]:
    return [*FAST, "--push-to", str(tmp_path / "dest"), str(JOBS / "saving_loop.py"), "--output-dir",
            str(tmp_path / "out"), *extra]


@pytest.mark.parametrize(("flag", "status", "reason", "code"), [
    ("--nan-at", "FAIL", "non_finite_loss", 4),
    ("--crash-at", "FAIL", "crash", 1),
])
def test_a_failure_after_saves_secures_the_checkpoint_before_it(tmp_path: Path, flag: str, status: str,
                                                                reason: str, code: int) -> None:
    run = run_guard(loop(tmp_path, flag, "35"), timeout_s=90)
    fields = run.fields()
    assert (fields["status"], fields["reason"], run.returncode) == (status, reason, code), run.stderr[-3000:]
    assert fields["secured"] == "yes" and fields["checkpoint"].endswith("checkpoint-30")
    assert fields["pushed"].startswith(str(tmp_path / "dest"))
    assert secured_step(tmp_path / "dest") == 30


def test_a_stall_after_saves_secures_the_checkpoint_before_it(tmp_path: Path) -> None:
    run = run_guard(
        [*FAST, "--stall-timeout", loaded_s(10), "--push-to", str(tmp_path / "dest"), str(JOBS / "saving_loop.py"),
         "--output-dir", str(tmp_path / "out"), "--hang-at", "35"], timeout_s=90)
    fields = run.fields()
    assert (fields["status"], fields["reason"], run.returncode) == ("FAIL", "stalled", 5), run.stderr[-3000:]
    assert fields["secured"] == "yes" and secured_step(tmp_path / "dest") == 30


def test_a_job_killed_as_a_group_after_its_third_save_has_it_at_the_destination(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = start_guard([
        *FAST, "--push-interval", "0s", "--push-to", str(tmp_path / "dest"), str(JOBS / "saving_loop.py"),
        "--output-dir", str(out), "--step-s", "0.1"])
    try:
        end = time.monotonic() + 60
        while not (out / "checkpoint-30" / "model.pt").exists() and time.monotonic() < end:
            time.sleep(0.05)
        time.sleep(0.3)
        job = next(p for p in psutil.Process(proc.pid).children() if "saving_loop.py" in " ".join(p.cmdline()))
        os.killpg(os.getpgid(job.pid), signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        kill_quietly(proc)
    verdict = stdout.strip().splitlines()[-1]
    assert "reason=killed" in verdict and "secured=yes" in verdict, verdict + stderr[-3000:]
    assert secured_step(tmp_path / "dest") >= 30
    assert "in the background" in stderr


def test_a_save_inside_the_loss_window_after_the_nan_never_reaches_the_destination(tmp_path: Path) -> None:
    """Issue 33: losses are read every --check-every steps; the saves of steps 17-19 come after step 17's NaN but
    before the window 16-20 is read. They were pushed and recorded at once (the destination then held NaN weights
    while the VERDICT named an older step); now a save is provisional until its step's losses are read."""
    import torch

    run = run_guard([*FAST[:-1], "5", "--push-interval", "0", "--push-to", str(tmp_path / "dest"),
                     str(JOBS / "saving_loop.py"), "--output-dir", str(tmp_path / "out"), "--save-every", "1",
                     "--nan-at", "17", "--step-s", "0.7"], timeout_s=120)
    fields = run.fields()
    assert (fields["status"], fields["reason"], run.returncode) == ("FAIL", "non_finite_loss", 4), run.stderr[-3000:]
    # step 17's loss is the forward pass of the weights saved at step 16: the newest save not suspect is step 15
    assert fields["secured"] == "yes" and fields["checkpoint"].endswith("checkpoint-15"), run.stderr[-3000:]
    assert secured_step(tmp_path / "dest") == 15
    state = torch.load(tmp_path / "dest" / "last-checkpoint" / "model.pt")
    assert state["step"] == 15 and all(torch.isfinite(t).all() for t in state["model"].values())
