"""``guard.run.writer`` and ``guard.core.helpers``: the loop never waits for a paused reader nor for a helper call."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

from conftest import kill_quietly, start_guard

from guard.core.helpers import Helpers, Wakeup
from guard.run.writer import OutputWriter


def _pipe_size(fd: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, 1032)  # F_GETPIPE_SZ


def test_a_paused_reader_fills_the_buffer_not_the_loop() -> None:
    r, w = os.pipe()
    try:
        writer = OutputWriter(w, limit_bytes=1 << 20)
        size = _pipe_size(w)
        block = b"x" * 65536
        for _ in range((size + 2 * (1 << 20)) // len(block)):
            writer.write(block)  # returns at once: nobody reads
        assert writer.buffered_bytes > 0 and writer.full
        assert os.get_blocking(w)  # the descriptor's flags are left alone
        got = bytearray()
        while not writer.pump():  # the reader comes back
            got += os.read(r, 1 << 20)
        while len(got) < writer_total(size):
            chunk = os.read(r, 1 << 20)
            got += chunk
            if not chunk:
                break
        assert not writer.full and writer.buffered_bytes == 0
        writer.close()
    finally:
        os.close(r)
        os.close(w)


def writer_total(size: int) -> int:
    return ((size + 2 * (1 << 20)) // 65536) * 65536


def test_a_gone_reader_breaks_the_writer_without_raising() -> None:
    r, w = os.pipe()
    os.close(r)
    try:
        writer = OutputWriter(w)
        writer.write(b"hello\n")
        assert writer.broken and writer.buffered_bytes == 0
        writer.write(b"dropped\n")
        writer.close()
    finally:
        os.close(w)


def test_a_regular_file_is_written_at_once(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT)
    try:
        writer = OutputWriter(fd)
        writer.write(b"a" * 100000)
        assert writer.buffered_bytes == 0
        writer.close()
    finally:
        os.close(fd)
    assert (tmp_path / "out").stat().st_size == 100000


def test_helper_calls_run_on_the_worker_thread_and_wake_the_loop() -> None:
    r, w = os.pipe()
    os.set_blocking(w, False)
    wakeup = Wakeup(w)
    helpers = Helpers(notify=wakeup)
    release = threading.Event()
    try:
        pending = helpers.submit(lambda: (release.wait(10), threading.current_thread().name)[1])
        assert not pending.done() and pending.result() is None  # the caller did not wait
        failing = helpers.submit(lambda: 1 / 0)
        release.set()
        assert pending.wait(10) and failing.wait(10)
        assert pending.result() == "guard-helpers"
        assert isinstance(failing.error, ZeroDivisionError) and failing.result() is None
        assert os.read(r, 16)  # the loop's wake-up pipe got a byte
    finally:
        wakeup.close()
        wakeup()  # after close: writes nothing, raises nothing
        os.close(r)
        os.close(w)


PRINTS_A_LOT = """\
import os, signal, sys
def on_term(signum, frame):
    open({marker!r}, "w").close()
    os._exit(143)
signal.signal(signal.SIGTERM, on_term)
open({ready!r}, "w").close()
line = "x" * 1023 + "\\n"
while True:
    sys.stdout.write(line)
"""


def test_a_paused_reader_does_not_delay_signals(tmp_path: Path) -> None:
    # python -m guard job.py | less, with less paused: the guard's stdout pipe is full. A SIGTERM to the guard
    # still reaches the job at once; the output then continues when the reader reads again.
    ready, marker = tmp_path / "ready", tmp_path / "got-sigterm"
    script = tmp_path / "job.py"
    script.write_text(PRINTS_A_LOT.format(marker=str(marker), ready=str(ready)))
    proc = start_guard(["--no-preflight", "--grace", "5s", str(script)])
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(2.0)  # the pipe to us and the guard's buffer fill up: nobody reads stdout
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "the job did not get the SIGTERM while the guard's reader was paused"
        out, err = proc.communicate(timeout=60)
    finally:
        kill_quietly(proc)
    verdict = [line for line in out.splitlines() if line.startswith("VERDICT:")]
    assert verdict and verdict[-1].startswith("VERDICT: INTERRUPTED reason=signal"), err[-2000:]


FLOODS_BOTH = """\
import os, signal, sys, time
def on_term(signum, frame):
    with open({marker!r}, "w") as f:
        f.write(repr(time.time()))
    os._exit(143)
