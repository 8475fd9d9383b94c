"""``python -m guard watch [FILE]``: follow a job log and exit by the guard's VERDICT.

The log (a file, or stdin by default) passes through to stdout unchanged, as it comes. The exit code is the
``exit=`` of the **last** guard VERDICT line seen (a requeued job may append a second run to the same log), so a
CI step or a scheduler hook gets the job's outcome from, e.g.::

    hf jobs logs --follow JOB_ID | jobguard watch --summary "$GITHUB_STEP_SUMMARY"

Which lines count (see ``parse_verdict``): a line that starts with ``VERDICT: `` (contract, "The VERDICT line"),
optionally after **one** log-viewer timestamp prefix. Accepted prefixes, each followed by spaces or tabs:

- bare RFC 3339 / ISO 8601, as written by ``docker logs -t``, ``kubectl logs --timestamps`` and GitHub Actions
  raw logs: ``2026-11-29T19:37:02Z``, ``2026-11-29T19:37:02.123456789Z``, ``2026-11-29 19:37:02,123+01:00``;
- the same in square brackets: ``[2026-11-29 19:37:02]``, ``[2026-11-29T19:37:02.123Z]``.

``[job] VERDICT: ...`` is the job's own verdict, escaped by the guard (contract, "Output"), and never counts; nor
does a ``VERDICT:`` after a ``\r`` (a progress bar's redraw), which the guard escapes too (``\r[job] VERDICT:``), so
that a reader splitting at ``\r`` never sees the job's line as the guard's. Lines end at ``\n``.

``--no-verdict-timeout DURATION`` stops the watch after that long without a new byte: with no VERDICT seen it exits
``NO_VERDICT_EXIT``; after one, with that VERDICT's code. ``--summary FILE`` appends a Markdown summary to FILE.

A log that ends without a guard VERDICT (the container was killed hard, the guard never ran) exits with
``NO_VERDICT_EXIT`` (125). 125 is outside the contract's table (0, 2-6, 70, 75, 124, 128+n) and is what
``timeout(1)`` and ``docker run`` return when the wrapper itself, not the command, could not finish; a job's own
exit code 125 (``reason=crash``) is told apart by the VERDICT line on stdout or the summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import logging
import os
import re
import select
import sys
import time
from collections.abc import Callable
from typing import BinaryIO, Protocol, TextIO, cast, runtime_checkable

from guard.contract import (
    EXIT_USAGE,
    STATUSES,
    RunResult,
    Verdict,
    parse_verdict,
    render_line,
)
from guard.core.durations import DURATION_FORMS, parse_duration
from guard.errors import UsageError
from guard.files import write_atomic

__all__ = [
    "EXIT_INTERRUPTED",
    "NO_VERDICT_EXIT",
    "STATUSES",
    "ChunkSource",
    "FdSource",
    "StreamSource",
    "Verdict",
    "WatchResult",
    "main",
    "parse_verdict",
    "render_summary",
    "watch_stream",
    "write_summary",
]

logger = logging.getLogger("guard.watch")

#: Exit code when the log ends (or goes silent past ``--no-verdict-timeout``) without a guard VERDICT line.
NO_VERDICT_EXIT = 125
#: Exit code when the watch itself is interrupted with Ctrl-C (128 + SIGINT), whatever the log said so far.
EXIT_INTERRUPTED = 130
#: Only the first bytes of an over-long line are kept for parsing (a VERDICT line is far shorter).
MAX_LINE_BYTES = 64 * 1024
_READ_SIZE = 64 * 1024

# ---------------------------------------------------------------------------------------------------------------
# Reading the stream
# ---------------------------------------------------------------------------------------------------------------


@runtime_checkable
class ChunkSource(Protocol):
    """Where the log comes from; tests pass a scripted one."""

    def read_chunk(self, timeout_s: float | None) -> bytes | None:
        """Wait at most ``timeout_s`` seconds (``None``: no limit) for bytes.

        Returns:
            The bytes read, ``b""`` at the end of the stream, or ``None`` if nothing came in time.
        """
        ...


class FdSource:
    """Reads a file descriptor (a pipe, a terminal, a file), waiting with ``select.select``.

    Args:
        fd: an open, readable file descriptor; not closed here.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def read_chunk(self, timeout_s: float | None) -> bytes | None:
        """See ``ChunkSource.read_chunk``. A regular file is always ready, so it never times out."""
        if timeout_s is not None:
            ready, _, _ = select.select([self.fd], [], [], max(0.0, timeout_s))
            if not ready:
                return None
        return os.read(self.fd, _READ_SIZE)


