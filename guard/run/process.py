"""Starting the job and making sure nothing it started outlives the guard.

The job runs in a new session (so in its own process group, and without the terminal's SIGINT). The guard
marks itself a *child subreaper* (Linux ``prctl(PR_SET_CHILD_SUBREAPER)``), so processes the job leaves behind,
even ones that called ``setsid()``, are re-parented to the guard instead of PID 1: ``psutil`` then finds them
as the guard's descendants, and they can be reaped and killed. As PID 1 of a container the guard is the
reaper anyway.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from guard.core.cgroup import CgroupMemory, cgroup_memory
from guard.core.children import CHILDREN, JOB, GuardChildren

__all__ = ["AFTER_VERDICT", "EXIT_STATUS_LOST", "KILL_SETTLE_S", "KILL_WAIT_S", "AfterVerdict", "CgroupMemory",
           "JobProcess", "Survivor", "cgroup_memory", "set_subreaper"]

log = logging.getLogger("guard.process")

if TYPE_CHECKING:
    import psutil
else:
    class _Psutil:
        """``psutil``, imported at its first use (the first sample, after the job started): its 30-70 ms of imports
        are off the job's start."""

        def __getattr__(self, name: str) -> Any:
            import psutil as module

            globals()["psutil"] = module
            return getattr(module, name)

    psutil = _Psutil()

PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>

Spawner = Callable[..., Any]

#: After SIGKILL, how long the guard waits for the job's processes to go before it renders the verdict anyway
#: (seconds): a process in uninterruptible sleep (``D``, e.g. after a GPU Xid error or an NFS hang) ignores it.
KILL_WAIT_S = 10.0
#: The shortest wait after SIGKILL, also when the platform's kill is nearer: the kernel needs a moment to end a process
#: (seconds).
KILL_SETTLE_S = 0.2
#: ``JobProcess.returncode`` when the job's exit status was lost (``waitpid`` found no such child: something else
#: reaped it): positive, so it never reads as a success (0) nor as a death by signal (negative).
EXIT_STATUS_LOST = 70


@dataclass(frozen=True)
class Survivor:
    """A process of the job that outlived SIGKILL: ``pid``, ``name`` and ``state`` (psutil's status, e.g.
    ``disk-sleep`` for the kernel's ``D``, ``stopped`` for ``T``)."""

    pid: int
    name: str
    state: str

    def __str__(self) -> str:
        return f"{self.pid}:{self.state}:{self.name}"


def set_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux only). Returns True on success."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


