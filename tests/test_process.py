"""Tests for ``guard.run.process``: cgroup memory facts on a fake tree, and ``JobProcess`` on real processes."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from guard.core.children import GuardChildren
from guard.run.process import CgroupMemory, JobProcess, cgroup_memory, default_signals, set_subreaper

V1_UNLIMITED = "9223372036854771712"  # what cgroup v1 writes for "no limit" (LONG_MAX rounded to a page)


# ---------------------------------------------------------------------------------------------------------------
# cgroup_memory on a fake tree
# ---------------------------------------------------------------------------------------------------------------


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_cgroup_v2_limit_usage_and_oom_kills(tmp_path: Path) -> None:
    write(tmp_path, {
        "memory.max": "1073741824\n",
        "memory.current": "52428800\n",
        "memory.events": "low 0\nhigh 0\nmax 12\noom 3\noom_kill 2\noom_group_kill 0\n",
    })
    assert cgroup_memory(tmp_path) == CgroupMemory(limit_bytes=1073741824, current_bytes=52428800, oom_kills=2)


def test_cgroup_v2_without_a_limit(tmp_path: Path) -> None:
    write(tmp_path, {"memory.max": "max\n", "memory.current": "4096\n", "memory.events": "oom_kill 0\n"})
    assert cgroup_memory(tmp_path) == CgroupMemory(None, 4096, 0)


def test_cgroup_v2_with_missing_or_broken_files(tmp_path: Path) -> None:
    write(tmp_path, {"memory.current": "garbage\n", "memory.events": "oom_kill many\n"})
    assert cgroup_memory(tmp_path) == CgroupMemory(None, None, 0)


def test_cgroup_v1(tmp_path: Path) -> None:
    write(tmp_path, {
        "memory/memory.limit_in_bytes": "2147483648\n",
        "memory/memory.usage_in_bytes": "1048576\n",
        "memory/memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 4\n",
    })
    assert cgroup_memory(tmp_path) == CgroupMemory(2147483648, 1048576, 4)


def test_cgroup_v1_unlimited(tmp_path: Path) -> None:
    write(tmp_path, {"memory/memory.limit_in_bytes": V1_UNLIMITED, "memory/memory.usage_in_bytes": "10"})
    assert cgroup_memory(tmp_path) == CgroupMemory(None, 10, 0)


def test_no_cgroup_files(tmp_path: Path) -> None:
    assert cgroup_memory(tmp_path) is None


def test_the_real_cgroup_is_read_without_error() -> None:
    memory = cgroup_memory()
    assert memory is None or (memory.oom_kills >= 0 and (memory.current_bytes is None or memory.current_bytes > 0))


def _v1_memory_path() -> str:
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return ""
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return path.strip("/")
    return ""


@pytest.mark.skipif(not _v1_memory_path(), reason="this process is not in a cgroup v1 memory sub-group")
def test_cgroup_v1_reads_the_process_own_group(tmp_path: Path) -> None:
    own = f"memory/{_v1_memory_path()}"
    write(tmp_path, {
        "memory/memory.limit_in_bytes": V1_UNLIMITED,
        "memory/memory.usage_in_bytes": "999999999",
        "memory/memory.oom_control": "oom_kill 0\n",
        f"{own}/memory.limit_in_bytes": "2147483648",
        f"{own}/memory.usage_in_bytes": "1048576",
        f"{own}/memory.oom_control": "oom_kill 1\n",
    })
    assert cgroup_memory(tmp_path) == CgroupMemory(2147483648, 1048576, 1)


# ---------------------------------------------------------------------------------------------------------------
# JobProcess
# ---------------------------------------------------------------------------------------------------------------


def wait_for(condition: Callable[[], bool], what: str, limit_s: float = 30.0) -> None:
    """Poll until ``condition()``; a hang guard (the bound is generous), not a timing assertion."""
    end = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"still waiting for: {what}")
        time.sleep(0.02)


def pid_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def read_all(job: JobProcess) -> tuple[bytes, bytes]:
    out, err = b"", b""
    open_fds = {job.stdout_fd, job.stderr_fd}
    end = time.monotonic() + 30
    while open_fds and time.monotonic() < end:
        for fd in list(open_fds):
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                continue
            if not data:
                open_fds.discard(fd)
            elif fd == job.stdout_fd:
                out += data
            else:
                err += data
        time.sleep(0.005)
    return out, err


def finish(job: JobProcess) -> int:
    wait_for(lambda: job.poll() is not None, "the job's exit")
    assert job.returncode is not None
    return job.returncode


def test_runs_a_job_with_pipes_and_its_exit_code() -> None:
    code = "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"
    job = JobProcess([sys.executable, "-c", code], {**os.environ, "PYTHONUNBUFFERED": "1"})
    job.start()
    assert job.pid > 0 and job.pid in job.known_pids
    assert not os.get_blocking(job.stdout_fd) and not os.get_blocking(job.stderr_fd)
    assert os.getpgid(job.pid) == job.pid  # its own session and process group
    assert read_all(job) == (b"out\n", b"err\n")
    assert finish(job) == 3
    assert not job.alive()


def test_a_death_by_signal_is_a_negative_returncode() -> None:
    job = JobProcess([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], os.environ)
    job.start()
    read_all(job)
    assert finish(job) == -signal.SIGKILL


def test_the_spawner_is_injected_and_its_errors_pass() -> None:
    calls: list[dict] = []

    def refusing(argv: list[str], **kwargs: object) -> None:
        calls.append({"argv": argv, **kwargs})
        raise FileNotFoundError(2, "No such file or directory")

    job = JobProcess(["no-such-job"], {"A": "1"}, spawner=refusing)
    with pytest.raises(FileNotFoundError):
        job.start()
    assert calls[0]["argv"] == ["no-such-job"]
    assert calls[0]["env"] == {"A": "1"}
    assert calls[0]["start_new_session"] is True
    assert calls[0]["stdout"] is subprocess.PIPE and calls[0]["stderr"] is subprocess.PIPE


def test_default_signals() -> None:
    assert set(default_signals()) == {signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP}


PR_GET_CHILD_SUBREAPER = 37  # <linux/prctl.h>
PR_SET_CHILD_SUBREAPER = 36


@pytest.fixture
def subreaper() -> Iterator[None]:
    """This test process is a child subreaper (as the guard is) for the test, then back to what it was."""
    libc = ctypes.CDLL(None, use_errno=True)
    before = ctypes.c_int(0)
    if libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(before), 0, 0, 0) != 0:
        pytest.skip("prctl(PR_GET_CHILD_SUBREAPER) is not available")
    assert set_subreaper() is True
    try:
        yield
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, before.value, 0, 0, 0)


GRANDCHILD = (
    "import os, signal, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "if sys.argv[2] == 'setsid':\n"
    "    os.setsid()\n"
    "tmp = sys.argv[1] + '.tmp'\n"
    "open(tmp, 'w').write(str(os.getpid()))\n"
    "os.rename(tmp, sys.argv[1])\n"
    "time.sleep(600)\n"
)
JOB = (
    "import subprocess, sys, time\n"
    "subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2], sys.argv[3]])\n"
    "print('started', flush=True)\n"
    "time.sleep(600)\n"
)


@pytest.mark.parametrize("mode", ["same_group", "setsid"])
def test_signal_all_then_sigkill_ends_a_sigterm_ignoring_grandchild(subreaper: None, tmp_path: Path,
                                                                    mode: str) -> None:
    pid_file = tmp_path / "grandchild.pid"
    job = JobProcess([sys.executable, "-c", JOB, GRANDCHILD, str(pid_file), mode], os.environ)
    job.start()
    grandchild = -1
    try:
        wait_for(pid_file.exists, "the grandchild's pid file")
        grandchild = int(pid_file.read_text())
        assert job.sample() > 0  # the tree's memory; the grandchild is now known
        assert grandchild in job.known_pids
        if mode == "setsid":
            assert os.getpgid(grandchild) != job.pid  # out of the job's process group

        job.signal_all(signal.SIGTERM)
        assert finish(job) == -signal.SIGTERM  # the job itself obeys
        time.sleep(0.2)  # let a (wrongly) delivered SIGTERM act; the grandchild must still be there
        assert pid_running(grandchild), "the grandchild should ignore SIGTERM"
        assert job.alive()  # the tree is not finished while the grandchild runs
        assert any(p.pid == grandchild for p in job.descendants())

        job.signal_all(signal.SIGKILL)
        wait_for(lambda: not job.alive(), "the grandchild's end")
        assert not pid_running(grandchild)
        job.poll()
        job.reap_orphans()  # the orphan's zombie is this process's (its subreaper), and a known pid: reaped
        wait_for(lambda: not Path(f"/proc/{grandchild}").exists(), "the grandchild reaped")
    finally:
        for pid in (job.pid, grandchild):
            if pid > 0 and pid_running(pid):
                os.kill(pid, signal.SIGKILL)
        for pid in (job.pid, grandchild):
            try:
                os.waitpid(pid, os.WNOHANG)
            except (ChildProcessError, OSError):
                pass


# ---------------------------------------------------------------------------------------------------------------
# GuardChildren: every child of the guard has an owner
# ---------------------------------------------------------------------------------------------------------------


def this_workers_children() -> GuardChildren:
    """A registry of its own for a test, holding this test process's own children (``CHILDREN``: the session's S3
    server, tests/s3server.py): the job's tree is every child of the guard that has no other owner, and this process
    is the guard here. A registry without them took the S3 server for the job's, and the test's SIGKILL to the job
    ended it for every later test of the worker ('Could not connect to the endpoint URL')."""
    from guard.core.children import CHILDREN, GuardChildren

    children = GuardChildren()
    for pid in CHILDREN.not_jobs():
        children.add(pid, CHILDREN.owner(pid) or "")
    return children


@pytest.fixture
def bystander() -> Iterator[subprocess.Popen[bytes]]:
    """A child of this test process that is not the job's, registered as the S3 server is (``CHILDREN``)."""
    from guard.core.children import CHILDREN, HELPER

    proc = subprocess.Popen(["sleep", "600"], start_new_session=True)
    CHILDREN.add(proc.pid, HELPER)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()
        CHILDREN.discard(proc.pid)


