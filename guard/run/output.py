"""The job's output on its way through the guard: masking, ``[job] VERDICT`` escaping, and what it tells us.

``StreamFilter.feed`` takes raw bytes as they were read from the job's pipe and returns the bytes to write
now. Complete lines (ended by ``\\n``, or by ``\\r`` as progress bars redraw) go out at once; an unfinished
line stays until ``flush_partial`` is called by the supervisor's timer (a prompt or a progress bar without a
newline is held back for a fraction of a second), except for a tail that could be the start of a secret or of
a ``VERDICT:`` at the start of a line.

Work per chunk stays small for the common case: masking is ``bytes.replace`` guarded by ``in``, and lines are
split and parsed only when a chunk contains ``loss``, ``VERDICT:``, ``Traceback`` or ``Error``.

What the filter learns goes into ``StreamFilter.events`` (``OutputEvents``): losses printed by the job (for
commands the agent does not see into), the last exception named by a traceback, and whether the job printed a
CUDA out-of-memory error.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field

from guard.core.masking import Masker

__all__ = ["JOB_VERDICT_PREFIX", "LINES", "LineState", "OutputEvents", "StreamFilter", "parse_losses"]

JOB_VERDICT_PREFIX = b"[job] "
_VERDICT = b"VERDICT:"
_LINE_VERDICT = re.compile(rb"(?m)^VERDICT:")
_KEYWORDS = (b"loss", b"Loss", b"LOSS", b"Traceback", b"Error", b"Exception", b"Interrupt", b"VERDICT:", b"exitcode",
             b"local_rank")
# The keywords other than ``loss``, each behind one byte it contains (a ``memchr`` pass, ~20x faster than a search
# for a word): a chunk without a ``T`` holds no ``Traceback``. Same answer as searching every keyword.
_GATED = ((b"L", (b"Loss", b"LOSS")), (b"T", (b"Traceback",)), (b"E", (b"Error", b"Exception")),
          (b"I", (b"Interrupt",)), (b"V", (b"VERDICT:",)), (b"x", (b"exitcode",)), (b"_", (b"local_rank",)))


def has_keyword(data: bytes) -> bool:
    """``data`` holds one of ``_KEYWORDS`` (what makes a chunk worth splitting into lines)."""
    if b"loss" in data:
        return True
    return any(gate in data and any(word in data for word in words) for gate, words in _GATED)

# `{'loss': 2.3}`, `{'loss': '2.3'}` (transformers 5 prints strings), `loss=2.3`, `loss: 2.3`, `loss 2.3`, nan/inf.
# `eval_loss`/`train_loss` are not training-step losses: the name must not follow a letter, digit or underscore.
_LOSS = re.compile(
    rb"""(?<![\w])['"]?loss['"]?\s*[:=]?\s*['"]?"""
    rb"""(?P<v>[-+]?(?:nan|inf(?:inity)?|\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?))(?!\w|\.\d)""",
    re.IGNORECASE,
)
# A loss qualified by the word before it is another quantity, not a training step's loss: `best loss: inf` (printed
# before the first step), `val loss`, `min loss so far`, `target loss`.
_QUALIFIED = re.compile(
    rb"(?:best|min|minimum|max|maximum|lowest|highest|val|valid|validation|eval|evaluation|test|target|initial|"
    rb"final|expected|threshold|ref|reference|baseline|running|smoothed)[\s_-]*['\"]?$",
    re.IGNORECASE,
)
_STEP = re.compile(rb"""(?<![\w])['"]?(?:global_)?step['"]?\s*[:=]?\s*(?P<s>\d+)\b""", re.IGNORECASE)
_EXC_LINE = re.compile(rb"^(?P<type>[A-Za-z_][\w.]*)(?::\s?(?P<msg>.*))?$")
#: torch's words for a DataLoader worker that died (torch/csrc/DataLoader.cpp, torch/utils/data/dataloader.py).
WORKER_DIED = re.compile(r"DataLoader worker \(pids?(?:\(s\))? (?P<pids>[\d, ]+)\) (?:is killed by signal: "
                         r"(?P<signal>[^.]+)\.|exited unexpectedly)")