signal.signal(signal.SIGTERM, on_term)
open({ready!r}, "w").close()
line = "y" * 1023 + "\\n"
while True:
    sys.stderr.write(line)
    sys.stdout.write(line)
"""


def _flooding_job(tmp_path: Path) -> tuple[Path, Path, Path]:
    ready, marker = tmp_path / "ready", tmp_path / "got-sigterm"
    script = tmp_path / "job.py"
    script.write_text(FLOODS_BOTH.format(marker=str(marker), ready=str(ready)))
    return script, ready, marker


def _wait_for(path: Path, limit_s: float) -> bool:
    deadline = time.monotonic() + limit_s
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return path.exists()


def test_a_stderr_nobody_reads_delays_neither_the_deadline_nor_the_verdict(tmp_path: Path) -> None:
    # python -m guard train.py 2> a stuck log shipper: the guard's stderr pipe is full from the start (the job floods
    # it) and nobody ever reads it. The guard's own log lines must not block the loop: the deadline stops the job,
    # and the VERDICT comes on stdout (read all along), with the log lines it had to drop counted.
    script, ready, marker = _flooding_job(tmp_path)
    import subprocess

    from conftest import guard_env

    proc = subprocess.Popen([sys.executable, "-m", "guard", "--no-preflight", "--timeout", "8s", "--margin", "2s",
                             "--grace", "3s", str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=guard_env({"GUARD_LOG_LEVEL": "DEBUG"}), start_new_session=True)
    lines: list[bytes] = []
    started = time.monotonic()
    assert proc.stdout is not None

    def read_stdout() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            if raw.startswith(b"VERDICT:"):
                lines.append(raw)

    reader = threading.Thread(target=read_stdout, daemon=True)
    reader.start()
    try:
        assert _wait_for(ready, 60)
        reader.join(timeout=8 + 3 + 40)  # the budget, the grace, and room for a loaded machine
        elapsed_s = time.monotonic() - started
        assert lines, f"no VERDICT {elapsed_s:.0f}s after an 8s budget while stderr was not read"
        assert marker.exists(), "the deadline's SIGTERM never reached the job"
    finally:
        kill_quietly(proc)
    verdict = lines[-1].decode()
    assert verdict.startswith("VERDICT: TIMEOUT reason=deadline"), verdict
    assert "log_lines_dropped=" in verdict, verdict


def test_both_streams_paused_delay_no_signal(tmp_path: Path) -> None:
    # Neither stdout nor stderr is read (a reader stopped with SIGSTOP, a full pipe to a container runtime): a
    # SIGTERM to the guard reaches the job at once, and the VERDICT follows once the reader reads again.
    script, ready, marker = _flooding_job(tmp_path)
    proc = start_guard(["--no-preflight", "--grace", "5s", str(script)], env={"GUARD_LOG_LEVEL": "DEBUG"})
    try:
        assert _wait_for(ready, 60)
        time.sleep(2.0)  # both pipes to us and the guard's buffers fill up
        sent = time.time()
        proc.send_signal(signal.SIGTERM)
        assert _wait_for(marker, 15), "the job did not get the SIGTERM while both of the guard's readers paused"
        assert float(marker.read_text()) - sent < 10
        out, err = proc.communicate(timeout=60)
    finally:
        kill_quietly(proc)
    verdict = [line for line in out.splitlines() if line.startswith("VERDICT:")]
    assert verdict and verdict[-1].startswith("VERDICT: INTERRUPTED reason=signal"), err[-2000:]


def test_the_log_sink_drops_and_counts_what_a_paused_reader_cannot_take() -> None:
    import logging

    from guard.run.writer import LogSink, writer_for

    r, w = os.pipe()
    try:
        sink = LogSink(w)
        writer_for(w).limit_bytes = 1 << 16
        logger = logging.getLogger("guard.test.sink")
        logger.addHandler(sink)
        logger.propagate = False
        try:
            for i in range(5000):
                logger.warning("line %d %s", i, "z" * 200)  # returns at once: nobody reads
            assert sink.dropped > 0
            got = b""
            while writer_for(w).buffered_bytes or not got:
                writer_for(w).pump()
                got += os.read(r, 1 << 20)
            logger.warning("after")
            got += os.read(r, 1 << 20)
        finally:
            logger.removeHandler(sink)
        assert f"{sink.dropped} log lines dropped".encode() in got
        assert got.endswith(b"after\n")
        assert got.startswith(b"line 0 ")  # what was taken stays in order
    finally:
        os.close(r)
        os.close(w)


if sys.platform != "linux":  # pragma: no cover
    import pytest

    pytestmark = pytest.mark.skip("Linux pipes")


# ---------------------------------------------------------------------------------------------------------------
# scontrol and NVML on the helper thread
# ---------------------------------------------------------------------------------------------------------------


class _Blocking:
    """A stand-in for a slow call: blocks until ``release``; counts its calls."""

    def __init__(self, value: object) -> None:
        self.value = value
        self.release = threading.Event()
        self.calls = 0

    def __call__(self, *args: object, **kwargs: object) -> object:
        self.calls += 1
        self.release.wait(10)
        return self.value


def test_scontrol_runs_on_the_helper_thread() -> None:
    import subprocess

    from guard.run.slurm import SlurmRefresher

    out = "JobId=4242 StartTime=1800000000 EndTime=1800003600 TimeLimit=01:00:00\n"
    runner = _Blocking(subprocess.CompletedProcess(["scontrol"], 0, stdout=out, stderr=""))
    now = [0.0]
    refresher = SlurmRefresher("4242", runner=runner, interval_s=300, clock=lambda: now[0], environ={},
                               helpers=Helpers())
    assert refresher.maybe_refresh() is None  # started, not waited for
    assert refresher.maybe_refresh() is None  # still running: no second call
    runner.release.set()
    deadline = time.monotonic() + 10
    end = None
    while end is None and time.monotonic() < deadline:
        end = refresher.maybe_refresh()
        time.sleep(0.01)
    assert end == 1800003600.0
    assert runner.calls == 1


def test_heartbeat_reads_the_gpus_on_the_helper_thread() -> None:
    from guard.observe.telemetry import GPU_WAIT_S, GpuSample, Heartbeat, Snapshot

    class Gpus:
        reason = None

        def __init__(self) -> None:
            self.sample = _Blocking([GpuSample("gpu0", 97, 1 << 30, 2 << 30, 71)])

        def close(self) -> None:
            pass

    now = [0.0]
    gpus = Gpus()
    beat = Heartbeat(10.0, clock=lambda: now[0], wall=lambda: 1.8e9 + now[0], gpus=gpus,  # type: ignore[arg-type]
                     helpers=Helpers())
    now[0] = 10.0
    assert beat.tick(now[0], Snapshot()) is None  # the GPU read started; tick did not wait for it
    assert beat.due_at() == 10.0 + GPU_WAIT_S
    gpus.sample.release.set()
    deadline = time.monotonic() + 10
    while beat.due_at() > now[0] and time.monotonic() < deadline:  # done: due now
        time.sleep(0.01)
    line = beat.tick(now[0], Snapshot())
    assert line is not None and "gpu0=97%" in line
    assert beat.due_at() == 20.0
    # A read that does not finish in GPU_WAIT_S: the line comes without GPU figures.
    gpus.sample.release.clear()
    now[0] = 20.0
    assert beat.tick(now[0], Snapshot()) is None
    now[0] = 20.0 + GPU_WAIT_S
    line = beat.tick(now[0], Snapshot())
    assert line is not None and "gpu=n/a(no answer within" in line
    gpus.sample.release.set()