class StreamSource:
    """Reads a binary stream without a file descriptor (``io.BytesIO``); it cannot time out.

    Args:
        stream: a readable binary stream.
    """

    def __init__(self, stream: BinaryIO) -> None:
        self.stream = stream

    def read_chunk(self, timeout_s: float | None) -> bytes | None:
        """See ``ChunkSource.read_chunk``; ``timeout_s`` is ignored (reads block)."""
        read1 = getattr(self.stream, "read1", None)
        return read1(_READ_SIZE) if read1 is not None else self.stream.read(_READ_SIZE)


def _source_for(stdin: object) -> ChunkSource:
    if isinstance(stdin, ChunkSource):
        return stdin
    stream = cast(BinaryIO, getattr(stdin, "buffer", stdin))  # a text stream's buffer, else the stream itself
    try:
        return FdSource(stream.fileno())
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return StreamSource(stream)


class _Passthrough:
    """Writes the log's bytes unchanged to a binary stream, or decoded (UTF-8) to a text-only stream.

    A closed reader (``BrokenPipeError``, e.g. ``| head``) stops the pass-through, not the watch.
    """

    def __init__(self, stdout: TextIO | BinaryIO) -> None:
        self.stream = stdout
        self.binary: BinaryIO | None = getattr(stdout, "buffer", None)
        self.text: TextIO | None = None
        if self.binary is None:
            if isinstance(stdout, io.TextIOBase):
                self.text = stdout
            else:  # no text layer: a binary stream
                self.binary = cast(BinaryIO, stdout)
        self.broken = False

    def write(self, data: bytes) -> None:
        if self.broken:
            return
        try:
            if self.binary is not None:
                self.binary.write(data)
                self.binary.flush()
            elif self.text is not None:
                self.text.write(data.decode("utf-8", errors="replace"))
                self.text.flush()
        except BrokenPipeError:
            self.broken = True
            logger.debug("stdout closed by its reader; still reading the log for its VERDICT")
            if self.stream is sys.stdout:
                # Python's own flush of sys.stdout at exit would fail again; point the descriptor at /dev/null.
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
                os.close(devnull)


@dataclasses.dataclass(frozen=True)
class WatchResult:
    """What a watch saw.

    Attributes:
        verdict: the last guard VERDICT line, or ``None``.
        lines: lines read (a last line without ``\\n`` included).
        silent_s: when the watch stopped because of ``--no-verdict-timeout``, the silence in seconds; else ``None``.
        watched_s: seconds the watch ran, on its clock.
    """

    verdict: Verdict | None
    lines: int
    silent_s: float | None
    watched_s: float

    @property
    def exit_code(self) -> int:
        """The verdict's ``exit=``, or ``NO_VERDICT_EXIT``."""
        return self.verdict.exit_code if self.verdict is not None else NO_VERDICT_EXIT