_RANK_LINE = re.compile(rb"^\[rank(?P<rank>\d+)\]:\s?(?P<rest>.*)$")
#: torchrun's failure summary (``ChildFailedError``, torch/distributed/elastic/multiprocessing/errors/__init__.py
#: ``format_msg``): per failed rank a ``rank : R (local_rank: L)`` line, then ``exitcode : C (pid: P)`` (C negative:
#: the signal that ended it).
_SUMMARY_RANK = re.compile(rb"^\s*rank\s*:\s*(?P<rank>\d+)\s*\(local_rank:\s*\d+\)")
_SUMMARY_EXIT = re.compile(rb"^\s*exitcode\s*:\s*(?P<code>-?\d+)\b")
_CUDA_OOM = (b"CUDA out of memory", b"OutOfMemoryError", b"CUDA error: out of memory")


def parse_losses(line: bytes) -> list[tuple[int | None, float]]:
    """Losses a line prints, each with the step printed on the same line (or None).

    Only a training step's loss counts: ``loss`` alone as a key (``{'loss': ...}``, ``loss=``, ``loss:``), never a
    name around it (``eval_loss``) or a qualifying word before it (``best loss: inf``, ``val loss 2.1``).

    Example:
        >>> parse_losses(b"{'loss': 'nan', 'grad_norm': 1.0}")
        [(None, nan)]
    """
    found = []
    for m in _LOSS.finditer(line):
        if _QUALIFIED.search(line[max(0, m.start() - 24) : m.start()]):
            continue
        try:
            value = float(m.group("v"))
        except ValueError:
            continue
        step_match = _STEP.search(line)
        found.append((int(step_match.group("s")) if step_match else None, value))
    return found


class LineState:
    """Whether the job's output last left the guard's stdout or stderr in the middle of a line (a progress bar
    redrawn with ``\\r``, a last line without a newline).

    The guard's own lines (``[guard] ...`` on stderr, the VERDICT on stdout) must start a line, so that they stay
    greppable as ``^[guard]`` / ``^VERDICT:``. When stdout and stderr are the same file (``2>&1`` into a log, one
    terminal), the state is the one of the last write to either; otherwise each stream has its own.
    """

    def __init__(self) -> None:
        self.mid: dict[int, bool] = {}
        self.last_fd: int | None = None
        self._merged: bool | None = None

    def wrote(self, fd: int, data: bytes) -> None:
        """Record a write of ``data`` (non-empty) to ``fd``."""
        if data:
            self.mid[fd] = not data.endswith(b"\n")
            self.last_fd = fd

    def merged(self) -> bool:
        """stdout and stderr are the same open file (``fstat``: same device and inode); checked once."""
        if self._merged is None:
            try:
                out, err = os.fstat(1), os.fstat(2)
                self._merged = (out.st_dev, out.st_ino) == (err.st_dev, err.st_ino)
            except OSError:
                self._merged = False
        return self._merged

    def needs_break(self, fd: int) -> bool:
        """A line written to ``fd`` now would not start a line."""
        if fd in (1, 2) and self.merged():
            return self.last_fd in (1, 2) and self.mid.get(self.last_fd, False)
        return self.mid.get(fd, False)

    def line_break(self, fd: int) -> bytes:
        """``b"\\n"`` when a line written to ``fd`` now needs one first (and record the guard's line), else ``b""``."""
        brk = b"\n" if self.needs_break(fd) else b""
        self.wrote(fd, b"\n")
        return brk


#: The state of the guard's stdout (fd 1) and stderr (fd 2), shared by the supervisor (which writes the job's
#: output), the log handler and the VERDICT.
LINES = LineState()


@dataclass
class OutputEvents:
    """What the job's output said (accumulated over the run).

    Attributes:
        losses: ``(step or None, loss)`` in the order printed; the supervisor drains it.
        last_exception: ``"Type: message"`` of the last traceback's final line, or None.
        root_exception: the error at the root of that one: the first of a chain (Python prints the cause first,
            then "The above exception was the direct cause ..." / "During handling of the above exception ..."),
            or a DataLoader worker's own error (the last line of its "Original Traceback").
        cuda_oom: a CUDA out-of-memory error was printed.
        job_verdicts: the job's own ``VERDICT:`` lines (text after ``VERDICT:``), escaped in the output.
        last_lines: each labelled stream's last non-empty line (``stderr``: what a job said before it died),
            masked, at most 300 characters.
        rank_exceptions: each rank's first exception in its ``[rankN]: `` lines (torchrun's prefix of a rank's
            output): rank -> ``"Type: message"`` (the first of a chain: the root cause).
        worker_deaths: DataLoader workers torch said died: pid -> the signal's description (``Killed``), or None
            (``exited unexpectedly``).
        rank_exits: the failed ranks of torchrun's failure summary: global rank -> its exit code (negative: the
            signal that ended it), in the order printed (the root cause first).
    """

    losses: list[tuple[int | None, float]] = field(default_factory=list)
    last_exception: str | None = None
    root_exception: str | None = None
    cuda_oom: bool = False
    job_verdicts: list[str] = field(default_factory=list)
    worker_deaths: dict[int, str | None] = field(default_factory=dict)
    rank_exceptions: dict[int, str] = field(default_factory=dict)
    last_lines: dict[str, str] = field(default_factory=dict)
    rank_exits: dict[int, int] = field(default_factory=dict)


