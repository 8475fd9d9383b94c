"""Worker threads for the guard's blocking helper calls, so that nothing on the supervisor's loop blocks.

``scontrol show job`` (up to 5 s), ``py-spy dump`` (up to 8 x 5 s) and NVML queries can each take seconds; the
loop hands them to ``Helpers.submit`` and polls the returned ``Pending`` on a later turn (``done()``, then
``result()``). Calls run one at a time, in order, on ``HELPERS``' thread; the output folder's file system calls
have their own thread (``FS_HELPERS``). When a call finishes, ``notify`` (if set) is called from the worker thread:
the supervisor writes a byte to its wake-up pipe there, so the loop turns at once. A failing call keeps its
exception in ``Pending.error``; the worker thread never dies of it.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

__all__ = ["FS_HELPERS", "HELPERS", "Helpers", "Pending", "Submitter", "Wakeup", "call_bounded", "call_until",
           "wake_loop"]

log = logging.getLogger("guard.helpers")

T = TypeVar("T")


class Pending(Generic[T]):
    """The future result of one helper call."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.error: BaseException | None = None
        self._value: T | None = None
        self._done = threading.Event()

    def done(self) -> bool:
        """True once the call returned or raised."""
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait up to ``timeout_s`` seconds (None: no limit) for the call; True when it is done. Not for the loop."""
        return self._done.wait(timeout_s)

    def result(self) -> T | None:
        """The call's return value; None while not done or when it raised (see ``error``)."""
        return self._value if self._done.is_set() else None

    def _finish(self, value: T | None, error: BaseException | None) -> None:
        self._value, self.error = value, error
        self._done.set()


class Submitter(Protocol):
    """What queues a call and returns its ``Pending`` at once (``Helpers``; tests offer one that runs it inline)."""

    def submit(self, func: Callable[..., T], *args: Any, **kwargs: Any) -> Pending[T]: ...


class Helpers:
    """Runs helper calls on one daemon thread, started on the first ``submit``.

    Args:
        notify: called (from the worker thread) after each call finishes; must not block.
        name: the thread's name (default ``guard-helpers``).
    """

    def __init__(self, notify: Callable[[], None] | None = None, *, name: str = "guard-helpers") -> None:
        self.notify = notify
        self.name = name
        self._queue: queue.Queue[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any], Pending[Any]]] = \
            queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, func: Callable[..., T], *args: Any, **kwargs: Any) -> Pending[T]:
        """Queue ``func(*args, **kwargs)``; returns at once."""
        pending: Pending[T] = Pending(getattr(func, "__qualname__", repr(func)))
        self._queue.put((func, args, kwargs, pending))
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._work, name=self.name, daemon=True)
                self._thread.start()
        return pending

    @property
    def busy(self) -> bool:
        """A call is queued or running."""
        return self._queue.unfinished_tasks > 0

    def _work(self) -> None:
        while True:
            func, args, kwargs, pending = self._queue.get()
            try:
                value, error = func(*args, **kwargs), None
            except Exception as exc:  # noqa: BLE001 - a helper's fault is data for its caller
                value, error = None, exc
                log.debug("helper %s failed: %r", pending.name, exc)
            pending._finish(value, error)
            self._queue.task_done()
            notify = self.notify
            if notify is not None:
                try:
                    notify()
                except Exception as exc:  # noqa: BLE001 - never let the wake-up kill the worker
                    log.debug("helper wake-up failed: %r", exc)


#: The guard process's helper thread (the supervisor sets ``HELPERS.notify`` to its wake-up pipe).
HELPERS = Helpers()


def wake_loop() -> None:
    """Wake the supervisor's loop through ``HELPERS.notify`` (its wake-up pipe) when one is set; never blocks."""
    notify = HELPERS.notify
    if notify is not None:
        notify()


#: The thread for the output folder's file system calls (securing's scans, stats and listings: see
#: ``guard.secure.scans``): its own, so that a scan stuck in ``stat()`` on a hung mount holds up no py-spy,
#: ``scontrol`` or NVML call; a finished call wakes the loop like ``HELPERS``' do.
FS_HELPERS = Helpers(wake_loop, name="guard-fs")


class Wakeup:
    """A ``notify`` for ``Helpers`` that writes one byte to a non-blocking wake-up pipe, until ``close``.

    ``close`` is called before the pipe is closed, so a late call never writes to a closed (or reused) descriptor.
    """

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._lock = threading.Lock()

    def __call__(self) -> None:
        import os

        with self._lock:
            if self._fd < 0:
                return
            try:
                os.write(self._fd, b"h")
            except OSError:  # full (the loop will wake anyway) or closed
                pass

    def close(self) -> None:
        with self._lock:
            self._fd = -1


def _on_own_thread(func: Callable[..., T], *args: Any) -> Pending[T]:
    pending: Pending[T] = Pending(getattr(func, "__qualname__", repr(func)))

    def work() -> None:
        try:
            pending._finish(func(*args), None)
        except Exception as exc:  # noqa: BLE001 - the caller reads it from the Pending
            pending._finish(None, exc)

    threading.Thread(target=work, name="guard-bounded", daemon=True).start()
    return pending


def call_bounded(func: Callable[..., T], *args: Any, timeout_s: float, default: T) -> T:
    """``func(*args)`` on a daemon thread of its own, waited for at most ``timeout_s`` seconds; ``default`` when it
    has not returned by then (it is left running: a ``stat()`` on a hung mount never returns) or when it raised.

    For the few file system calls made after the loop, on the way to the VERDICT (``guard.run.diagnose``): the
    VERDICT is late by ``timeout_s`` at most, never missing. Not for the loop, which never waits.
    """
    pending = _on_own_thread(func, *args)
    if not pending.wait(timeout_s):
        log.warning("%s did not return within %.0fs (a hung file system?): going on without it", pending.name,
                    timeout_s)
        return default
    value = pending.result()
    return default if pending.error is not None or value is None else value


def call_until(func: Callable[..., T], *args: Any, deadline_s: float, abort: Callable[[], bool],
               poll_s: float = 0.1) -> Pending[T]:
    """``func(*args)`` on a daemon thread of its own, waited for until it returns, the monotonic ``deadline_s``
    passes or ``abort()`` is true, whichever comes first (``abort`` is asked every ``poll_s`` seconds, default
    0.1). Returns the call's ``Pending``: ``done()`` is False when the wait was given up (the call is left running:
    a ``stat()`` on a hung mount never returns); a raised exception is in ``error``.

    For the file system work of the stages before the job starts (the resume's look at the output folder), which
    a signal must be able to cut short. Not for the loop, which never waits.
    """
    import time

    pending = _on_own_thread(func, *args)
    while not pending.wait(max(0.0, min(poll_s, deadline_s - time.monotonic()))):
        if abort() or time.monotonic() >= deadline_s:
            break
    return pending
