"""The job's stdout and stderr on their way to the guard's: read, filtered (masked, losses parsed), written.

Part of the supervisor's loop, and like it never blocking: pipes are read when the selector says so, a line without
its newline is written after ``PARTIAL_FLUSH_S``, and writes go through non-blocking writers
(``guard.run.writer``). While a writer's buffer is full (a paused reader: ``python -m guard train.py | less``) the
job's pipes are not read, so the job's own writes block instead of the guard's memory growing (backpressure).
"""

from __future__ import annotations

import os
import selectors
import threading
import time
from collections.abc import Callable
from typing import Literal

from guard.core.masking import Masker
from guard.run.output import LINES, OutputEvents, StreamFilter
from guard.run.writer import OutputWriter, pump_all, writer_for

__all__ = ["PARTIAL_FLUSH_S", "EarlyRelay", "JobOutput"]

PARTIAL_FLUSH_S = 0.1  # an unfinished line is written after this long without a newline
#: One read of a job's pipe: a Python job writes 64 KiB at a time (the agent's ``STDOUT_CHUNK_BYTES``). Reads of
#: up to 1 MiB took no fewer loop turns (one per write of the job) and cost more CPU (1M lines: 0.42 s against 0.37 s
#: of the guard's, a fresh 1 MiB buffer a read).
READ_BYTES = 1 << 16
PIPE = "pipe"  # the selector data of the job's pipes
#: At the end, how long the guard waits for a paused reader of its stderr (seconds); its stdout, which the VERDICT
#: follows, is waited for as long as it takes (and so is stderr when it is the same file, ``2>&1``).
DRAIN_STDERR_S = 2.0


def _grow_pipe(fd: int, size_bytes: int = 1 << 20) -> None:
    """Ask Linux for a 1 MiB pipe buffer (``F_SETPIPE_SZ``, ``fcntl(2)``): fewer wake-ups for chatty jobs."""
    try:
        import fcntl

        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), size_bytes)
    except (OSError, ImportError):
        pass  # above /proc/sys/fs/pipe-max-size, or not Linux: the default 64 KiB works too


class JobOutput:
    """The job's output pipes and the guard's outputs.

    Args:
        selector: the loop's selector; pipes are registered with data ``"pipe"``.
        masker: the secret masker applied to everything written.
        out_fd: where the guard's stdout goes (its closing, e.g. a reader that quit, stops writes there).

    Attributes:
        events: what the output said (losses to drain, exceptions, CUDA OOM, the job's own VERDICT lines).
    """

    def __init__(self, selector: selectors.BaseSelector, masker: Masker, out_fd: int = 1) -> None:
        self._sel = selector
        self.masker = masker
        self.out_fd = out_fd
        self.events = OutputEvents()
        self.filters: dict[int, StreamFilter] = {}
        self.targets: dict[int, int] = {}
        self.partial_since: dict[int, float] = {}  # pipe -> when its unfinished line began waiting
        self.writers: dict[int, OutputWriter] = {}  # target fd -> non-blocking writer
        self._paused: list[int] = []  # a writer is full: these pipes are not read (backpressure)
        self._closed_out = False

    def add(self, fd: int, target: int, *, parse_losses: bool = True, label: str = "") -> None:
        """Read the pipe ``fd`` and write what it carries, filtered, to ``target``; ``label`` names the stream in
        ``events.last_lines``."""
        _grow_pipe(fd)
        self.filters[fd] = StreamFilter(self.masker, parse_losses=parse_losses, events=self.events, label=label)
        self.targets[fd] = target
        self._sel.register(fd, selectors.EVENT_READ, PIPE)

    def read(self, fd: int, now: float) -> Literal["none", "data", "eof"]:
        """Pass one read of the pipe through: ``data`` was read, the pipe reached its ``eof``, or ``none``."""
        try:
            data = os.read(fd, READ_BYTES)
        except BlockingIOError:
            return "none"
        except OSError:
            data = b""
        flt = self.filters[fd]
        if not data:
            self.write(self.targets[fd], flt.close())
            self._sel.unregister(fd)
            self.partial_since.pop(fd, None)
            return "eof"
        self.write(self.targets[fd], flt.feed(data))
        if flt.pending:
            self.partial_since.setdefault(fd, now)
        else:
            self.partial_since.pop(fd, None)
        return "data"

    def move_to(self, selector: selectors.BaseSelector) -> None:
        """Read the job's pipes through ``selector`` from now on (the loop's, after ``EarlyRelay``'s own): the
        pipes registered in the old one move; those paused for backpressure are registered when they resume."""
        pipes = [key.fd for key in self._sel.get_map().values() if key.data == PIPE]
        for fd in pipes:
            self._sel.unregister(fd)
            selector.register(fd, selectors.EVENT_READ, PIPE)
        self._sel = selector

    @property
    def open(self) -> bool:
        """Some pipe of the job is still open (read, or paused for backpressure)."""
        return bool(self._paused) or any(key.data == PIPE for key in self._sel.get_map().values())

    def due_at(self) -> float:
        """When an unfinished line is next written (monotonic seconds; ``inf`` without one)."""
        return min((since + PARTIAL_FLUSH_S for since in self.partial_since.values()), default=float("inf"))

    def flush_partials(self, now: float) -> None:
        """Write the unfinished lines that waited ``PARTIAL_FLUSH_S``."""
        for fd, since in list(self.partial_since.items()):
            if now - since >= PARTIAL_FLUSH_S:
                self.write(self.targets[fd], self.filters[fd].flush_partial())
                if self.filters[fd].pending:
                    self.partial_since[fd] = now
                else:
                    del self.partial_since[fd]

    def write(self, fd: int, data: bytes) -> None:
        """Queue ``data`` for ``fd``; never blocks (a paused reader fills the writer's buffer)."""
        if not data or (fd == self.out_fd and self._closed_out):
            return
        LINES.wrote(fd, data)
        writer = self.writers.get(fd)
        if writer is None:
            writer = self.writers[fd] = writer_for(fd)  # shared with the guard's log lines on that descriptor
        writer.write(data)
        if writer.broken and fd == self.out_fd:
            self._closed_out = True

    def pump(self) -> bool:
        """Write what the guard's outputs take now; stop reading the job's pipes while a buffer is full, read
        them again once it drained. True while something is still buffered."""
        pending = pump_all()  # the guard's log lines too
        full = any(writer.full for writer in self.writers.values())
        if full and not self._paused:
            self._paused = [key.fd for key in self._sel.get_map().values() if key.data == PIPE]
            for fd in self._paused:
                self._sel.unregister(fd)
        elif not full and self._paused:
            for fd in self._paused:
                self._sel.register(fd, selectors.EVENT_READ, PIPE)
            self._paused = []
        return pending

    def finish(self) -> None:
        """The run is over: write what the filters still hold (its events follow in ``events``)."""
        for fd, flt in self.filters.items():
            self.write(self.targets[fd], flt.close())

    def drain(self) -> None:
        """Wait for the readers to take what is buffered (the VERDICT comes after this output): the guard's stdout
        (and what shares its file) as long as it takes, any other target up to ``DRAIN_STDERR_S``."""
        try:
            out = os.fstat(self.out_fd)
            out_id = (out.st_dev, out.st_ino)
        except OSError:
            out_id = None
        for fd, writer in self.writers.items():
            writer.close(None if fd == self.out_fd or writer.identity == out_id else DRAIN_STDERR_S)

    def close(self) -> None:
        """Put the outputs' flags back (what is left was written by ``finish``)."""
        for writer in self.writers.values():
            writer.close(timeout_s=0)


