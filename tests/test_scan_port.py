"""Securing's file system work off the loop (``guard.secure.scans``): a scan stuck in ``stat()`` (a hung NFS or
Lustre hard mount, stood in for by ``fakes.GatedStat`` through the ``stat=`` seam) holds up neither the deadline
nor a signal nor the VERDICT, and is never started a second time.

The calls run on a real helper thread (a ``Helpers`` of the test's own, so that a call left blocked holds up no
other test); the clock is a fake one. Every gate is released at the end of its test."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fakes import FakeClock, FakeLink, FakePusher, GatedStat, InlineFs

from guard.contract import RunResult
from guard.core.helpers import Helpers, wake_loop
from guard.core.state import Outcome
from guard.secure import intake as intake_module
from guard.secure.budget import Deadline, MarginEstimator
from guard.secure.securing import SCAN_EVERY_S, Securing
from guard.secure.waits import FS_WAIT_S

WAIT_S = 30.0  # a bound on how long the helper thread may take to answer (never reached when things work)


def save(out: Path, step: int, size_bytes: int = 1000) -> Path:
    folder = out / f"checkpoint-{step}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.safetensors").write_bytes(b"0" * size_bytes)
    (folder / "guard_checkpoint.json").write_text("{}")
    for path in folder.iterdir():  # settled: written a minute ago (the scans' mtime rule)
        os.utime(path, (time.time() - 60.0, time.time() - 60.0))
    return folder


@pytest.fixture
def gate(tmp_path: Path) -> Iterator[GatedStat]:
    gated = GatedStat(tmp_path / "out")
    yield gated
    gated.release()


class Rig:
    """Securing around a fake loop, its file system calls on a real thread, its stat through ``stat``."""

    def __init__(self, tmp_path: Path, *, stat: Any = None, fs: Any = None, timeout_s: float | None = 100.0,
                 **link: Any) -> None:
        self.clock = FakeClock(1000.0)
        self.wall_start = time.time()
        self.out = tmp_path / "out"
        self.out.mkdir(exist_ok=True)
        self.pusher = FakePusher(self.clock)
        self.fs = fs if fs is not None else Helpers(wake_loop, name="test-fs")
        deadline = (Deadline(self.wall_start, timeout_s, self.wall_start + timeout_s, "--timeout") if timeout_s
                    else Deadline(self.wall_start, None, None, "none"))
        self.securing = Securing(deadline=deadline, estimator=MarginEstimator(fixed_margin_s=30.0, log_changes=False),
                                 securer=SimpleNamespace(destination="alice/run", token=None),  # type: ignore[arg-type]
                                 output_dir=str(self.out), clock=self.clock,
                                 wall=lambda: self.wall_start + (self.clock.now - 1000.0), grace_s=30.0,
                                 pusher_factory=lambda dest, token: self.pusher, fs=self.fs, stat=stat)
        self.link = FakeLink(**link)

    def tick(self, seconds: float = 0.0) -> None:
        self.clock.advance(seconds)
        self.securing.tick(self.link, self.clock.now)

    def run_for(self, seconds: float, every_s: float = 0.5) -> None:
        end = self.clock.now + seconds
        while self.clock.now < end:
            self.tick(every_s)

    def answered(self) -> None:
        """Turn (without moving the clock) until every file system call was handed back."""
        end = time.monotonic() + WAIT_S
        while self.securing.port.in_flight:
            assert time.monotonic() < end, "the file system thread did not answer"
            time.sleep(0.01)
            self.tick()


def test_a_scan_stuck_in_stat_leaves_the_deadline_and_the_verdict_alone(tmp_path: Path, gate: GatedStat) -> None:
    rig = Rig(tmp_path, stat=gate)
    save(rig.out, 3)
    rig.link.state.progress.step = 3
    rig.link.state.facts.api_used.add("should_checkpoint")  # the job answers checkpoint requests
    rig.tick()
    assert gate.entered.wait(WAIT_S), "the first scan reached the stat"
    rig.run_for(69.0)  # 13 more scans were due meanwhile
    assert gate.blocked == 1 and rig.securing.port.in_flight == 1, "a scan in flight is never started again"
    assert rig.link.state.outcome is None
    rig.run_for(2.0)  # past deadline - margin: decided, asked, stopped, as with a folder that answers
    assert rig.link.state.outcome is not None and rig.link.state.outcome.reason == "deadline"
    assert rig.link.sent == [{"t": "checkpoint", "stop": True, "trigger": "deadline"}] and rig.link.stops
    rig.link.exit(-signal.SIGTERM)  # stopped before the deadline
    rig.securing.on_job_exit(rig.link, rig.clock.now)
    assert rig.securing.busy(), "the job's end waits for a fresh scan"
    rig.run_for(FS_WAIT_S + 1.0)
    assert not rig.securing.busy(), "and goes on without it after FS_WAIT_S"
    result = RunResult("TIMEOUT", "deadline", 0, 75.0)
    rig.securing.finish(result, step=3)
    assert (result.status, result.extra["secured"]) == ("TIMEOUT", "no")
    assert gate.blocked == 1


def test_a_signal_is_handled_while_a_scan_is_stuck(tmp_path: Path, gate: GatedStat) -> None:
    rig = Rig(tmp_path, stat=gate, timeout_s=None)
    save(rig.out, 3)
    rig.link.state.progress.step = 40  # a plain loop: cannot be asked for a checkpoint
    rig.tick()
    assert gate.entered.wait(WAIT_S)
    assert rig.securing.on_signal(rig.link, signal.SIGTERM, rig.clock.now)
    assert rig.link.signals == [signal.SIGTERM], "forwarded to the job at once"
    assert rig.link.state.outcome is not None and rig.link.state.outcome.status == "INTERRUPTED"
    rig.run_for(40.0)  # past --grace: securing ran out of time, nothing found (the folder never answered)
    assert not rig.securing.plan.busy
    rig.link.exit(-signal.SIGTERM)
    rig.securing.on_job_exit(rig.link, rig.clock.now)
    rig.run_for(FS_WAIT_S + 1.0)
    assert not rig.securing.busy()
    result = RunResult("INTERRUPTED", "signal", 143, 40.0)
    rig.securing.finish(result, step=40)
    assert result.status == "INTERRUPTED" and result.extra["secured"] == "no"


def test_once_the_folder_answers_again_its_checkpoint_is_secured(tmp_path: Path, gate: GatedStat) -> None:
    rig = Rig(tmp_path, stat=gate, timeout_s=None)
    save(rig.out, 3)
    rig.tick()
    assert gate.entered.wait(WAIT_S)
    rig.run_for(12.0)
    assert rig.pusher.started == []
    gate.release()
    rig.answered()  # the stuck scan's answer, handed back on a later turn
    assert [h.args["step"] for h in rig.pusher.started] == [3]
    rig.run_for(SCAN_EVERY_S + 0.5)
    assert gate.blocked == 1


def test_a_failure_waits_for_a_fresh_scan_at_most_fs_wait_s(tmp_path: Path, gate: GatedStat,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    rig = Rig(tmp_path, stat=gate, timeout_s=None)
    save(rig.out, 3)
    rig.link.state.progress.step = 5
    rig.link.exit(1)
    with caplog.at_level(logging.WARNING, logger="guard.secure"):
        rig.securing.on_decided(rig.link, Outcome("FAIL", "crash", 1))
        assert gate.entered.wait(WAIT_S)
        assert rig.securing.busy() and rig.securing.plan.report().failure_reason is None
        rig.run_for(FS_WAIT_S + 0.5)
    assert rig.securing.plan.report().failure_reason == "crash" and not rig.securing.busy()
    assert "did not answer within" in caplog.text
    assert rig.pusher.started == []


def test_a_crash_right_after_a_save_secures_it_once_the_fresh_scan_answers(tmp_path: Path) -> None:
    rig = Rig(tmp_path, timeout_s=None)
    rig.tick()
    rig.answered()  # the first scan: an empty folder
    save(rig.out, 7)  # saved since: only a fresh scan sees it
    rig.link.state.progress.step = 8
    rig.link.exit(1)
    rig.securing.on_decided(rig.link, Outcome("FAIL", "crash", 1))
    rig.answered()
    assert [h.args["step"] for h in rig.pusher.started] == [7]
    assert rig.securing.plan.report().failure_reason == "crash"


def test_reported_saves_are_handed_back_in_the_order_they_came(tmp_path: Path) -> None:
    rig = Rig(tmp_path, timeout_s=None, ranks={0: 20})
    for step in (10, 20):
        path = save(rig.out, step)
        rig.securing.on_checkpoint_saved(rig.link, {"t": "checkpoint_saved", "path": str(path), "step": step,
                                                    "rank": 0, "zero": True})
    rig.answered()
    assert rig.securing.intake.latest_reported is not None and rig.securing.intake.latest_reported.step == 20
    assert rig.securing.plan.report().newest is not None and rig.securing.plan.report().newest.step == 20


def test_a_rewritten_loose_file_is_not_taken_for_the_older_save(tmp_path: Path) -> None:
    """The plan's ``unchanged`` answered on the loop: ``ckpt.pt`` saved again (a later, newer save of the same
    file) leaves no older checkpoint to fall back to after a non-finite loss."""
    rig = Rig(tmp_path, fs=InlineFs(), timeout_s=None, ranks={0: 20})
    rig.pusher.rate = lambda now: 1.0  # the background push of step 10 never ends: no verified copy to fall back to
    ckpt = rig.out / "ckpt.pt"
    for step in (10, 20):
        ckpt.write_bytes(b"0" * (100 + step))
        stamp = rig.wall_start + step
        os.utime(ckpt, (stamp, stamp))
        rig.securing.on_file_saved(rig.link, {"t": "file_saved", "path": str(ckpt), "step": step, "rank": 0})
        rig.tick(FILE_SETTLE)
    rig.securing.on_taint(rig.link, 15)  # step 20's save is suspect; step 10's was overwritten by it
    report = rig.securing.plan.report()
    assert report.suspect is not None and report.suspect.step == 20
    assert report.newest is None


FILE_SETTLE = intake_module.FILE_SETTLE_S + 0.1


def supervised(tmp_path: Path, gate: GatedStat, monkeypatch: pytest.MonkeyPatch, *options: str) -> Any:
    """The real Supervisor (fake clock, fake spawner, the test's agent) around a Securing whose stat is ``gate``."""
    from test_supervisor import Harness

    from guard.run import start as start_module

    monkeypatch.setattr(start_module, "set_subreaper", lambda: False)
    out = tmp_path / "out"
    save(out, 3)
    clock = FakeClock(1000.0)
    wall_start = time.time()
    pusher = FakePusher(clock)
    securing = Securing(deadline=Deadline(wall_start, 100.0, wall_start + 100.0, "--timeout"),
                        estimator=MarginEstimator(fixed_margin_s=30.0, log_changes=False),
                        securer=SimpleNamespace(destination="alice/run", token=None),  # type: ignore[arg-type]
                        output_dir=str(out), clock=clock, wall=lambda: wall_start + (clock.now - 1000.0),
                        pusher_factory=lambda dest, token: pusher, fs=Helpers(wake_loop, name="test-fs"), stat=gate)
    run = Harness(tmp_path, "--timeout", "100s", "--grace", "5s", *options, securer=securing, clock=clock)
    run.pusher, run.out = pusher, out
    return run


def finished(run: Any) -> RunResult:
    """Move the fake clock on until the supervisor ends (securing's bounds end it: the folder never answers)."""
    done = threading.Event()
    threading.Thread(target=lambda: (run._thread.join(WAIT_S), done.set()), daemon=True).start()
    end = time.monotonic() + WAIT_S
    while not done.is_set():
        assert time.monotonic() < end, "the supervisor did not end"
        run.advance(1.0)
        time.sleep(0.05)
    result: RunResult = run.finish()
    return result


def test_the_supervisor_loop_turns_on_while_a_scan_is_stuck(tmp_path: Path, gate: GatedStat,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The scan is stuck in stat(): the deadline's request reaches the agent, a signal is handled, the job's end
    and the VERDICT come."""
    run = supervised(tmp_path, gate, monkeypatch)
    try:
        agent = run.agent(rank=0, world_size=1)
        agent.send("api", name="should_checkpoint")
        agent.send("step", step=3, loss=1.0, finite=True, source="backward", n=1)
        run.wait_until(lambda: run.sup.state.progress.step == 3, "step 3")
        assert gate.entered.wait(WAIT_S), "the scan is stuck in stat()"
        run.advance(71.0)  # past deadline - margin
        assert agent.receive("checkpoint")["stop"] is True
        agent.send("checkpoint_saved", path=str(run.out / "checkpoint-3"), step=3, save_s=0.1)  # queued behind it
        run.sup.signals.append(signal.SIGTERM)  # what the handler does
        run.wait_until(lambda: run.sup.escalation.started or run.sup.link.stop_at is not None, "the job's stop")
        run.job.exit(143)  # stopped by the guard's SIGTERM
        run.wait_until(lambda: run.sup.upkeep.exited_at is not None, "the job's exit")
        result = finished(run)
        assert (result.status, result.reason) == ("TIMEOUT", "deadline")
        assert result.extra["secured"] == "no"
        assert gate.blocked == 1 and run.pusher.started == []
    finally:
        gate.release()
        run.job.cleanup()


def test_a_stall_is_decided_while_a_scan_is_stuck(tmp_path: Path, gate: GatedStat,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The stall watch, its stack dump (on the other helper thread) and the stop go on while the scan is stuck."""
    run = supervised(tmp_path, gate, monkeypatch, "--stall-timeout", "60s")
    try:
        agent = run.agent(rank=0, world_size=1)
        agent.send("step", step=1, loss=2.0, finite=True, source="trainer", n=1)
        run.wait_until(lambda: run.sup.state.progress.step == 1, "the first step")
        assert gate.entered.wait(WAIT_S), "the scan is stuck in stat()"
        run.advance(61.0)
        assert agent.receive("dump") == {"t": "dump"}
        run.advance(1.0)  # the agents had their moment to print stacks
        assert agent.receive("stop") == {"t": "stop"}
        result = finished(run)
        assert (result.status, result.reason, result.exit_code) == ("FAIL", "stalled", 5)
        assert gate.blocked == 1
    finally:
        gate.release()
        run.job.cleanup()
