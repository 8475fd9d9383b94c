"""The guard process's own children, each with its owner: who may signal it, and who collects its exit status.

The guard starts the job (owner ``JOB``) and processes of its own: securing workers (``WORKER``), and helper
subprocesses run on the helper thread (``HELPER``: ``scontrol``, ``py-spy``). The job's process tree
(``guard.run.process.JobProcess``) is every descendant of the guard that is not under a child with another owner,
and the orphan reaper reaps only zombies that no owner waits for, so it never steals the exit status that
``subprocess.Popen.poll`` of a helper's owner is about to read. An entry is dropped once its owner reaped the child
(``discard``): a pid the kernel reuses later for one of the job's processes is the job's again.

Thread-safe: the helper thread registers its subprocesses while the loop reads the registry.
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Sequence
from typing import Any

__all__ = ["CHILDREN", "HELPER", "JOB", "WORKER", "GuardChildren"]

JOB = "job"
WORKER = "securing worker"
HELPER = "helper"


class GuardChildren:
    """A registry of the guard's direct children: pid -> owner (``JOB``, ``WORKER``, ``HELPER`` or another name)."""

    def __init__(self) -> None:
        self._owners: dict[int, str] = {}
        self._lock = threading.Lock()

    def add(self, pid: int, owner: str) -> None:
        """Record ``pid`` as started by ``owner`` (it replaces what a reused pid had)."""
        with self._lock:
            self._owners[pid] = owner

    def discard(self, pid: int) -> None:
        """Forget ``pid``: its owner reaped it (no error when it is not there)."""
        with self._lock:
            self._owners.pop(pid, None)

    def owner(self, pid: int) -> str | None:
        """Who started ``pid``, or None (not the guard's child, or reaped already)."""
        with self._lock:
            return self._owners.get(pid)

    def pids(self, owner: str | None = None) -> frozenset[int]:
        """The registered pids (of ``owner`` only, when given)."""
        with self._lock:
            return frozenset(pid for pid, who in self._owners.items() if owner is None or who == owner)

    def not_jobs(self) -> frozenset[int]:
        """The pids of the guard's own processes (every owner but ``JOB``): never the job's, never signalled with
        it, never reaped by the orphan reaper."""
        with self._lock:
            return frozenset(pid for pid, who in self._owners.items() if who != JOB)

    def run(self, argv: Sequence[str], *, owner: str = HELPER, timeout: float | None = None,
            capture_output: bool = False, check: bool = False, **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """``subprocess.run`` whose child is registered under ``owner`` while it runs (for the helper thread).

        Raises:
            subprocess.TimeoutExpired: as ``subprocess.run`` (the child is killed and reaped first).
            subprocess.CalledProcessError: ``check`` and a non-zero exit, as ``subprocess.run``.
            OSError: the command cannot be started.
        """
        if capture_output:
            kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        with subprocess.Popen(argv, **kwargs) as proc:
            self.add(proc.pid, owner)
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                raise
            finally:
                proc.poll()
                self.discard(proc.pid)
        done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        if check:
            done.check_returncode()
        return done


#: The guard process's registry.
CHILDREN = GuardChildren()