class JobProcess:
    """The job: a child in its own session, with its stdout and stderr on pipes.

    Args:
        argv: the command.
        env: the job's environment (complete).
        spawner: ``subprocess.Popen`` or a stand-in with the same signature (tests inject faults here).
        clock: monotonic seconds (``time.monotonic``), for the wait after SIGKILL.
        children: the registry of the guard's children (default ``CHILDREN``): the job is recorded there as
            ``JOB``; every other owner's processes (securing workers, helper subprocesses) and what they started are
            never the job's.

    Attributes:
        returncode: the job's exit code once it exited (negative: died of that signal); ``EXIT_STATUS_LOST`` with
            ``status_lost`` True when its exit status could not be read.
        survivors_left: the processes still there when the guard stopped waiting after SIGKILL (``abandoned``).
    """

    kill_wait_s = KILL_WAIT_S

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], *, spawner: Spawner = subprocess.Popen,
                 clock: Callable[[], float] = time.monotonic, children: GuardChildren = CHILDREN) -> None:
        self.clock = clock
        self.children = children
        self.killed_at: float | None = None
        self.abandon_by = float("inf")  # the latest time to stop waiting after SIGKILL (the platform's kill, less)
        self.status_lost = False
        self.survivors_left: list[Survivor] = []
        self.argv = list(argv)
        self.env = dict(env)
        self.spawner = spawner
        self.proc: Any = None
        self.pid = -1
        self.returncode: int | None = None
        self.known_pids: set[int] = set()
        self.peak_rss_bytes = 0
        self.last_rss_bytes = 0
        self.peak_rss_by_pid: dict[int, int] = {}  # each process's highest sampled RSS (a killed worker's size)
        self.reaped = 0
        self._zombies_seen: set[int] = set()

    def start(self) -> None:
        """Start the job.

        Raises:
            OSError: the command cannot be executed (not found, not executable).
        """
        self.proc = self.spawner(
            self.argv, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
            bufsize=0, close_fds=True,
        )
        self.pid = self.proc.pid
        self.children.add(self.pid, JOB)
        self.known_pids.add(self.pid)
        for stream in (self.proc.stdout, self.proc.stderr):
            os.set_blocking(stream.fileno(), False)

    @property
    def stdout_fd(self) -> int:
        return int(self.proc.stdout.fileno())

    @property
    def stderr_fd(self) -> int:
        return int(self.proc.stderr.fileno())

    def poll(self) -> int | None:
        """Reap the job without blocking; the job's ``returncode`` once it exited (negative: died of a signal,
        as in ``subprocess``). Cheap: one ``waitpid`` call."""
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else: the status is unknown, never "exited 0"
                log.warning("the job's exit status is lost (pid %d was reaped elsewhere)", self.pid)
                self.status_lost = True
                self.returncode = self.proc.returncode = EXIT_STATUS_LOST
                self.children.discard(self.pid)
                return self.returncode
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
                self.proc.returncode = self.returncode
                self.children.discard(self.pid)
        return self.returncode

    @property
    def zombies_pending(self) -> bool:
        """Zombies were seen at the last ``reap_orphans`` and wait for the next one."""
        return bool(self._zombies_seen)

    @staticmethod
    def _no_children() -> bool:
        """The guard has no child at all, live or zombie (``waitid(P_ALL, WNOHANG | WNOWAIT)`` fails with
        ``ECHILD``; it reaps nothing). Then nothing of the job's tree is left to find: every process of it is a child
        of the guard or under one (the guard is their subreaper), so the ``/proc`` scans of ``psutil`` (one read of
        every process's ``stat`` on the machine, and psutil's import on the first) are skipped."""
        try:
            os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return True
        except OSError:
            return False
        return False

    def reap_orphans(self, *, final: bool = False) -> int:
        """Reap zombies re-parented to the guard (it is a subreaper, or PID 1). Returns how many were reaped.

        A child that another owner registered (``GuardChildren``: a securing worker, a helper's ``py-spy``) is
        never reaped here: its owner collects its exit status. Another zombie is reaped only when it was already a
        zombie at the previous call (a child that a thread of the guard waits for without registering it is gone by
        then). ``final=True`` (at the guard's exit, when no thread of the guard runs a subprocess) reaps every zombie.
        """
        if self._no_children():
            self._zombies_seen = set()
            return 0
        try:
            children = psutil.Process().children()
        except psutil.Error:
            return 0
        zombies_now: set[int] = set()
        reaped = 0
        owned = self.children.not_jobs()
        for child in children:
            if child.pid == self.pid or (child.pid in owned and not final):
                continue  # a helper's exit status is its owner's to collect (subprocess.Popen.poll)
            try:
                if child.status() != psutil.STATUS_ZOMBIE:
                    continue
            except psutil.Error:
                continue
            zombies_now.add(child.pid)
            if final or child.pid in self._zombies_seen or child.pid in self.known_pids:
                try:
                    if os.waitpid(child.pid, os.WNOHANG)[0] == child.pid:
                        reaped += 1
                        zombies_now.discard(child.pid)
                except (ChildProcessError, OSError):
                    pass
        self._zombies_seen = zombies_now
        self.reaped += reaped
        return reaped

    def descendants(self) -> list[psutil.Process]:
        """Every live process of the job's tree: under the job, or re-parented to the guard (subreaper); never the
        guard's own processes (``GuardChildren.not_jobs``: the securing workers, helper subprocesses) or what they
        started."""
        found: dict[int, psutil.Process] = {}
        if self._no_children():
            return []
        owned = self.children.not_jobs()
        try:
            for proc in psutil.Process().children(recursive=True):
                if proc.pid in owned or (owned and self._under(proc, owned)):
                    continue
                if proc.pid in self.known_pids or self._in_job_tree(proc):
                    found[proc.pid] = proc
        except psutil.Error:
            pass
        return list(found.values())

    @staticmethod
    def _under(proc: psutil.Process, owned: frozenset[int]) -> bool:
        try:
            return any(p.pid in owned for p in proc.parents())
        except psutil.Error:
            return False

    def _in_job_tree(self, proc: psutil.Process) -> bool:
        try:
            parents = proc.parents()
        except psutil.Error:
            return False
        return any(p.pid in self.known_pids for p in parents) or proc.ppid() == os.getpid()

    def sample(self) -> int:
        """Record the job tree's pids and resident memory; returns the tree's RSS in bytes."""
        total = 0
        for proc in self.descendants():
            self.known_pids.add(proc.pid)
            try:
                rss = proc.memory_info().rss
            except psutil.Error:
                continue
            total += rss
            if rss > self.peak_rss_by_pid.get(proc.pid, 0) and (proc.pid in self.peak_rss_by_pid
                                                                  or len(self.peak_rss_by_pid) < 4096):
                self.peak_rss_by_pid[proc.pid] = rss
        self.last_rss_bytes = total
        self.peak_rss_bytes = max(self.peak_rss_bytes, total)
        return total

    def signal_all(self, signum: int) -> None:
        """Send ``signum`` to the job's process group and to every process of its tree outside that group."""
        if signum == signal.SIGKILL and self.killed_at is None:
            self.killed_at = self.clock()
        tree = self.descendants()
        for proc in tree:
            self.known_pids.add(proc.pid)
        if self.returncode is None or tree:
            try:
                os.killpg(self.pid, signum)
            except (ProcessLookupError, PermissionError):
                pass
        for proc in tree:
            try:
                if os.getpgid(proc.pid) != self.pid:
                    proc.send_signal(signum)
            except (psutil.Error, ProcessLookupError, PermissionError, OSError):
                pass

    def alive(self) -> bool:
        """The job or any process of its tree is still running (zombies do not count)."""
        if self.returncode is None:
            return True
        for proc in self.descendants():
            try:
                if proc.status() != psutil.STATUS_ZOMBIE:
                    return True
            except psutil.Error:
                pass
        return False


    def abandon_at(self) -> float:
        """When the guard stops waiting for the job's processes after SIGKILL (``math.inf`` before SIGKILL):
        ``kill_wait_s`` after it, or ``abandon_by`` when that is sooner (the VERDICT is due before the platform's
        kill), but never less than ``KILL_SETTLE_S`` after it."""
        if self.killed_at is None:
            return float("inf")
        return min(self.killed_at + self.kill_wait_s, max(self.abandon_by, self.killed_at + KILL_SETTLE_S))

    def abandoned(self) -> bool:
        """True when SIGKILL was sent ``kill_wait_s`` ago and processes are still there; records them in
        ``survivors_left`` (logged once) so that the verdict can name them. The guard then goes on without them."""
        if self.clock() < self.abandon_at() or not self.alive():
            return False
        if not self.survivors_left:
            self.survivors_left = self.survivors()
            log.error("%d process(es) of the job outlived SIGKILL by %.1fs: %s; going on without them (a process "
                      "in state disk-sleep (D) waits in the kernel: a GPU Xid error or a hung network filesystem)",
                      len(self.survivors_left), self.clock() - (self.killed_at or 0.0),
                      ", ".join(map(str, self.survivors_left)))
        return True

    def survivors(self) -> list[Survivor]:
        """The job's processes that are still running (zombies do not count), with their states."""
        found: list[Survivor] = []
        procs = self.descendants()
        if self.returncode is None and all(p.pid != self.pid for p in procs):
            try:
                procs.insert(0, psutil.Process(self.pid))
            except psutil.Error:
                pass
        for proc in procs:
            try:
                state, name = proc.status(), proc.name()
            except psutil.Error:
                continue
            if state != psutil.STATUS_ZOMBIE:
                found.append(Survivor(proc.pid, name, state))
        return found


