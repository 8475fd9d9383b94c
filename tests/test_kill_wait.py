"""After SIGKILL the guard waits a bounded time, then renders the verdict naming the survivors; a lost exit status
is unknown, never exit 0. Real processes; the kernel's ``D`` state is stood in for by dropping the SIGKILL."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from guard.contract import render_line
from guard.core.masking import Masker
from guard.run import process as process_module
from guard.run.cli import build_config
from guard.run.process import EXIT_STATUS_LOST, JobProcess
from guard.run.supervisor import Supervisor

_REAL_KILLPG = os.killpg  # the cleanup must kill for real, whatever a test dropped


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def cleanup() -> Iterator[list[int]]:
    pids: list[int] = []
    yield pids
    for pid in pids:
        try:
            _REAL_KILLPG(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


def _wait_asleep(pid: int, limit_s: float = 30.0) -> None:
    import psutil

    give_up = time.monotonic() + limit_s
    while psutil.Process(pid).status() != psutil.STATUS_SLEEPING and time.monotonic() < give_up:
        time.sleep(0.01)


@pytest.fixture
def sigkill_dropped(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """SIGKILL to a process group is lost (as for a process in uninterruptible sleep); other signals go through."""
    real_killpg = os.killpg
    dropped: list[int] = []

    def killpg(pgid: int, signum: int) -> None:
        if signum == signal.SIGKILL:
            dropped.append(pgid)
            return
        real_killpg(pgid, signum)

    monkeypatch.setattr(process_module.os, "killpg", killpg)
    return dropped


def test_after_sigkill_and_the_bounded_wait_the_survivors_are_named(cleanup: list[int],
                                                                    sigkill_dropped: list[int]) -> None:
    clock = FakeClock()
    job = JobProcess(["sleep", "60"], dict(os.environ), clock=clock)
    job.start()
    cleanup.append(job.pid)
    _wait_asleep(job.pid)  # on a busy machine a new process is "running" until it reaches its sleep
    assert job.abandon_at() == float("inf")
    job.signal_all(signal.SIGKILL)
    assert sigkill_dropped == [job.pid]
    assert job.abandon_at() == clock.now + job.kill_wait_s
    assert not job.abandoned()  # still within the wait
    clock.now += job.kill_wait_s
    assert job.abandoned()
    assert [(s.pid, s.name) for s in job.survivors_left] == [(job.pid, "sleep")]
    assert job.survivors_left[0].state == "sleeping"
    assert str(job.survivors_left[0]) == f"{job.pid}:sleeping:sleep"


def test_a_stopped_process_is_named_with_its_state(cleanup: list[int]) -> None:
    job = JobProcess(["sleep", "60"], dict(os.environ))
    job.start()
    cleanup.append(job.pid)
    os.kill(job.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not any(s.state == "stopped" for s in job.survivors()):
        time.sleep(0.02)
    assert [(s.pid, s.state) for s in job.survivors()] == [(job.pid, "stopped")]


def test_a_process_that_goes_is_not_a_survivor(cleanup: list[int]) -> None:
    clock = FakeClock()
    job = JobProcess(["sleep", "60"], dict(os.environ), clock=clock)
    job.start()
    cleanup.append(job.pid)
    job.signal_all(signal.SIGKILL)  # a real SIGKILL
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and job.poll() is None:
        time.sleep(0.02)
    clock.now += job.kill_wait_s
    assert not job.abandoned() and job.survivors_left == []
    assert job.returncode == -signal.SIGKILL


def test_a_lost_exit_status_is_unknown_not_zero(cleanup: list[int]) -> None:
    job = JobProcess(["true"], dict(os.environ))
    job.start()
    os.waitpid(job.pid, 0)  # someone else reaps the job
    assert job.poll() == EXIT_STATUS_LOST != 0
    assert job.status_lost


# ---------------------------------------------------------------------------------------------------------------
# The whole supervisor, in this process
# ---------------------------------------------------------------------------------------------------------------


def _run_supervisor(tmp_path: Path, script: str, *options: str) -> tuple[Supervisor, str]:
    path = tmp_path / "job.py"
    path.write_text(script)
    config = build_config(["--no-preflight", *options, str(path)], dict(os.environ))
    out = os.open(tmp_path / "out.log", os.O_WRONLY | os.O_CREAT)
    try:
        supervisor = Supervisor(config, masker=Masker(), out_fd=out, err_fd=out)
        result = supervisor.run()
    finally:
        os.close(out)
    return supervisor, render_line(result)


IGNORES_TERM = """\
import signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("loss=nan", flush=True)
time.sleep(120)
"""


def test_the_verdict_is_rendered_when_sigkill_does_not_end_the_job(tmp_path: Path, cleanup: list[int],
                                                                  sigkill_dropped: list[int],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(JobProcess, "kill_wait_s", 1.0)
    started = time.monotonic()
    supervisor, verdict = _run_supervisor(tmp_path, IGNORES_TERM, "--grace", "1s")
    assert supervisor.link.job is not None
    cleanup.append(supervisor.link.job.pid)
    assert time.monotonic() - started < 30  # not forever
    assert verdict.startswith("VERDICT: FAIL reason=non_finite_loss exit=4 ")
    assert f"survivors={supervisor.link.job.pid}:sleeping:python" in verdict, verdict


def test_a_lost_exit_status_makes_no_pass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_waitpid = os.waitpid
    jobs: list[int] = []

    def waitpid(pid: int, options: int) -> tuple[int, int]:
        if pid in jobs:
            real_waitpid(pid, 0)  # reaped "elsewhere"
            raise ChildProcessError(10, "No child processes")
        return real_waitpid(pid, options)

    real_start = JobProcess.start

    def start(self: JobProcess) -> None:
        real_start(self)
        jobs.append(self.pid)

    monkeypatch.setattr(JobProcess, "start", start)
    monkeypatch.setattr(process_module.os, "waitpid", waitpid)
    _, verdict = _run_supervisor(tmp_path, "print('done')\n")
    assert verdict.startswith("VERDICT: FAIL reason=guard_error exit=70 "), verdict
    assert "job_exit=unknown" in verdict


if sys.platform != "linux":  # pragma: no cover
    pytestmark = pytest.mark.skip("Linux process states")


# ---------------------------------------------------------------------------------------------------------------
# The cgroup's oom_kill counter is read for every failure
# ---------------------------------------------------------------------------------------------------------------


def test_an_oom_kill_in_the_cgroup_makes_a_crash_an_oom(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # torchrun exits 1 when the kernel's OOM killer took one of its workers: the counter rose during the run.
    from guard.run import diagnose, upkeep
    from guard.run.process import CgroupMemory

    monkeypatch.setattr(upkeep, "cgroup_memory", lambda: CgroupMemory(None, 1 << 30, oom_kills=2))  # at start
    monkeypatch.setattr(diagnose, "cgroup_memory", lambda: CgroupMemory(None, 1 << 30, oom_kills=3))  # at the end
    _, verdict = _run_supervisor(tmp_path, "import sys\nsys.exit(1)\n")
    assert verdict.startswith("VERDICT: FAIL reason=oom exit=1 "), verdict
    assert "OOM killer ran in the job" in verdict


def test_a_crash_without_an_oom_kill_stays_a_crash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from guard.run import diagnose

    monkeypatch.setattr(diagnose, "cgroup_memory", lambda: None)
    _, verdict = _run_supervisor(tmp_path, "import sys\nsys.exit(1)\n")
    assert verdict.startswith("VERDICT: FAIL reason=crash exit=1 "), verdict