def watch_stream(
    source: ChunkSource,
    write: Callable[[bytes], None],
    *,
    no_verdict_timeout_s: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> WatchResult:
    """Pass a log through and find its last guard VERDICT line.

    Args:
        source: where the log comes from.
        write: called with each chunk of bytes as it comes, unchanged.
        no_verdict_timeout_s: stop reading after this many seconds without a new byte (``None``: wait for the
            end of the stream). Silence after a VERDICT was seen ends the watch with that VERDICT.
        clock: monotonic seconds; injected by tests.

    Returns:
        The ``WatchResult``.
    """
    started = last_data = clock()
    verdict: Verdict | None = None
    lines = 0
    pending = b""
    overflow = False

    def take(line: bytes) -> None:
        nonlocal verdict, lines
        lines += 1
        if overflow:
            logger.debug("line %d longer than %d bytes: not parsed", lines, MAX_LINE_BYTES)
            return
        found = parse_verdict(line.decode("utf-8", errors="replace"))
        if found is not None:
            verdict = found

    while True:
        wait_s = None if no_verdict_timeout_s is None else last_data + no_verdict_timeout_s - clock()
        chunk = source.read_chunk(None if wait_s is None else max(0.0, wait_s))
        if chunk is None:
            silent_s = clock() - last_data
            if no_verdict_timeout_s is not None and silent_s >= no_verdict_timeout_s:
                return WatchResult(verdict, lines, silent_s, clock() - started)
            continue
        if not chunk:
            if pending or overflow:
                take(pending)
            return WatchResult(verdict, lines, None, clock() - started)
        last_data = clock()
        write(chunk)
        *complete, rest = chunk.split(b"\n")
        for piece in complete:
            take(pending + piece)
            pending, overflow = b"", False
        pending += rest
        if len(pending) > MAX_LINE_BYTES:
            pending, overflow = pending[:MAX_LINE_BYTES], True


# ---------------------------------------------------------------------------------------------------------------
# Summary (Markdown, e.g. $GITHUB_STEP_SUMMARY)
# ---------------------------------------------------------------------------------------------------------------

_SUMMARY_KEYS = ("step", "loss", "checkpoint", "pushed", "secured", "signal", "check", "rank", "hint")
_MD_SPECIAL = re.compile(r"([\\`*_\[\]<>|])")


def _lines(count: int) -> str:
    return f"{count} line" if count == 1 else f"{count} lines"


def _md(text: str) -> str:
    return _MD_SPECIAL.sub(r"\\\1", text)


def render_summary(result: WatchResult, *, no_verdict_timeout_s: float | None = None) -> str:
    """Render a short Markdown summary of a watch.

    Args:
        result: what the watch saw.
        no_verdict_timeout_s: the ``--no-verdict-timeout`` in seconds, named when the watch stopped on silence.

    Returns:
        Markdown text: a heading, then a two-column table (status, reason, exit code, the optional keys present,
        elapsed), or for a log without a VERDICT a paragraph saying so; ends with a blank line.
    """
    verdict = result.verdict
    if verdict is None:
        if result.silent_s is not None:
            what = f"The log went silent for {result.silent_s:.1f} s"
            if no_verdict_timeout_s is not None:
                what += f" (--no-verdict-timeout {no_verdict_timeout_s:g} s)"
            why = "the job may be hung, or the log stream stalled."
        else:
            what = "The log ended"
            why = (
                "the container was likely killed hard (SIGKILL, host out of memory, preemption), "
                "or the guard never ran."
            )
        return (
            f"### jobguard: no VERDICT (exit {NO_VERDICT_EXIT})\n\n"
            f"{what} without the guard's VERDICT line, after {_lines(result.lines)} and "
            f"{result.watched_s:.1f} s of watching: {why} Check the platform's status of the job.\n\n"
        )
    rows = [("status", verdict.status), ("reason", verdict.reason), ("exit code", str(verdict.exit_code))]
    rows += [(key, verdict.fields[key]) for key in _SUMMARY_KEYS if verdict.fields.get(key)]
    rows.append(("elapsed", f"{verdict.elapsed_s:.1f} s"))
    table = "".join(f"| {key} | {_md(value)} |\n" for key, value in rows)
    return (
        f"### jobguard: {verdict.status} ({_md(verdict.reason)}), exit {verdict.exit_code}\n\n"
        f"| | |\n|---|---|\n{table}\n"
    )


def write_summary(path: str, text: str) -> None:
    """Append ``text`` to the file at ``path`` atomically (GitHub's step summary is appended to).

    The old content plus ``text`` go to a temporary file in the same folder, which then replaces ``path``
    (``os.replace``), so a reader sees the old file or the new one, never a half-written one. A symlink is
    followed; an existing file keeps its permissions, a new one gets 0o666 less the umask.

    Args:
        path: the summary file; created when missing.
        text: Markdown to append.

    Raises:
        OSError: the folder or the file cannot be read or written.
    """
    target = os.path.realpath(path)
    mode: int | None = None
    try:
        with open(target, "rb") as old:
            before = old.read()
        mode = os.stat(target).st_mode & 0o7777
    except FileNotFoundError:
        before = b""
    if before and not before.endswith(b"\n"):
        before += b"\n"
    write_atomic(target, before + text.encode("utf-8"), mode=mode)


# ---------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        usage = " ".join(self.format_usage().split()[1:])  # one line, without the leading "usage:"
        raise UsageError(message, hint=f"usage: {usage}")


def _build_parser() -> _Parser:
    parser = _Parser(
        prog="jobguard watch",
        description="Pass a job log through and exit with the exit= of its last guard VERDICT line "
        f"({NO_VERDICT_EXIT} when the log has none).",
    )
    parser.add_argument("file", nargs="?", default="-", metavar="FILE", help="the log; stdin when - or absent")
    parser.add_argument(
        "--no-verdict-timeout",
        metavar="DURATION",
        help=f"stop after this long without new output (exit {NO_VERDICT_EXIT} if no VERDICT was seen); "
        f"{DURATION_FORMS}",
    )
    parser.add_argument(
        "--summary", metavar="FILE", help="append a Markdown summary to FILE, atomically (e.g. $GITHUB_STEP_SUMMARY)"
    )
    return parser


def _parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, float | None]:
    """Parse and check the arguments; raises ``UsageError`` naming the option and the accepted forms."""
    args = _build_parser().parse_args(argv)
    timeout_s = None
    if args.no_verdict_timeout is not None:
        try:
            timeout_s = parse_duration(args.no_verdict_timeout, option="--no-verdict-timeout")
        except UsageError as exc:  # the message names the option and the accepted forms
            raise UsageError(exc.message, option=exc.option, hint="e.g. --no-verdict-timeout 30m") from None
        if timeout_s <= 0:
            raise UsageError(
                f"--no-verdict-timeout: {args.no_verdict_timeout!r} is not more than 0 s; accepted: {DURATION_FORMS}",
                option="--no-verdict-timeout",
                hint="e.g. --no-verdict-timeout 30m",
            )
    if args.summary is not None and not os.path.isdir(os.path.dirname(os.path.abspath(args.summary))):
        raise UsageError(
            f"--summary: the folder of {args.summary!r} does not exist", option="--summary", hint="fix the path"
        )
    return args, timeout_s