RELAY_POLL_S = 0.01  # how often the early relay looks at its stop flag while the job is silent


class EarlyRelay:
    """The job's output passed through on a thread of its own while the loop's policies are imported and built.

    The job is started before securing, the watchdog and telemetry exist (``guard.run.start``); without this its
    first lines waited in the pipes until the loop ran (about 50-100 ms of the guard's start-up). The relay reads
    the pipes of ``output`` through a selector of its own, filters and writes them exactly as the loop does (the
    same ``JobOutput``: masking, loss parsing, the non-blocking writers, backpressure), and stops at
    ``hand_over``, after which the loop reads the same pipes with the same filters. Nothing here blocks: reads
    follow ``select``, writes go to the non-blocking writers, and the thread looks at its stop flag every
    ``RELAY_POLL_S`` seconds, so ``hand_over`` returns within about that long.

    Args:
        output: the job's output, its pipes added with ``selector``.
        selector: the relay's own selector (``output``'s until the hand-over).
        clock: monotonic seconds.

    Attributes:
        saw_output: the job wrote something (data or the end of a stream) while the relay ran.
    """

    def __init__(self, output: JobOutput, selector: selectors.BaseSelector,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.output = output
        self._sel = selector
        self._clock = clock
        self._stop = threading.Event()
        self.saw_output = False
        self._thread = threading.Thread(target=self._run, name="guard-early-output", daemon=True)

    def start(self) -> EarlyRelay:
        self._thread.start()
        return self

    def _run(self) -> None:
        output = self.output
        while not self._stop.is_set():
            for key, _ in self._sel.select(RELAY_POLL_S):
                if self._stop.is_set():
                    break
                if key.data == PIPE and output.read(key.fd, self._clock()) != "none":
                    self.saw_output = True
            output.flush_partials(self._clock())
            output.pump()
            if not output.open:
                return

    def hand_over(self, selector: selectors.BaseSelector, timeout_s: float = 2.0) -> bool:
        """Stop the relay and move the pipes to ``selector`` (the loop's); returns ``saw_output``. Waits for the
        thread at most ``timeout_s`` seconds (it ends within about ``RELAY_POLL_S``: nothing it does blocks)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self.output.move_to(selector)
        self._sel.close()
        return self.saw_output

    def stop(self) -> None:
        """Stop the relay without a hand-over (the loop will not run)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2.0)
        self._sel.close()