def test_the_orphan_reaper_never_steals_a_helpers_exit_status() -> None:
    # A helper subprocess (a securing worker, py-spy) exits with 7 while the loop reaps orphans twice: its owner
    # still reads 7 (a stolen status reads as 0 in subprocess, "ECHILD: assume it exited 0").
    from guard.core.children import HELPER

    children = this_workers_children()
    job = JobProcess([sys.executable, "-c", "import time; time.sleep(600)"], os.environ, children=children)
    job.start()
    # what earlier tests in this worker process left unreaped is an orphan here too: reaped before the helper starts
    job.reap_orphans()
    job.reap_orphans()
    reaped_before = job.reaped
    helper = subprocess.Popen([sys.executable, "-c", "raise SystemExit(7)"])
    children.add(helper.pid, HELPER)
    try:
        wait_for(lambda: Path(f"/proc/{helper.pid}/stat").read_text().split(")")[-1].split()[0] == "Z",
                 "the helper's zombie")
        job.reap_orphans()
        job.reap_orphans()  # seen twice as a zombie: an unowned one would be reaped now
        assert job.reaped == reaped_before
        assert all(p.pid != helper.pid for p in job.descendants())  # never the job's
        assert helper.wait(timeout=10) == 7
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        finish(job)
    assert children.owner(job.pid) is None  # the job's entry went with its reap


