"""What wakes the loop besides its pipes and socket: signals (through ``signal.set_wakeup_fd``) and the helper thread.

The handlers only record: a signal number appended to ``signals`` (the loop pops and handles them), ``SIGCHLD`` a
flag (orphans may need reaping). Each writes a byte to a non-blocking self-pipe, which the loop's ``select``
watches, as does a finished helper call (``guard.core.helpers.HELPERS.notify``). Outside the main thread no handler
can be installed: ``signals`` is then filled by whoever runs the loop (the tests).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from types import FrameType
from typing import Any

from guard.core.helpers import HELPERS, Wakeup
from guard.run.process import default_signals

__all__ = ["LoopSignals"]

_NOT_INSTALLED = -2  # set_wakeup_fd refused (not the main thread): nothing to restore


class LoopSignals:
    """The loop's signal handlers and self-pipe.

    Attributes:
        signals: signal numbers received and not handled yet, oldest first (the loop pops them).
        child_exited: ``SIGCHLD`` seen since the loop last reaped (it clears the flag).
        read_fd: the self-pipe's read end, for the loop's selector (-1 before ``install``).
    """

    def __init__(self) -> None:
        self.signals: list[int] = []
        self.child_exited = False
        self.read_fd = self._write_fd = -1
        self._notify: Wakeup | None = None
        self._old_handlers: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}
        self._old_wakeup = -1

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
        if self._old_wakeup != _NOT_INSTALLED:
            signal.set_wakeup_fd(self._old_wakeup)
            for signum, handler in self._old_handlers.items():
                signal.signal(signum, handler)
        self._old_handlers.clear()
        for fd in (self.read_fd, self._write_fd):
            os.close(fd)
        self.read_fd = self._write_fd = -1
