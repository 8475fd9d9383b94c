"""Exit codes a scheduler can trust (issue 36): a job's own exit code never reads as one of the guard's, a
termination signal sent to the guard by a process of the job is the job's failure (never ``INTERRUPTED`` exit 75),
and the VERDICT comes before the platform's kill even when a process of the job outlives SIGKILL (issue 33, 9).
Real processes and signals; the kernel's ``D`` state is a real one (a cgroup v1 freezer)."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import kill_quietly, run_guard, start_guard

from guard.contract import RunResult, settle_exit_code

pytestmark = pytest.mark.slow


# -- the rule, on data -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("code", [2, 3, 4, 5, 6, 7, 70, 75, 124])
def test_a_crash_with_a_code_of_the_table_exits_1_and_keeps_it_in_job_exit(code: int) -> None:
    result = settle_exit_code(RunResult("FAIL", "crash", code))
    assert (result.exit_code, result.extra["job_exit"], result.details["job_exit_code"]) == (1, code, code)


@pytest.mark.parametrize("code", [1, 8, 42, 69, 76, 125, 137])
def test_a_crash_with_any_other_code_keeps_it(code: int) -> None:
    result = settle_exit_code(RunResult("FAIL", "crash", code))
    assert result.exit_code == code and "job_exit" not in result.extra


def test_an_oom_exit_that_collides_is_moved_too_and_guard_codes_stay() -> None:
    assert settle_exit_code(RunResult("FAIL", "oom", 4)).exit_code == 1
    assert settle_exit_code(RunResult("FAIL", "non_finite_loss", 4)).exit_code == 4
    assert settle_exit_code(RunResult("FAIL", "preflight", 3)).exit_code == 3


def test_exit_75_only_with_secured_yes() -> None:
    secured = RunResult("TIMEOUT", "deadline", 75, extra={"secured": "yes"})
    assert settle_exit_code(secured).exit_code == 75
    assert settle_exit_code(RunResult("TIMEOUT", "deadline", 75, extra={"secured": "no"})).exit_code == 124
    interrupted = RunResult("INTERRUPTED", "signal", 75, extra={"signal": "SIGTERM"})
    assert settle_exit_code(interrupted).exit_code == 128 + signal.SIGTERM


# -- end to end --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("code", [75, 4, 124])
def test_a_job_exiting_with_a_guard_code_is_a_crash_exit_1(tmp_path: Path, code: int) -> None:
    job = tmp_path / "job.py"
    job.write_text(f"import sys\nprint('loss=1.0', flush=True)\nsys.exit({code})\n")
    run = run_guard(["--no-preflight", str(job)])
    fields = run.fields()
    assert run.returncode == 1, run.stdout + run.stderr
    assert (fields["status"], fields["reason"], fields["exit"], fields["job_exit"]) == ("FAIL", "crash", "1", str(code))


def test_a_sigterm_the_job_sends_to_the_guard_is_the_jobs_failure(tmp_path: Path) -> None:
    # a launcher's cleanup that signals its parent, then fails: before, INTERRUPTED exit=75 -> requeued forever
    # (a signal while the job's process is being started counts as from outside: the job waits a moment first)
    script = "echo loss=1.0; sleep 0.5; kill -TERM $PPID; sleep 1; exit 3"
    run = run_guard(["--no-preflight", "--", "sh", "-c", script])
    fields = run.fields()
    assert (fields["status"], fields["reason"], run.returncode) == ("FAIL", "crash", 1), run.stdout + run.stderr
    assert fields["job_exit"] == "3"
    assert "a process of the job itself" in run.stderr
    assert "sent SIGTERM to the guard" in fields["hint"]


def test_a_sigterm_the_job_sends_then_exits_0_is_a_pass(tmp_path: Path) -> None:
    run = run_guard(["--no-preflight", "--", "sh", "-c", "echo loss=1.0; sleep 0.5; kill -TERM $PPID; sleep 1"])
    assert run.fields()["status"] == "PASS" and run.returncode == 0, run.stdout + run.stderr


def test_a_sigterm_from_outside_still_interrupts(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    proc = start_guard(["--no-preflight", "--grace", "5s", "--", "sh", "-c",
                        f"echo loss=1.0; touch {shlex.quote(str(ready))}; sleep 60"])
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        kill_quietly(proc)
    last = out.strip().splitlines()[-1]
    assert last.startswith("VERDICT: INTERRUPTED reason=signal exit=143 "), out + err


FREEZER = Path("/sys/fs/cgroup/freezer")

FROZEN_CHILD = """\
import os, signal, subprocess, sys, time
cgroup = sys.argv[1]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
    f.write(str(child.pid))