def default_signals() -> tuple[signal.Signals, ...]:
    """The termination signals the guard handles: SIGTERM, SIGINT, SIGUSR1, SIGUSR2, SIGHUP."""
    return (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)


class AfterVerdict:
    """Cleanups that wait until the VERDICT is out: the bounded wait for the job's leftover processes (a process in
    ``D`` state may take long to go) must never delay the VERDICT past the platform's kill (contract: "never later
    than the deadline").

    ``guard.run.cli.main`` calls ``defer()`` before the run and ``run()`` after the VERDICT; without ``defer()`` (a
    caller that drives the supervisor itself) a cleanup runs at once.
    """

    def __init__(self) -> None:
        self.deferring = False
        self._calls: list[Callable[[], None]] = []

    def defer(self) -> None:
        """From now on, ``call`` keeps its cleanups for ``run``."""
        self.deferring = True

    def call(self, cleanup: Callable[[], None]) -> None:
        """Run ``cleanup`` now, or after the VERDICT when deferring."""
        if self.deferring:
            self._calls.append(cleanup)
        else:
            cleanup()

    def run(self) -> None:
        """Run the kept cleanups, oldest first (one that raises is logged; the others still run); stop deferring."""
        calls, self._calls = self._calls, []
        self.deferring = False
        for cleanup in calls:
            try:
                cleanup()
            except Exception:  # after the VERDICT: logged, never a second verdict
                log.exception("cleanup after the VERDICT failed")


#: The process's one ``AfterVerdict``.
AFTER_VERDICT = AfterVerdict()
