"""Writing the job's output to the guard's stdout and stderr without blocking the supervisor's loop.

A reader that pauses (``python -m guard train.py | less``, a stuck log shipper) fills the pipe; a plain
``os.write`` would then block the loop, and with it signals, the grace and the deadline. ``OutputWriter`` keeps
what cannot be written now in a bounded buffer and writes it when the descriptor takes more. While the buffer is
over its limit (``full``), the supervisor stops reading the job's pipes, so the job itself blocks on its own
writes (backpressure) instead of the guard's memory growing.

How it avoids blocking without changing the descriptor's flags (a non-blocking stdout would also be non-blocking for
the guard's own log lines and for whatever shares the descriptor, e.g. ``2>&1``): a pipe, socket or terminal is
written in pieces of at most ``PIPE_BUF`` (4096) bytes, each only after ``poll`` said it takes more (a pipe that
polls writable has a free 4 KiB slot, so such a write does not wait); a regular file is written directly (the
kernel does not block on it for lack of a reader). A descriptor that is non-blocking already is handled too.
"""

from __future__ import annotations

import os
import select
import stat
from collections import deque

__all__ = ["LIMIT_BYTES", "OutputWriter"]

#: Buffer limit per descriptor (bytes): over it, the job's pipes are not read until it drains.
LIMIT_BYTES = 4 << 20


class OutputWriter:
    """Non-blocking writes to one descriptor, with a bounded buffer.

    Args:
        fd: the descriptor (the guard's stdout or stderr).
        limit_bytes: over this many buffered bytes ``full`` is True (default 4 MiB).

    Attributes:
        broken: the reader is gone (``EPIPE``): later writes are dropped.
    """

    def __init__(self, fd: int, limit_bytes: int = LIMIT_BYTES) -> None:
        self.fd = fd
        self.limit_bytes = limit_bytes
        self.broken = False
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        try:
            mode = os.fstat(fd).st_mode
        except OSError:
            mode = 0
        self._poll_first = not stat.S_ISREG(mode)

    @property
    def buffered_bytes(self) -> int:
        """Bytes waiting to be written."""
        return self._buffered

    @property
    def full(self) -> bool:
        """Over the limit: the caller should stop reading the job's output until ``pump`` drained it."""
        return self._buffered >= self.limit_bytes

    def write(self, data: bytes) -> None:
        """Queue ``data`` and write as much as the descriptor takes now; never blocks (a regular file aside)."""
        if not data or self.broken:
            return
        self._chunks.append(bytes(data))
        self._buffered += len(data)
        self.pump()

    def pump(self) -> bool:
        """Write what the descriptor takes now; True when nothing is left buffered."""
        while self._chunks and not self.broken:
            chunk = self._chunks[0]
            piece = chunk
            if self._poll_first:
                if not _writable(self.fd):
                    return False
                piece = chunk[:select.PIPE_BUF]
            try:
                n = os.write(self.fd, piece)
            except BlockingIOError:
                return False
            except BrokenPipeError:
                self.broken = True
                break
            except InterruptedError:
                continue
            except OSError:
                self.broken = True
                break
            self._buffered -= n
            if n == len(chunk):
                self._chunks.popleft()
            else:
                self._chunks[0] = chunk[n:]
        if self.broken:
            self._chunks.clear()
            self._buffered = 0
        return not self._chunks

    def close(self, timeout_s: float | None = None) -> None:
        """Write what is left, waiting for the reader up to ``timeout_s`` (None: as long as it takes)."""
        import time

        end = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.pump():
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                break
            _wait_writable(self.fd, 0.1 if left is None else min(0.1, left))


def _writable(fd: int, timeout_ms: int = 0) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(event & (select.POLLOUT | select.POLLERR | select.POLLHUP) for _, event in poller.poll(timeout_ms))


def _wait_writable(fd: int, timeout_s: float) -> None:
    try:
        _writable(fd, int(timeout_s * 1000))
    except (OSError, ValueError):
        pass