with open(os.path.join(cgroup, "freezer.state"), "w") as f:
    f.write("FROZEN")
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("loss=1.0", flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not os.access(FREEZER, os.W_OK), reason="needs a writable cgroup v1 freezer (root)")
def test_the_verdict_comes_before_the_deadline_when_a_process_outlives_sigkill(tmp_path: Path) -> None:
    """A process of the job in ``D`` state (frozen: SIGKILL stays pending until it thaws, as on a hung mount or in
    a long CUDA teardown) delayed the VERDICT about 17 s past the platform's kill; now the VERDICT names it before
    the deadline and the guard cleans up after."""
    cgroup = FREEZER / f"jobguard-test-{uuid.uuid4().hex[:8]}"
    cgroup.mkdir()
    job = tmp_path / "job.py"
    job.write_text(FROZEN_CHILD)
    started = time.time()
    budget_s = 12
    proc = start_guard(["--no-preflight", "--timeout", f"{budget_s}s", "--started-at", f"{started:.3f}",
                        "--grace", "3s", str(job), str(cgroup)])
    try:
        assert proc.stdout is not None
        verdict = ""
        for line in proc.stdout:
            if line.startswith("VERDICT: "):
                verdict, at = line, time.time()
                break
        assert verdict, proc.stderr.read() if proc.stderr else ""
        print(f"VERDICT {at - started:.1f}s after the start, budget {budget_s}s")
        assert at < started + budget_s, (at - started, verdict)
        assert verdict.startswith("VERDICT: TIMEOUT reason=deadline exit=124 "), verdict
        fields = dict(token.split("=", 1) for token in shlex.split(verdict)[2:])
        assert ":disk-sleep:python" in fields["survivors"], verdict
        assert proc.poll() is None  # still cleaning up, after the VERDICT
        (cgroup / "freezer.state").write_text("THAWED")  # the pending SIGKILL ends the child now
        proc.wait(timeout=60)
        assert proc.returncode == 124
    finally:
        if cgroup.exists():
            (cgroup / "freezer.state").write_text("THAWED")
            kill_quietly(proc)
            for pid in filter(None, (cgroup / "cgroup.procs").read_text().split()):
                os.kill(int(pid), signal.SIGKILL)
            end = time.monotonic() + 10
            while (cgroup / "cgroup.procs").read_text().strip() and time.monotonic() < end:
                time.sleep(0.05)
            cgroup.rmdir()


if sys.platform != "linux":  # pragma: no cover
    pytestmark = [pytest.mark.slow, pytest.mark.skip("Linux signals and cgroups")]


def test_the_help_says_what_a_colliding_job_code_becomes() -> None:
    run = subprocess.run([sys.executable, "-m", "guard", "--help"], capture_output=True, text=True, timeout=60)
    assert "the job's own then in job_exit=" in run.stdout


def test_a_loss_that_never_changes_is_a_warning_on_the_pass() -> None:
    """visual_prompting #7: an optimizer over copies of the parameters; the loss never moves; it was a silent PASS."""
    from conftest import JOBS

    run = run_guard(["--no-preflight", "--loss-rise-steps", "10", str(JOBS / "frozen_weights.py")])
    fields = run.fields()
    assert (fields["status"], run.returncode) == ("PASS", 0), run.stdout + run.stderr
    assert "the weights are not being updated" in fields["warning"]
    assert "the loss stayed exactly" in run.stderr


def test_an_incomplete_run_that_resumed_at_its_last_step_is_told_so(tmp_path: Path) -> None:
    """Issue 36: a run resumed from its last step had nothing to train, exited 0 with no step, and was told to check
    its dataset."""
    from conftest import JOBS

    dest = tmp_path / "dest"
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    done = run_guard(["--no-preflight", "--push-to", str(dest), str(JOBS / "resume_at_end.py")], cwd=first)
    assert done.returncode == 0, done.stdout + done.stderr
    again = run_guard(["--no-preflight", "--resume", "on", "--push-to", str(dest), str(JOBS / "resume_at_end.py")],
                      cwd=second)
    fields = again.fields()
    assert (fields["reason"], again.returncode) == ("incomplete", 7), again.stdout + again.stderr
    assert "resumed from step 5" in again.stdout
    assert "at or past the run's last step" in fields["hint"] and "dataset" not in fields["hint"]


def test_a_crash_right_after_resuming_at_the_last_step_is_told_so(tmp_path: Path) -> None:
    """transformers' run_clm_no_trainer.py resumed from step 8400 with --num_train_epochs 10 (4,960 steps): its loop
    ran no step and the code after it crashed (UnboundLocalError: perplexity); the hint said only to fix the error
    its traceback shows."""
    from conftest import JOBS

    dest = tmp_path / "dest"
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    job = [str(JOBS / "resume_at_end.py"), "--summary"]
    done = run_guard(["--no-preflight", "--push-to", str(dest), *job], cwd=first)
    assert done.returncode == 0, done.stdout + done.stderr
    again = run_guard(["--no-preflight", "--resume", "on", "--push-to", str(dest), *job], cwd=second)
    fields = again.fields()
    assert (fields["reason"], again.returncode) == ("crash", 1), again.stdout + again.stderr
    assert "NameError" in fields["hint"]  # the job's own error stays first
    assert "crashed before training a further step" in fields["hint"], fields["hint"]
    assert "at or past the run's last step" in fields["hint"]