#: ``OutputEvents.last_lines`` keeps this many bytes of a line's end.
LAST_LINE_CHARS = 300


def _last_line(head: bytes, out: bytes) -> bytes:
    """The last non-empty line of ``head + out`` (split at ``\n`` and ``\r``, stripped), or its end: the same
    ``[-LAST_LINE_CHARS:]`` as from the whole text, read from the last 8 KiB of a big chunk only (no copy of it)."""
    if len(out) > 8192:
        window = out[-8192:]
        stripped = window.rstrip()
        cut = max(stripped.rfind(b"\n"), stripped.rfind(b"\r"))
        last = stripped[cut + 1:].strip()
        if cut >= 0 or len(last) >= LAST_LINE_CHARS:
            return last  # the line starts inside the window, or its kept end does
    whole = (head + out).rstrip()
    return whole.rsplit(b"\n", 1)[-1].rsplit(b"\r", 1)[-1].strip()


def add_worker_deaths(deaths: dict[int, str | None], text: str) -> None:
    """Add the DataLoader workers ``text`` says died (``WORKER_DIED``) to ``deaths`` (pid -> signal or None); a
    signal named once is kept when a later message of the same worker names none."""
    for match in WORKER_DIED.finditer(text):
        for pid in re.findall(r"\d+", match["pids"]):
            if deaths.get(int(pid)) is None:
                deaths[int(pid)] = match["signal"]


