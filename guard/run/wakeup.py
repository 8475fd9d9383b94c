"""What wakes the loop besides its pipes and socket: signals (through ``signal.set_wakeup_fd``) and the helper thread.

The handlers only record: a signal number appended to ``signals`` (the loop pops and handles them), ``SIGCHLD`` a
flag (orphans may need reaping). Each writes a byte to a non-blocking self-pipe, which the loop's ``select``
watches, as does a finished helper call (``guard.core.helpers.HELPERS.notify``). Outside the main thread no handler
can be installed: ``signals`` is then filled by whoever runs the loop (the tests).

Who sent a termination signal: a Python handler is not told (``signal.signal`` hides the ``siginfo_t``), so the
termination signals are blocked in the main thread (``signal.pthread_sigmask``; threads started from it later
inherit the mask) and a thread of their own takes them with ``signal.sigtimedwait``, whose ``si_pid`` names the
sender (POSIX ``sigwaitinfo``; Linux ``signal(7)``). One sent by a process of the job's own session (a launcher's
cleanup that signals its parent, ``kill $PPID``) goes to ``from_job``, not ``signals``: it is the job's doing, not
a stop from outside, and never ``INTERRUPTED`` (contract, the table's last row). A signal the kernel hands to a
thread started before the mask, or one that arrives while the job's process is being started (the mask is lifted
for that moment, so that the job does not inherit it: ``fork`` and ``execve`` keep a mask), reaches the handler
instead, sender unknown: it counts as from outside. Processes the guard starts during the loop (securing's workers,
``py-spy``) inherit the mask; they are ended with SIGKILL.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

from guard.core.helpers import HELPERS, Wakeup
from guard.run.process import default_signals

__all__ = ["JobSignal", "LoopSignals"]

log = logging.getLogger("guard.supervisor")

_NOT_INSTALLED = -2  # set_wakeup_fd refused (not the main thread): nothing to restore
#: How often the sender thread looks whether it should end (seconds): ``close`` does not wait for it.
_WAIT_SLICE_S = 0.2


@dataclass(frozen=True)
class JobSignal:
    """A termination signal the guard received from a process of the job: ``signum``, the sender's ``pid`` and its
    command ``name`` (empty when it could not be read)."""

    signum: int
    pid: int
    name: str


class LoopSignals:
    """The loop's signal handlers and self-pipe.

    Attributes:
        signals: signal numbers received and not handled yet, oldest first (the loop pops them).
        child_exited: ``SIGCHLD`` seen since the loop last reaped (it clears the flag).
        read_fd: the self-pipe's read end, for the loop's selector (-1 before ``install``).
    """

    def __init__(self) -> None:
        self.signals: list[int] = []
        self.from_job: list[JobSignal] = []
        self.job_pid = -1  # the job's process (and session) id once started: its senders are the job's
        self.child_exited = False
        self.read_fd = self._write_fd = -1
        self._notify: Wakeup | None = None
        self._old_handlers: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}
        self._old_wakeup = -1
        self._masked: tuple[int, ...] = ()
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the sender thread's write vs. close() closing the pipe (a reused fd)

    def install(self) -> None:
        """Open the self-pipe; in the main thread, install the handlers (the guard's termination signals and
        ``SIGCHLD``) and make a finished helper call wake the loop. ``close`` undoes it."""
        self.read_fd, self._write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self._write_fd, False)
        # a helper call finished (securing's file system calls included, guard.core.helpers.wake_loop): the loop
        # turns at once, on any thread
        self._notify = Wakeup(self._write_fd)
        HELPERS.notify = self._notify
        try:
            self._old_wakeup = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        except ValueError:  # not the main thread: no signal handling (documented)
            self._old_wakeup = _NOT_INSTALLED
            return
        for signum in (*default_signals(), signal.SIGCHLD):
            self._old_handlers[signum] = signal.signal(signum, self._on_signal)
        self._masked = tuple(int(s) for s in default_signals())
        signal.pthread_sigmask(signal.SIG_BLOCK, self._masked)
        self._stop.clear()
        threading.Thread(target=self._wait_senders, name="guard-signals", daemon=True).start()

    @contextlib.contextmanager
    def unmasked(self) -> Iterator[None]:
        """The termination signals unblocked in this thread for the block's duration: a process started inside it
        (the job) does not inherit the guard's mask (``fork`` and ``execve`` keep it). A signal arriving meanwhile
        reaches the handler (sender unknown: from outside)."""
        if not self._masked:
            yield
            return
        signal.pthread_sigmask(signal.SIG_UNBLOCK, self._masked)
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_BLOCK, self._masked)

    def _wait_senders(self) -> None:
        """The sender thread: takes each blocked termination signal with its ``si_pid``, files it under ``signals``
        or ``from_job`` and wakes the loop. Ends once ``close`` set the stop flag (within ``_WAIT_SLICE_S``)."""
        wanted = set(self._masked)
        while not self._stop.is_set():
            try:
                info = signal.sigtimedwait(wanted, _WAIT_SLICE_S)
            except OSError:  # pragma: no cover - EINTR is retried by Python (PEP 475)
                continue
            if info is None:
                continue
            if self._stop.is_set():  # taken after close: hand it to the restored handler (the main thread)
                os.kill(os.getpid(), info.si_signo)
                return
            sender = self._job_sender(info.si_pid)
            if sender is not None:
                self.from_job.append(JobSignal(info.si_signo, info.si_pid, sender))
            else:
                self.signals.append(info.si_signo)
            with self._lock, contextlib.suppress(OSError):
                if not self._stop.is_set():
                    os.write(self._write_fd, b"\0")

    def _job_sender(self, pid: int) -> str | None:
        """The command name of ``pid`` when it is a process of the job (the job's own pid, or a process in the job's
        session: the job runs in one of its own), else None. Read at once, on the sender thread: a launcher that
        signalled its parent may exit the next moment (a zombie still has its session id)."""
        job = self.job_pid
        if job <= 0 or pid <= 0 or pid == os.getpid():
            return None
        try:
            if pid != job and os.getsid(pid) != job:
                return None
        except OSError:  # gone, and reaped: unknown, so from outside
            return None
        try:
            with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as comm:
                return comm.read().strip()
        except OSError:
            return ""

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:  # only records; the loop acts
        if signum == signal.SIGCHLD:
            self.child_exited = True
        else:
            self.signals.append(signum)

    def drain(self) -> None:
        """Empty the self-pipe (the loop woke up); never blocks."""
        try:
            while os.read(self.read_fd, 512):
                pass
        except OSError:  # BlockingIOError included: drained
            pass

    def close(self) -> None:
        """Restore the previous handlers and wake-up descriptor, close the self-pipe. A second call does nothing."""
        if self._notify is not None:
            self._notify.close()
            if HELPERS.notify is self._notify:
                HELPERS.notify = None
            self._notify = None
        if self.read_fd < 0:  # not installed, or closed already
            return
        with self._lock:
            self._stop.set()
        if self._masked:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, self._masked)  # pending ones reach the handlers (recorded)
            self._masked = ()
        if self._old_wakeup != _NOT_INSTALLED:
            signal.set_wakeup_fd(self._old_wakeup)
            for signum, handler in self._old_handlers.items():
                signal.signal(signum, handler)
        self._old_handlers.clear()
        for fd in (self.read_fd, self._write_fd):
            os.close(fd)
        self.read_fd = self._write_fd = -1