def test_a_reaped_helpers_pid_is_the_jobs_again(tmp_path: Path, bystander: subprocess.Popen[bytes]) -> None:
    # HELPER_PIDS only grew: once the kernel reused a finished worker's pid for a process of the job, that process
    # was invisible (never signalled, never waited for). An owner's entry goes with its reap. The test process's
    # own other children (``bystander``, as the S3 server) are never the job's, and outlive its SIGKILL.
    from guard.core.children import WORKER

    children = this_workers_children()
    owned = children.not_jobs()
    # the grandchild renames its pid file into place: given /dev/null (as this test once did), it replaced the
    # machine's /dev/null with a regular file, as root
    job = JobProcess([sys.executable, "-c", JOB, GRANDCHILD, str(tmp_path / "grandchild.pid"), "same_group"],
                     os.environ, children=children)
    job.start()
    try:
        wait_for(lambda: any(p.pid != job.pid for p in job.descendants()), "the job's child")
        child = next(p.pid for p in job.descendants() if p.pid != job.pid)
        assert child != bystander.pid
        children.add(child, WORKER)  # as if a worker had had this pid
        assert all(p.pid != child for p in job.descendants())
        children.discard(child)  # the worker was reaped: the pid is free for anyone
        assert any(p.pid == child for p in job.descendants())
        assert children.not_jobs() == owned
    finally:
        job.signal_all(signal.SIGKILL)
        finish(job)
    assert bystander.poll() is None, "the job's SIGKILL reached a child of the guard that is not the job's"


def test_children_run_registers_the_child_while_it_runs(tmp_path: Path) -> None:
    from guard.core.children import HELPER, GuardChildren

    children = GuardChildren()
    seen: list[str | None] = []
    marker = tmp_path / "pid"
    code = (f"import os, time; open({str(marker)!r} + '.tmp', 'w').write(str(os.getpid())); "
            f"os.rename({str(marker)!r} + '.tmp', {str(marker)!r}); time.sleep(0.5)")
    import threading

    def watch() -> None:
        wait_for(marker.exists, "the helper's pid")
        time.sleep(0.05)
        seen.append(children.owner(int(marker.read_text() or 0)))

    watcher = threading.Thread(target=watch)
    watcher.start()
    done = children.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    watcher.join(timeout=30)
    assert done.returncode == 0
    assert seen == [HELPER]
    assert children.pids() == frozenset()