class StreamFilter:
    """Filter for one of the job's streams (stdout or stderr).

    Args:
        masker: the secret masker.
        parse_losses: read losses from the output (for jobs the agent does not see into).
        events: where findings go; share one between stdout and stderr.
        label: the stream's name for ``events.last_lines`` (``stdout``, ``stderr``); empty: not kept.
    """

    def __init__(self, masker: Masker, *, parse_losses: bool = True, events: OutputEvents | None = None,
                 label: str = "") -> None:
        self.masker = masker
        self.label = label
        self.parse = parse_losses
        self.events = events if events is not None else OutputEvents()
        self._pending = b""
        self._at_line_start = True
        self._in_traceback = False
        self._chained = False  # a chain separator came after the last exception: the next one is not a root
        self._worker = False  # inside a DataLoader worker's "Original Traceback": its error is the root
        self._line_head = b""  # the part of the current line already written (for parsing), bounded
        self._rank_tracebacks: set[int] = set()  # ranks inside a "[rankN]: Traceback" block
        self._summary_rank: int | None = None  # the rank of torchrun's failure summary whose exit code comes next

    @property
    def pending(self) -> bool:
        """Bytes are held back (an unfinished line)."""
        return bool(self._pending)

    def feed(self, chunk: bytes) -> bytes:
        """Take bytes read from the job; return the bytes to write now."""
        data = self._pending + chunk if self._pending else chunk
        cut = max(data.rfind(b"\n"), data.rfind(b"\r"))
        if cut < 0:
            self._pending = data
            return b""
        complete, self._pending = data[: cut + 1], data[cut + 1 :]
        return self._emit(complete, line_complete=True)

    def flush_partial(self) -> bytes:
        """Write what is safe of an unfinished line (called by a timer when no newline came)."""
        if not self._pending:
            return b""
        data = self._pending
        if self._at_line_start and _VERDICT.startswith(data[: len(_VERDICT)]) and len(data) < len(_VERDICT):
            return b""  # could still become "VERDICT:" at a line start
        safe = self.masker.safe_len(data)
        if safe <= 0:
            return b""
        self._pending = data[safe:]
        return self._emit(data[:safe], line_complete=False)

    def close(self) -> bytes:
        """End of stream: write everything held."""
        data, self._pending = self._pending, b""
        if data:
            return self._emit(data, line_complete=True)
        if self._line_head:  # the last line went out unfinished (a progress bar): it still counts
            head, self._line_head = self._line_head, b""
            if self.parse and (b"oss" in head or b"OSS" in head):
                self.events.losses.extend(parse_losses(head))
            self._scan_errors(head)
        return b""

    def _emit(self, data: bytes, *, line_complete: bool) -> bytes:
        out = self.masker.mask(data)
        head = self._line_head
        if self._in_traceback or has_keyword(out) or (head and has_keyword(head)):
            out = self._inspect(out, line_complete)
        if line_complete:
            if self.label and (last := _last_line(head, out)):
                self.events.last_lines[self.label] = last[-LAST_LINE_CHARS:].decode("utf-8", "replace")
            self._at_line_start = out.endswith((b"\n", b"\r"))
            self._line_head = b""
        else:
            # A partial line went out early: keep it, so the whole line is parsed once its end arrives.
            self._at_line_start = False
            self._line_head = (head + out)[-4096:]
        return out

    def _inspect(self, out: bytes, line_complete: bool) -> bytes:
        lines = out.splitlines(keepends=True)
        result = []
        for i, raw in enumerate(lines):
            # after a \r too: a reader that splits there (a terminal, Python's splitlines()) sees a line start
            at_start = self._at_line_start if i == 0 else lines[i - 1].endswith((b"\n", b"\r"))
            text = raw.rstrip(b"\r\n")
            full = self._line_head + text if i == 0 else text
            if at_start and text.startswith(_VERDICT):
                self.events.job_verdicts.append(text[len(_VERDICT) :].strip().decode("utf-8", "replace"))
                raw = JOB_VERDICT_PREFIX + raw
            ended = line_complete or raw.endswith((b"\n", b"\r"))
            if ended:  # parse whole lines only: a partial one is parsed when its end arrives
                if self.parse and (b"oss" in full or b"OSS" in full):
                    self.events.losses.extend(parse_losses(full))
                self._scan_errors(full)
            result.append(raw)
        return b"".join(result)

    def _scan_errors(self, line: bytes) -> None:
        if any(marker in line for marker in _CUDA_OOM):
            self.events.cuda_oom = True
        if b"DataLoader worker (pid" in line:
            add_worker_deaths(self.events.worker_deaths, line.decode("utf-8", "replace"))
        if b"local_rank" in line and (summary := _SUMMARY_RANK.match(line)):
            self._summary_rank = int(summary["rank"])
            return
        if self._summary_rank is not None and b"exitcode" in line and (code := _SUMMARY_EXIT.match(line)):
            self.events.rank_exits.setdefault(self._summary_rank, int(code["code"]))
            self._summary_rank = None
            return
        if line.startswith(b"[rank") and (ranked := _RANK_LINE.match(line)):
            rank, rest = int(ranked["rank"]), ranked["rest"]
            if rest.startswith(b"Traceback (most recent call last)"):
                self._rank_tracebacks.add(rank)
            elif rank in self._rank_tracebacks and rest and not rest[:1].isspace() and _EXC_LINE.match(rest):
                self._rank_tracebacks.discard(rank)
                self.events.rank_exceptions.setdefault(rank, rest.decode("utf-8", "replace")[:500])
            return
        if line.startswith(b"Traceback (most recent call last)"):
            self._in_traceback = True
            return
        if line.startswith(b"Original Traceback (most recent call last)"):  # torch's ExceptionWrapper
            self._in_traceback = self._worker = True
            return
        if line.startswith((b"The above exception was the direct cause", b"During handling of the above exception")):
            self._chained = True
            return
        if self._in_traceback and line and not line[:1].isspace():
            m = _EXC_LINE.match(line)
            if m and (b"Error" in line or b"Exception" in line or b"Interrupt" in line or b":" in line):
                text = line.decode("utf-8", "replace")[:500]
                if self._worker:
                    self.events.root_exception = text  # the worker's own error, behind "Caught X in DataLoader"
                else:
                    if not self._chained or self.events.root_exception is None:
                        self.events.root_exception = text
                    self.events.last_exception = text
                self._in_traceback = self._chained = self._worker = False


def finite(value: float | None) -> bool:
    """True for a finite float (None counts as finite: nothing to judge)."""
    return value is None or math.isfinite(value)
