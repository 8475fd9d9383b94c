"""One worker thread for the guard's blocking helper calls, so that nothing on the supervisor's loop blocks.

``scontrol show job`` (up to 5 s), ``py-spy dump`` (up to 8 x 5 s) and NVML queries can each take seconds; the
loop hands them to ``Helpers.submit`` and polls the returned ``Pending`` on a later turn (``done()``, then
``result()``). Calls run one at a time, in order. When a call finishes, ``notify`` (if set) is called from the
worker thread: the supervisor writes a byte to its wake-up pipe there, so the loop turns at once. A failing call
keeps its exception in ``Pending.error``; the worker thread never dies of it.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["HELPERS", "Helpers", "Pending", "Wakeup"]

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


class Helpers:
    """Runs helper calls on one daemon thread, started on the first ``submit``.

    Args:
        notify: called (from the worker thread) after each call finishes; must not block.
    """

    def __init__(self, notify: Callable[[], None] | None = None) -> None:
        self.notify = notify
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
                self._thread = threading.Thread(target=self._work, name="guard-helpers", daemon=True)
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
