"""End to end: `python -m guard` on tiny real jobs, one verdict path each."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest
from conftest import JOBS, pid_alive, run_guard, signal_when, start_guard

pytestmark = pytest.mark.slow


def assert_one_verdict(run) -> None:
    everything = run.stdout.splitlines() + run.stderr.splitlines()
    assert sum(line.startswith("VERDICT:") for line in everything) == 1, run.stdout + run.stderr
    assert run.verdict.startswith("VERDICT: ")
    assert f" exit={run.returncode} " in run.verdict + " "


def test_pass_on_a_trainer_job(tmp_path: Path) -> None:
    run = run_guard(["--sanity-steps", "3", str(JOBS / "trainer_nan.py"), "--max-steps", "8",
                     "--output-dir", str(tmp_path / "out")])
    assert_one_verdict(run)
    assert run.returncode == 0, run.stderr
    fields = run.fields()
    assert (fields["status"], fields["reason"], fields["step"]) == ("PASS", "ok", "8")
    assert "sanity pass: the first 3 losses are finite" in run.stderr


def test_nan_at_step_3_of_a_long_plain_loop_stops_in_seconds() -> None:
    started = time.monotonic()
    run = run_guard([str(JOBS / "plain_loop.py"), "--steps", "1000", "--step-s", "0.2", "--nan-at", "3"])
    took_s = time.monotonic() - started
    assert_one_verdict(run)
    fields = run.fields()
    assert (fields["status"], fields["reason"], fields["step"], fields["loss"]) == (
        "FAIL", "non_finite_loss", "3", "nan")
    assert run.returncode == 4
    assert "step 10 done" not in run.stdout
    assert took_s < 100  # the 1,000 steps would take 200 s


def test_nan_in_a_trainer_step_whose_log_hides_it(tmp_path: Path) -> None:
    run = run_guard([str(JOBS / "trainer_nan.py"), "--nan-at", "3", "--output-dir", str(tmp_path / "out")])
    assert_one_verdict(run)
    assert run.returncode == 4
    assert run.fields()["reason"] == "non_finite_loss"
    assert run.fields()["step"] == "3"
    assert "trainer finished" not in run.stdout


def test_nan_after_the_sanity_pass_is_caught_at_the_next_check() -> None:
    run = run_guard(["--sanity-steps", "2", "--check-every", "5", str(JOBS / "plain_loop.py"), "--steps", "60",
                     "--nan-at", "12", "--step-s", "0.02"])
    assert run.returncode == 4, run.stderr
    step = int(run.fields()["step"])
    assert 12 <= step <= 16


def test_exit_code_is_kept() -> None:
    run = run_guard([str(JOBS / "exits.py"), "--code", "9"])
    assert_one_verdict(run)
    assert run.returncode == 9
    assert run.fields()["reason"] == "crash" and "job_exit" not in run.fields()


def test_exception_is_a_crash_with_its_traceback() -> None:
    run = run_guard([str(JOBS / "exits.py"), "--raise"])
    assert_one_verdict(run)
    assert run.returncode == 1
    assert run.fields()["reason"] == "crash"
    assert "Traceback (most recent call last)" in run.stderr
    assert 'raise ValueError("bad batch in shard 3")' in run.stderr
    assert "last exception: ValueError: bad batch in shard 3" in run.stderr


def test_sigkill_of_itself_is_killed_137() -> None:
    run = run_guard([str(JOBS / "exits.py"), "--sigkill"])
    assert_one_verdict(run)
    assert run.returncode == 137
    assert run.fields()["reason"] in ("killed", "oom")
    assert run.fields().get("signal", "SIGKILL") == "SIGKILL"


def test_cuda_oom_message_is_oom_with_a_hint() -> None:
    run = run_guard([str(JOBS / "exits.py"), "--oom"])
    assert_one_verdict(run)
    fields = run.fields()
    assert fields["reason"] == "oom"
    assert run.returncode == 1
    assert "batch size" in fields["hint"]


def test_hang_with_a_sigterm_ignoring_grandchild_is_stalled_and_leaves_nothing(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    run = run_guard(["--stall-timeout", "3s", "--grace", "1s", str(JOBS / "hang.py"), "--pid-file", str(pid_file)])
    assert_one_verdict(run)
    assert run.returncode == 5
    assert run.fields()["reason"] == "stalled"
    grandchild = int(pid_file.read_text())
    assert not pid_alive(grandchild)
    assert "stacks of pid" in run.stderr  # the agent printed where the job waits
    assert "(rank -)" not in run.stderr  # no rank in a one-process job: none named


def test_stall_after_steps_names_the_step(tmp_path: Path) -> None:
    run = run_guard(["--stall-timeout", "2s", "--grace", "1s", str(JOBS / "hang.py"), "--pid-file",
                     str(tmp_path / "pid"), "--after-steps", "3"])
    assert run.returncode == 5
    assert run.fields()["step"] == "3"
    assert "no training step for" in run.stderr


def test_command_printing_a_nan_loss() -> None:
    run = run_guard(["--", sys.executable, "-c",
                     "print({'loss': '2.5'}); print({'loss': 'nan'}); import time; time.sleep(30)"])
    assert_one_verdict(run)
    assert run.returncode == 4
    assert run.fields()["reason"] == "non_finite_loss"
    assert run.fields()["step"] == "2"  # the second printed loss, counted from 1


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--stall-timeout", "banana", "x.py"], "--stall-timeout"),
        (["--timeout", "-5", "x.py"], "--timeout"),
        (["--sanity-steps", "-1", "x.py"], "--sanity-steps"),
        (["does_not_exist.py"], "script not found"),
        (["--", "no-such-command-xyz"], "command not found"),
    ],
)
def test_usage_errors(args: list[str], needle: str) -> None:
    run = run_guard(args)
    assert_one_verdict(run)
    assert run.returncode == 2
    assert run.fields()["reason"] == "usage"
    assert needle in run.stderr


def test_usage_error_from_the_environment() -> None:
    run = run_guard([str(JOBS / "exits.py")], env={"GUARD_GRACE": "soon"})
    assert run.returncode == 2
    assert "GUARD_GRACE" in run.stderr


def test_a_folder_is_a_usage_error_and_a_broken_script_a_preflight_failure(tmp_path: Path) -> None:
    run = run_guard([str(tmp_path)])
    assert run.returncode == 2 and "is a folder" in run.stderr
    broken = tmp_path / "broken.py"
    broken.write_text("def f(:\n    pass\n")
    run = run_guard([str(broken)])
    assert_one_verdict(run)
    assert run.returncode == 3 and "line 1" in run.stderr
    assert (run.fields()["reason"], run.fields()["check"]) == ("preflight", "script")


def test_secrets_are_masked_even_when_split_across_reads() -> None:
    secret = "s3cr3t-Value-1234567"
    run = run_guard([str(JOBS / "secrets_job.py")], env={"MY_API_TOKEN": secret})
    assert run.returncode == 0, run.stderr
    everything = run.stdout + run.stderr
    assert secret not in everything
    assert secret[:5] not in everything.replace("split: ***", "")
    assert "abcdefghijklmnop" not in everything
    assert "split: *** end" in run.stdout
    assert "hub *** end" in run.stdout
    assert "err ***" in run.stderr


def test_sigint_to_the_guard_interrupts_the_job(tmp_path: Path) -> None:
    pid_file = tmp_path / "job.pid"
    proc = start_guard([str(JOBS / "slow_loop.py"), "--pid-file", str(pid_file)])
    out, err = signal_when(proc, pid_file, signal.SIGINT, settle_s=0.5, wait_s=30)
    last = [line for line in out.splitlines() if line.strip()][-1]
    assert last.startswith("VERDICT: INTERRUPTED reason=signal exit=130"), err
    assert "signal=SIGINT" in last
    assert proc.returncode == 130
    assert not pid_alive(int(pid_file.read_text()))


def test_dry_run_stops_after_the_sanity_pass() -> None:
    run = run_guard(["--dry-run", "--sanity-steps", "3", str(JOBS / "plain_loop.py"), "--steps", "500",
                     "--step-s", "0.05"])
    assert_one_verdict(run)
    assert run.returncode == 0
    assert run.fields()["reason"] == "dry_run"
    assert "training finished" not in run.stdout


def test_no_loss_seen_is_said_plainly() -> None:
    run = run_guard([str(JOBS / "exits.py"), "--code", "0"], env={})
    assert run.returncode == 0
    run = run_guard(["--", sys.executable, "-c", "print('hello')"])
    assert run.returncode == 0
    assert "no training loss was seen" in run.stderr
    assert "guard.report" in run.stderr


def test_report_json_is_written(tmp_path: Path) -> None:
    import json

    report = tmp_path / "report.json"
    run = run_guard(["--report", str(report), str(JOBS / "plain_loop.py"), "--steps", "6", "--nan-at", "4"])
    data = json.loads(report.read_text())
    assert data["status"] == "FAIL" and data["reason"] == "non_finite_loss" and data["exit_code"] == 4
    assert data["step"] == 4 and data["loss"] == "nan"
    assert len(data["sanity"]) == 3 and data["hint"]
    assert run.returncode == 4


def test_a_silent_job_that_reports_and_exits_at_once_has_its_reports_read(tmp_path: Path) -> None:
    # the job's pipes reach their end before the loop's first turn (the early relay read them): what its agent sent
    # before it exited is still read, not dropped with the loop's end
    import json

    report = tmp_path / "report.json"
    job = "import guard\nfor step in range(1, 8):\n    guard.report(step=step, loss=1.0 / step)\n"
    run = run_guard(["--no-preflight", "--report", str(report), "--", sys.executable, "-c", job])
    assert run.returncode == 0, run.stderr[-2000:]
    details = json.loads(report.read_text())["details"]
    assert details["sanity_status"] == "passed", details
    assert run.fields()["step"] == "7"