def _open_log(path: str) -> BinaryIO:
    try:
        return open(path, "rb")
    except OSError as exc:
        raise UsageError(
            f"FILE: cannot read {path!r}: {exc.strerror}",
            option="FILE",
            hint="pass a readable log file, or - for stdin",
        ) from None


def _say(stderr: TextIO, message: str) -> None:
    stderr.write(f"[guard] watch: {message}\n")
    stderr.flush()


def _no_verdict_message(result: WatchResult) -> str:
    if result.silent_s is not None:
        return (
            f"no output for {result.silent_s:.1f} s (--no-verdict-timeout) and no guard VERDICT line: "
            f"the job may be hung, or its log stream stalled; exit {NO_VERDICT_EXIT}"
        )
    return (
        f"the log ended without a guard VERDICT line ({_lines(result.lines)}): the container was likely killed hard "
        f"(SIGKILL, host out of memory, preemption), or the guard never ran; exit {NO_VERDICT_EXIT}"
    )


def main(
    argv: list[str] | None = None,
    *,
    stdin: object = None,
    stdout: TextIO | BinaryIO | None = None,
    stderr: TextIO | None = None,
    clock: Callable[[], float] | None = None,
) -> int:
    """Run ``python -m guard watch``.

    Args:
        argv: the arguments after ``watch`` (default ``sys.argv[1:]``).
        stdin: the log when FILE is ``-`` or absent: a ``ChunkSource``, or a text or binary stream (default
            ``sys.stdin``); a stream with a file descriptor is waited on with ``select``.
        stdout: where the log passes through (default ``sys.stdout``; bytes go to its ``buffer`` unchanged).
        stderr: where the ``[guard] watch:`` lines go (default ``sys.stderr``).
        clock: monotonic seconds (default ``time.monotonic``).

    Returns:
        The exit code: the last guard VERDICT's ``exit=``; ``NO_VERDICT_EXIT`` (125) without one; 2 on bad usage
        (one ``[guard]`` line on stderr, ``VERDICT: FAIL reason=usage exit=2 elapsed=... hint=...`` on stdout);
        0 for ``--help``; 130 when interrupted with Ctrl-C. A summary that cannot be written is reported on
        stderr and does not change the code.
    """
    clock = clock or time.monotonic
    stderr = stderr if stderr is not None else sys.stderr
    started = clock()
    passthrough = _Passthrough(stdout if stdout is not None else sys.stdout)
    opened: BinaryIO | None = None
    try:
        args, timeout_s = _parse_args(argv)
        if args.file == "-":
            stdin = stdin if stdin is not None else sys.stdin
            if stdin is None:
                raise UsageError("FILE: no FILE given and stdin is closed", option="FILE", hint="pipe the log in")
            source = _source_for(stdin)
        else:
            opened = _open_log(args.file)
            source = FdSource(opened.fileno())
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    except UsageError as exc:
        _say(stderr, f"{exc.message} (hint: {exc.hint})")
        usage = RunResult("FAIL", exc.reason, EXIT_USAGE, clock() - started, hint=exc.hint)
        passthrough.write((render_line(usage) + "\n").encode("utf-8"))
        return EXIT_USAGE
    try:
        result = watch_stream(source, passthrough.write, no_verdict_timeout_s=timeout_s, clock=clock)
    except KeyboardInterrupt:
        _say(stderr, f"interrupted (SIGINT) before the log ended; exit {EXIT_INTERRUPTED}")
        return EXIT_INTERRUPTED
    finally:
        if opened is not None:
            opened.close()
    if result.verdict is None:
        _say(stderr, _no_verdict_message(result))
    if args.summary is not None:
        try:
            write_summary(args.summary, render_summary(result, no_verdict_timeout_s=timeout_s))
        except OSError as exc:
            _say(stderr, f"--summary: cannot write {args.summary!r} ({exc}); the exit code still follows the log")
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
