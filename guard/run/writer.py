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

There is one writer per open descriptor in the guard process (``writer_for``): the job's stderr and the guard's own
log lines (``LogSink``, the ``logging`` handler of ``guard.run.cli``) share the writer of fd 2, so they keep their
order and one bounded buffer. A log line that finds that buffer full (the reader paused) or the reader gone
(``EPIPE``) is dropped and counted (``LogSink.dropped``); the guard says how many once stderr takes lines again, and
the VERDICT carries ``log_lines_dropped=N`` when some never got out. Writers are thread-safe: the helper thread logs
too.
"""

from __future__ import annotations

import logging
import os
import select
import stat
import threading
from collections import deque
from collections.abc import Callable

__all__ = ["LIMIT_BYTES", "LogSink", "OutputWriter", "pump_all", "writer_for"]

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
        self._lock = threading.RLock()
        try:
            info = os.fstat(fd)
            mode, self.identity = info.st_mode, (info.st_dev, info.st_ino)
        except OSError:
            mode, self.identity = 0, (0, 0)
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
        with self._lock:
            self._chunks.append(bytes(data))
            self._buffered += len(data)
            self.pump()

    def offer(self, data: bytes) -> bool:
        """Queue ``data`` unless the buffer is full or the reader is gone; False when it was dropped. Never blocks."""
        with self._lock:
            if self.broken or self.full:
                return False
            self.write(data)
            return not self.broken

    def pump(self) -> bool:
        """Write what the descriptor takes now; True when nothing is left buffered."""
        with self._lock:
            return self._pump()

    def _pump(self) -> bool:
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


_WRITERS: dict[int, OutputWriter] = {}
_WRITERS_LOCK = threading.Lock()


def writer_for(fd: int) -> OutputWriter:
    """The guard process's one writer for the open file behind ``fd`` (a new one when ``fd`` now names another
    file than the writer it had: a descriptor number reused after a close)."""
    with _WRITERS_LOCK:
        writer = _WRITERS.get(fd)
        if writer is not None:
            try:
                info = os.fstat(fd)
                same = (info.st_dev, info.st_ino) == writer.identity
            except OSError:
                same = False
            if same:
                return writer
        writer = _WRITERS[fd] = OutputWriter(fd)
        return writer


def pump_all() -> bool:
    """Pump every writer of the process; True while something is still buffered."""
    with _WRITERS_LOCK:
        writers = list(_WRITERS.values())
    pending = False
    for writer in writers:
        pending |= not writer.pump()
    return pending


class LogSink(logging.Handler):
    """A ``logging`` handler that never blocks: formatted records go to ``writer_for(fd)``.

    A record that finds the writer's buffer full or its reader gone is dropped and counted in ``dropped``; once the
    descriptor takes lines again, one ``N log lines dropped`` line (formatted by ``notice``) says so first.

    Args:
        fd: the descriptor (default 2, the guard's stderr).
        prefix: called before the ``dropped`` notice, with the descriptor; returns bytes to put first (the line
            break after a job's unfinished line, ``guard.run.output.LINES``; the formatter does that for records).
    """

    def __init__(self, fd: int = 2, prefix: Callable[[int], bytes] | None = None) -> None:
        super().__init__()
        self.fd = fd
        self.prefix = prefix
        self.dropped = 0  # records never written
        self._unreported = 0  # dropped since the last notice

    @property
    def writer(self) -> OutputWriter:
        return writer_for(self.fd)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
        except Exception:  # noqa: BLE001 - logging never raises into the guard
            self.handleError(record)
            return
        writer = self.writer
        if self._unreported and not writer.full and not writer.broken:
            notice = f"[guard] {self._unreported} log lines dropped (stderr was not read)\n".encode()
            if writer.offer((self.prefix(self.fd) if self.prefix is not None else b"") + notice):
                self._unreported = 0
        if self._unreported or not writer.offer((text + "\n").encode("utf-8", "replace")):
            self.dropped += 1
            self._unreported += 1

    def drain(self, timeout_s: float) -> int:
        """Write what is buffered, waiting for the reader up to ``timeout_s`` seconds; returns the bytes still
        queued then (they stay queued)."""
        writer = self.writer
        writer.close(timeout_s=timeout_s)
        return writer.buffered_bytes


def _writable(fd: int, timeout_ms: int = 0) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(event & (select.POLLOUT | select.POLLERR | select.POLLHUP) for _, event in poller.poll(timeout_ms))


def _wait_writable(fd: int, timeout_s: float) -> None:
    try:
        _writable(fd, int(timeout_s * 1000))
    except (OSError, ValueError):
        pass
