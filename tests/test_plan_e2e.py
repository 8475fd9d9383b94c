"""The event orders of issue 17 end to end: real guard processes, tiny real loops (``jobs/plan_orders.py``), a
folder destination. Each of these failed on the plan before it was closed (afd27c5): the NaN save secured with
exit 75, the VERDICT after the deadline, the finished job a TIMEOUT."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import JOBS, kill_quietly, loaded_s, run_guard, start_guard
from destinations import Destination

pytestmark = [pytest.mark.slow]

FAST = ["--skip-check", "python=imports are checked by the other tests"]
JOB = str(JOBS / "plan_orders.py")


def _pushed_weights_finite(dest: Path) -> bool:
    state = torch.load(dest / "last-checkpoint" / "model.pt", weights_only=True)
    return all(bool(torch.isfinite(t).all()) for t in state["model"].values())


def test_nan_then_the_deadlines_request_secures_the_save_before_it_and_says_non_finite(tmp_path: Path) -> None:
    out, dest = tmp_path / "out", tmp_path / "dest"
    # NaN from 5 s after the first step; the deadline's request at the budget less the 20 s margin (the budget's
    # start-up part stretched on a loaded machine, whose job takes longer to reach its first step)
    run = run_guard([*FAST, "--timeout", loaded_s(50, start_s=10), "--margin", "20s", "--check-every", "100000",
                     "--push-to", str(dest), "--output-dir", str(out), JOB, "--output-dir", str(out), "--answer",
                     "--nan-after-s", "5"], timeout_s=200)
    fields = run.fields()
    assert (fields["status"], run.returncode, fields["secured"]) == ("TIMEOUT", 75, "yes"), run.stderr[-3000:]
    assert "non-finite" in fields["hint"], run.verdict
    assert _pushed_weights_finite(dest), "the secured checkpoint holds the NaN weights"
    marked = sorted(out.glob("checkpoint-*/guard_suspect.json"))
    assert marked, "the save made after the non-finite loss is marked suspect"
    suspect = json.loads(marked[-1].read_text())
    assert suspect["step"] >= suspect["first_non_finite_step"]
    assert not fields["checkpoint"].endswith(marked[-1].parent.name)


def test_a_signal_less_than_grace_before_the_deadline_ends_before_the_deadline(tmp_path: Path) -> None:
    out, dest = tmp_path / "out", tmp_path / "dest"
    started = time.monotonic()
    proc = start_guard([*FAST, "--timeout", "36s", "--grace", "30s", "--margin", "5s", "--push-to", str(dest),
                        "--output-dir", str(out), JOB, "--output-dir", str(out), "--answer", "--slow-answer-s",
                        "120"])
    try:
        while not (dest / "last-checkpoint").is_dir() and time.monotonic() - started < 30:
            time.sleep(0.1)
        time.sleep(max(0.0, 14.0 - (time.monotonic() - started)))  # 22 s or less before the deadline: < --grace
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=90)
        took_s = time.monotonic() - started
    except subprocess.TimeoutExpired:
        pytest.fail("the guard did not end")
    finally:
        kill_quietly(proc)
    verdict = [line for line in stdout.splitlines() if line.startswith("VERDICT:")][-1]
    assert "INTERRUPTED" in verdict and proc.returncode == 75, stderr[-3000:]
    assert took_s < 36.0, f"the VERDICT came {took_s:.1f}s after the start, past the 36 s deadline"


@pytest.mark.parametrize("destination", ["folder", "s3"], indirect=True)
def test_a_job_that_finishes_inside_the_margin_is_a_pass_with_its_final_model_pushed(
        tmp_path: Path, destination: Destination) -> None:
    out = tmp_path / "out"
    until = time.time() + 30.0  # inside the margin: after the deadline's request at 20 s, before the deadline
    run = run_guard([*FAST, "--timeout", "40s", "--margin", "20s", "--push-to", destination.push_to, "--output-dir",
                     str(out), JOB, "--output-dir", str(out), "--plain", "--until-epoch", str(until)],
                    env=destination.env, timeout_s=120)
    fields = run.fields()
    assert (fields["status"], fields["reason"], run.returncode) == ("PASS", "ok", 0), run.stdout[-800:] + \
        run.stderr[-3000:]
    assert "model.pt" in destination.final_files(), "the final model was not pushed"
    assert "finished its training before the deadline" in run.stderr


def test_a_margin_at_or_above_the_budget_is_a_usage_error(tmp_path: Path) -> None:
    run = run_guard(["--margin", "2h", "--timeout", "1h", JOB, "--output-dir", str(tmp_path)], timeout_s=60)
    assert run.returncode == 2 and run.fields()["reason"] == "usage"
    assert "--margin 2h is not less than the budget (1h)" in run.stderr


def test_at_the_deadline_the_requested_save_wins_when_its_push_fits(tmp_path: Path) -> None:
    # issue 18: a newer complete checkpoint with time left was left for an older one. The wait for the requested
    # save kept back a reserve for pushing the older (queued) save of `push x 1.5 + 15 s`, although a push here
    # was measured at a second or two: the wait ended at 23.5 s of 38.5, the older save was secured and securing
    # ended, and the save the job answered with 28 s after the request was left. The reserve is now what the
    # measured push cost (x 1.5): the requested save is waited for and secured. Here the save comes 18 s after the
    # request, 10 s before the deadline: inside the old reserve of 15 s and more, well outside the new one.
    out, dest = tmp_path / "out", tmp_path / "dest"
    run = run_guard([*FAST, "--timeout", loaded_s(50, start_s=10), "--margin", "28s", "--push-interval", "1h",
                     "--push-to", str(dest), JOB, "--output-dir", str(out), "--answer", "--slow-answer-s", "18"],
                    timeout_s=200)
    assert run.returncode == 75, run.stderr[-3000:]
    newest = max(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    secured = torch.load(dest / "last-checkpoint" / "model.pt", weights_only=True)["step"]
    assert secured == newest, run.stderr[-3000:]
    assert f"resumes from step {newest}" in run.fields()["hint"]
