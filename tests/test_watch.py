"""Tests for ``guard.watch``: VERDICT parsing, the exit code of a watched log, silence, summary, usage errors."""

from __future__ import annotations

import io
import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from guard.watch import (
    NO_VERDICT_EXIT,
    FdSource,
    Verdict,
    WatchResult,
    main,
    parse_verdict,
    render_summary,
    watch_stream,
    write_summary,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


class FakeClock:
    """Monotonic seconds that move only when a test (or the scripted source) moves them."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class ScriptedSource:
    """A ``ChunkSource`` playing a script: ``bytes`` arrive at once, a ``float`` is that many seconds of silence.

    Silence moves the fake clock instead of sleeping, as ``select`` would: a wait shorter than the silence times
    out (``None``) after the wait; a longer one sees the next chunk. After the script, the stream ends (``b""``).
    """

    def __init__(self, script: list[bytes | float], clock: FakeClock) -> None:
        self.script = list(script)
        self.clock = clock
        self.waits: list[float | None] = []

    def read_chunk(self, timeout_s: float | None) -> bytes | None:
        self.waits.append(timeout_s)
        while self.script:
            item = self.script[0]
            if isinstance(item, bytes):
                self.script.pop(0)
                return item
            if timeout_s is not None and item >= timeout_s:
                self.clock.now += timeout_s
                self.script[0] = item - timeout_s
                return None
            self.clock.now += item
            self.script.pop(0)
            if timeout_s is not None:
                timeout_s -= item
        return b""


def run_main(
    argv: list[str], stdin: object, clock: FakeClock | None = None
) -> tuple[int, bytes, str]:
    stdout, stderr = io.BytesIO(), io.StringIO()
    code = main(argv, stdin=stdin, stdout=stdout, stderr=stderr, clock=clock or FakeClock())
    return code, stdout.getvalue(), stderr.getvalue()


def guard_log(*lines: str) -> bytes:
    return "".join(line + "\n" for line in lines).encode()


# ---------------------------------------------------------------------------------------------------------------
# parse_verdict
# ---------------------------------------------------------------------------------------------------------------


def test_parse_verdict_reads_status_required_keys_and_quoted_fields() -> None:
    line = (
        "VERDICT: TIMEOUT reason=deadline exit=75 elapsed=7140.2 step=1200 loss=1.875 "
        "pushed=acme/run@0123abcd secured=yes hint='resume from the pushed checkpoint'\r\n"
    )
    verdict = parse_verdict(line)
    assert verdict == Verdict(
        status="TIMEOUT",
        reason="deadline",
        exit_code=75,
        elapsed_s=7140.2,
        fields={
            "reason": "deadline",
            "exit": "75",
            "elapsed": "7140.2",
            "step": "1200",
            "loss": "1.875",
            "pushed": "acme/run@0123abcd",
            "secured": "yes",
            "hint": "resume from the pushed checkpoint",
        },
    )


@pytest.mark.parametrize(
    "line",
    [
        "VERDICT: MAYBE reason=ok exit=0 elapsed=1.0",  # unknown STATUS
        "VERDICT: pass reason=ok exit=0 elapsed=1.0",  # STATUS is upper case
        "VERDICT: PASS reason=ok exit=zero elapsed=1.0",  # exit not an int
        "VERDICT: PASS reason=ok exit=-1 elapsed=1.0",
        "VERDICT: PASS reason=ok exit=256 elapsed=1.0",  # not an exit status
        "VERDICT: PASS reason=ok exit=0",  # no elapsed
        "VERDICT: PASS reason=ok exit=0 elapsed=soon",
        "VERDICT: PASS reason=ok exit=0 elapsed=nan",
        "VERDICT: PASS exit=0 elapsed=1.0",  # no reason
        "VERDICT: PASS reason= exit=0 elapsed=1.0",
        "VERDICT: PASS reason=ok exit=0 elapsed=1.0 hint='unclosed",  # shell quoting
        "VERDICT: PASS reason=ok exit=0 elapsed=1.0 stray",  # a token that is not KEY=VALUE
        "VERDICT: PASS reason=ok exit=0 elapsed=1.0 =value",
        "VERDICT: ",
        "VERDICT:PASS reason=ok exit=0 elapsed=1.0",  # no space after the colon
    ],
)
def test_parse_verdict_ignores_malformed_verdict_like_lines(line: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="guard.contract"):
        assert parse_verdict(line) is None
    if line.startswith("VERDICT: "):
        assert any("VERDICT-like line ignored" in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize(
    "prefix",
    [
        "2026-11-29T19:37:02Z ",  # docker logs -t, kubectl logs --timestamps (RFC 3339)
        "2026-11-29T19:37:02.123456789Z ",  # RFC 3339 with nanoseconds
        "2026-11-29T19:37:02.1234567Z ",  # GitHub Actions raw log
        "2026-11-29 19:37:02,123+01:00 ",
        "2026-11-29T19:37:02-0500\t",
        "[2026-11-29 19:37:02] ",
        "[2026-11-29T19:37:02.123Z] ",
    ],
)
def test_parse_verdict_accepts_one_timestamp_prefix(prefix: str) -> None:
    verdict = parse_verdict(prefix + "VERDICT: FAIL reason=stalled exit=5 elapsed=1800.0")
    assert verdict is not None
    assert (verdict.status, verdict.reason, verdict.exit_code) == ("FAIL", "stalled", 5)


@pytest.mark.parametrize(
    "line",
    [
        "[job] VERDICT: PASS reason=ok exit=0 elapsed=1.0",  # the job's own verdict, escaped by the guard
        "2026-11-29T19:37:02Z [job] VERDICT: PASS reason=ok exit=0 elapsed=1.0",
        "2026-11-29T19:37:02Z 2026-11-29T19:37:03Z VERDICT: PASS reason=ok exit=0 elapsed=1.0",  # two prefixes
        " VERDICT: PASS reason=ok exit=0 elapsed=1.0",  # not at the start of the line
        "INFO VERDICT: PASS reason=ok exit=0 elapsed=1.0",
        "[12:00:01] VERDICT: PASS reason=ok exit=0 elapsed=1.0",  # a time alone is not an accepted prefix
        "100%|##########| 10/10\rVERDICT: PASS reason=ok exit=0 elapsed=1.0",  # after \r, not a line start
        "Final VERDICT: PASS reason=ok exit=0 elapsed=1.0",
    ],
)
def test_parse_verdict_rejects_lines_that_do_not_start_with_the_guard_verdict(line: str) -> None:
    assert parse_verdict(line) is None


# ---------------------------------------------------------------------------------------------------------------
# main: the exit code follows the log
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "reason", "exit_code"),
    [
        ("PASS", "ok", 0),
        ("PASS", "dry_run", 0),
        ("FAIL", "usage", 2),
        ("FAIL", "preflight", 3),
        ("FAIL", "non_finite_loss", 4),
        ("FAIL", "stalled", 5),
        ("FAIL", "push_failed", 6),
        ("FAIL", "crash", 1),
        ("FAIL", "killed", 137),
        ("FAIL", "guard_error", 70),
        ("TIMEOUT", "deadline", 75),
        ("TIMEOUT", "deadline", 124),
        ("INTERRUPTED", "signal", 75),
        ("INTERRUPTED", "signal", 143),
    ],
)
def test_exit_code_is_the_verdicts_and_the_log_passes_through_unchanged(
    status: str, reason: str, exit_code: int
) -> None:
    log = (
        b"[guard] preflight: 9 checks passed\n"
        b"{'loss': 2.31, 'grad_norm': 1.2, 'epoch': 0.1}\n"
        b" 10%|\xe2\x96\x88         | 1/10 [00:01<00:09]\r 20%|\xe2\x96\x88\xe2\x96\x88        | 2/10\n"
        b"caf\xe9 is not UTF-8\n"
        + f"VERDICT: {status} reason={reason} exit={exit_code} elapsed=42.0 step=2 loss=2.31\n".encode()
    )
    code, out, err = run_main([], io.BytesIO(log))
    assert code == exit_code
    assert out == log
    assert err == ""


def test_log_without_verdict_exits_with_the_no_verdict_code_and_says_why() -> None:
    log = guard_log("{'loss': 2.31, 'epoch': 0.1}", "Killed")
    code, out, err = run_main([], io.BytesIO(log))
    assert code == NO_VERDICT_EXIT == 125
    assert out == log
    lines = err.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("[guard] watch: the log ended without a guard VERDICT line (2 lines)")
    assert "killed hard" in lines[0]


def test_only_the_guards_verdict_counts_not_the_jobs_escaped_ones() -> None:
    log = guard_log(
        "[job] VERDICT: FAIL reason=eval exit=9 elapsed=3.0",
        "step 10 loss 1.2",
        "[job] VERDICT: PASS reason=ok exit=0 elapsed=4.0",
        "VERDICT: FAIL reason=non_finite_loss exit=4 elapsed=61.5 step=11 loss=nan",
    )
    assert run_main([], io.BytesIO(log))[0] == 4
    only_job = guard_log("[job] VERDICT: PASS reason=ok exit=0 elapsed=4.0")
    assert run_main([], io.BytesIO(only_job))[0] == NO_VERDICT_EXIT


def test_the_last_guard_verdict_wins_when_a_requeued_run_appends_to_the_log() -> None:
    log = guard_log(
        "VERDICT: TIMEOUT reason=deadline exit=75 elapsed=3500.0 pushed=acme/run@abc secured=yes",
        "[guard] resuming from acme/run@abc",
        "VERDICT: PASS reason=ok exit=0 elapsed=1200.0",
    )
    assert run_main([], io.BytesIO(log))[0] == 0


def test_a_malformed_verdict_line_after_a_good_one_does_not_replace_it() -> None:
    log = guard_log(
        "VERDICT: FAIL reason=stalled exit=5 elapsed=1800.0",
        "VERDICT: FAIL reason=stalled exit=five elapsed=1800.0",
        "VERDICT: PASS reason=ok exit=0",
    )
    assert run_main([], io.BytesIO(log))[0] == 5


def test_timestamp_prefixed_log_from_a_log_viewer() -> None:
    log = guard_log(
        "2026-11-29T19:30:00.000000001Z [guard] preflight: ok",
        "2026-11-29T19:30:01.5Z [job] VERDICT: PASS reason=ok exit=0 elapsed=1.0",
        "2026-11-29T19:37:02.123456789Z VERDICT: INTERRUPTED reason=signal exit=75 elapsed=422.1 signal=SIGTERM",
    )
    code, out, _ = run_main([], io.BytesIO(log))
    assert code == 75
    assert out == log


def test_verdict_split_across_chunks_and_a_last_line_without_newline_count() -> None:
    clock = FakeClock()
    source = ScriptedSource([b"step 1\nVERDICT: PA", b"SS reason=ok exit=0 ", b"elapsed=9.5"], clock)
    out = bytearray()
    result = watch_stream(source, out.extend, clock=clock)
    assert result.verdict is not None and result.verdict.exit_code == 0
    assert result.lines == 2
    assert bytes(out) == b"step 1\nVERDICT: PASS reason=ok exit=0 elapsed=9.5"


def test_an_overlong_line_is_passed_through_but_not_parsed() -> None:
    long_line = b"VERDICT: FAIL reason=crash exit=1 elapsed=1.0 junk=" + b"x" * (200 * 1024) + b"\n"
    chunks: list[bytes | float] = [long_line[i : i + 4096] for i in range(0, len(long_line), 4096)]
    clock = FakeClock()
    out = bytearray()
    result = watch_stream(ScriptedSource(chunks, clock), out.extend, clock=clock)
    assert bytes(out) == long_line
    assert result.verdict is None


def test_a_reader_that_closes_stdout_does_not_stop_the_watch() -> None:
    class ClosedPipe:
        def write(self, data: bytes) -> int:
            raise BrokenPipeError

        def flush(self) -> None:
            raise BrokenPipeError

    log = guard_log("step 1", "VERDICT: FAIL reason=stalled exit=5 elapsed=1800.0")
    assert main([], stdin=io.BytesIO(log), stdout=ClosedPipe(), stderr=io.StringIO(), clock=FakeClock()) == 5


def test_ctrl_c_ends_the_watch_with_130() -> None:
    class Interrupted:
        def read_chunk(self, timeout_s: float | None) -> bytes | None:
            raise KeyboardInterrupt

    code, _, err = run_main([], Interrupted())
    assert code == 130
    assert err.startswith("[guard] watch: interrupted")


def test_text_streams_work_for_stdin_and_stdout() -> None:
    stdin = io.TextIOWrapper(io.BytesIO(guard_log("hello", "VERDICT: FAIL reason=push_failed exit=6 elapsed=3.0")))
    stdout = io.StringIO()
    assert main([], stdin=stdin, stdout=stdout, stderr=io.StringIO(), clock=FakeClock()) == 6
    assert stdout.getvalue() == "hello\nVERDICT: FAIL reason=push_failed exit=6 elapsed=3.0\n"


def test_reads_a_file_argument(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    log.write_bytes(guard_log("step 1", "VERDICT: TIMEOUT reason=deadline exit=124 elapsed=7200.0 secured=no"))
    code, out, _ = run_main([str(log)], io.BytesIO(b"VERDICT: PASS reason=ok exit=0 elapsed=1.0\n"))
    assert code == 124
    assert out == log.read_bytes()


# ---------------------------------------------------------------------------------------------------------------
# --no-verdict-timeout (scripted stream, fake clock: nothing sleeps)
# ---------------------------------------------------------------------------------------------------------------


def test_silence_past_the_no_verdict_timeout_stops_the_watch() -> None:
    clock = FakeClock()
    late = b"VERDICT: PASS reason=ok exit=0 elapsed=9000.0\n"
    source = ScriptedSource([b"step 1 loss 2.0\n", 600.0, b"step 2 loss 1.9\n", 7200.0, late], clock)
    code, out, err = run_main(["--no-verdict-timeout", "30m"], source, clock)
    assert code == NO_VERDICT_EXIT
    assert out == b"step 1 loss 2.0\nstep 2 loss 1.9\n"
    assert source.script == [7200.0 - 1800.0, late]  # stopped reading: the late line was never read
    assert clock.now == 1000.0 + 600.0 + 1800.0  # stopped 30 min after the last byte
    assert source.waits[:2] == [1800.0, 1800.0]
    assert err.startswith("[guard] watch: no output for 1800.0 s (--no-verdict-timeout)")
    assert err.count("\n") == 1


def test_silence_shorter_than_the_timeout_keeps_reading() -> None:
    clock = FakeClock()
    source = ScriptedSource([b"step 1\n", 1799.0, b"VERDICT: FAIL reason=oom exit=137 elapsed=1900.0\n"], clock)
    code, _, err = run_main(["--no-verdict-timeout", "00:30:00"], source, clock)
    assert code == 137
    assert err == ""


def test_silence_after_a_verdict_ends_the_watch_with_that_verdict() -> None:
    clock = FakeClock()
    source = ScriptedSource([b"VERDICT: PASS reason=ok exit=0 elapsed=50.0\n", 1e9], clock)
    code, _, err = run_main(["--no-verdict-timeout", "45s"], source, clock)
    assert code == 0
    assert err == ""
    assert clock.now == 1000.0 + 45.0


def test_fd_source_waits_with_select_and_sees_the_end() -> None:
    read_fd, write_fd = os.pipe()
    try:
        source = FdSource(read_fd)
        assert source.read_chunk(0.0) is None
        os.write(write_fd, b"VERDICT: PASS reason=ok exit=0 elapsed=1.0\n")
        assert source.read_chunk(0.0) == b"VERDICT: PASS reason=ok exit=0 elapsed=1.0\n"
        os.close(write_fd)
        write_fd = -1
        assert source.read_chunk(0.0) == b""
    finally:
        os.close(read_fd)
        if write_fd >= 0:
            os.close(write_fd)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("7200", 7200.0), ("45s", 45.0), ("1.5h", 5400.0), ("1d", 86400.0), ("01:02:03", 3723.0), ("2-00:00:30", 172830)],
)
def test_no_verdict_timeout_takes_the_contracts_duration_forms(text: str, seconds: float) -> None:
    clock = FakeClock()
    code, _, _ = run_main(["--no-verdict-timeout", text], ScriptedSource([b"step 1\n", 1e9], clock), clock)
    assert code == NO_VERDICT_EXIT
    assert clock.now == 1000.0 + seconds


# ---------------------------------------------------------------------------------------------------------------
# --summary
# ---------------------------------------------------------------------------------------------------------------


def test_summary_lists_the_verdict_and_is_appended(tmp_path: Path) -> None:
    summary = tmp_path / "step_summary.md"
    summary.write_text("## Earlier step output")  # GitHub's file may hold what the step wrote before
    summary.chmod(0o640)
    log = guard_log(
        "VERDICT: TIMEOUT reason=deadline exit=75 elapsed=7140.25 step=1200 loss=1.875 "
        "checkpoint=out/checkpoint-1200 pushed=acme/run@0123abcd secured=yes hint='resume from acme/run | now'"
    )
    code, _, _ = run_main(["--summary", str(summary)], io.BytesIO(log))
    assert code == 75
    text = summary.read_text()
    assert text.startswith("## Earlier step output\n### jobguard: TIMEOUT (deadline), exit 75\n")
    for row in [
        "| status | TIMEOUT |",
        "| reason | deadline |",
        "| exit code | 75 |",
        "| step | 1200 |",
        "| loss | 1.875 |",
        "| checkpoint | out/checkpoint-1200 |",
        "| pushed | acme/run@0123abcd |",
        "| secured | yes |",
        "| hint | resume from acme/run \\| now |",
        "| elapsed | 7140.2 s |",
    ]:
        assert row + "\n" in text
    assert stat.S_IMODE(summary.stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_summary.md"]  # no temporary file left behind

    run_main(["--summary", str(summary)], io.BytesIO(guard_log("VERDICT: PASS reason=ok exit=0 elapsed=1.0")))
    text = summary.read_text()
    assert text.count("### jobguard:") == 2
    assert text.endswith("| elapsed | 1.0 s |\n\n")


def test_summary_says_when_the_log_had_no_verdict(tmp_path: Path) -> None:
    summary = tmp_path / "new.md"
    code, _, _ = run_main(["--summary", str(summary)], io.BytesIO(guard_log("step 1", "step 2")))
    assert code == NO_VERDICT_EXIT
    text = summary.read_text()
    assert text.startswith("### jobguard: no VERDICT (exit 125)\n")
    assert "The log ended without the guard's VERDICT line, after 2 lines" in text


def test_summary_after_silence_names_the_timeout() -> None:
    result = WatchResult(verdict=None, lines=3, silent_s=1800.0, watched_s=2000.0)
    text = render_summary(result, no_verdict_timeout_s=1800.0)
    assert "The log went silent for 1800.0 s (--no-verdict-timeout 1800 s)" in text
    assert "hung" in text


def test_write_summary_follows_a_symlink_and_keeps_it(tmp_path: Path) -> None:
    target = tmp_path / "real.md"
    target.write_text("before\n")
    link = tmp_path / "link.md"
    link.symlink_to(target)
    write_summary(str(link), "after\n")
    assert link.is_symlink()
    assert target.read_text() == "before\nafter\n"


# ---------------------------------------------------------------------------------------------------------------
# Usage errors
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--no-verdict-timeout", "banana"], "--no-verdict-timeout"),
        (["--no-verdict-timeout", "0"], "--no-verdict-timeout"),
        (["--no-verdict-timeout", "10:99:00"], "--no-verdict-timeout"),
        (["--no-verdict-timout", "5m"], "--no-verdict-timout"),
        (["/no/such/job.log"], "FILE"),
        (["--summary", "/no/such/folder/summary.md"], "--summary"),
    ],
)
def test_bad_usage_prints_one_guard_line_and_a_usage_verdict(argv: list[str], named: str) -> None:
    code, out, err = run_main(argv, io.BytesIO(b"VERDICT: PASS reason=ok exit=0 elapsed=1.0\n"))
    assert code == 2
    lines = err.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("[guard] watch: ")
    assert named in lines[0]
    verdict = parse_verdict(out.decode())
    assert verdict is not None
    assert (verdict.status, verdict.reason, verdict.exit_code) == ("FAIL", "usage", 2)
    assert out.count(b"\n") == 1


def test_bad_duration_names_the_accepted_forms() -> None:
    _, out, err = run_main(["--no-verdict-timeout", "banana"], io.BytesIO(b""))
    for form in ("7200", "45s", "1.5h", "HH:MM:SS", "D-HH:MM:SS"):
        assert form in err
    verdict = parse_verdict(out.decode())
    assert verdict is not None and verdict.fields["hint"] == "e.g. --no-verdict-timeout 30m"


# ---------------------------------------------------------------------------------------------------------------
# End to end: a real process reading a real pipe
# ---------------------------------------------------------------------------------------------------------------


def _watch_process(*args: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "guard.watch", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO_ROOT,
        env=env,
    )


def test_end_to_end_piped_log(tmp_path: Path) -> None:
    summary = tmp_path / "summary.md"
    log = guard_log(
        "[guard] preflight: ok",
        "[job] VERDICT: PASS reason=ok exit=0 elapsed=1.0",
        "VERDICT: FAIL reason=non_finite_loss exit=4 elapsed=61.5 step=11 loss=nan hint='lower the learning rate'",
    )
    proc = _watch_process("--summary", str(summary))
    out, err = proc.communicate(log, timeout=60)
    assert proc.returncode == 4
    assert out == log
    assert err == b""
    assert "| loss | nan |" in summary.read_text()


def test_end_to_end_silent_pipe_hits_the_no_verdict_timeout() -> None:
    proc = _watch_process("--no-verdict-timeout", "0.5s")
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    try:
        proc.stdin.write(b"step 1 loss 2.0\n")
        proc.stdin.flush()
        assert proc.wait(timeout=60) == NO_VERDICT_EXIT  # the pipe stays open: only the silence ends the watch
        assert proc.stdout.read() == b"step 1 loss 2.0\n"
        assert b"--no-verdict-timeout" in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            stream.close()
