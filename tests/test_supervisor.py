"""The supervisor's loop driven from the test: a fake clock, a fake spawner whose job output is an ``os.pipe()`` the
test writes to, and an agent socket the test connects to. No training process runs: a ``sh`` that waits for its
exit code on stdin stands in for the job's process (a real pid, so that waiting and signals are real)."""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import psutil
import pytest
from fakes import FakeClock, FakePusher

from guard import protocol
from guard.contract import RunResult
from guard.core.masking import Masker
from guard.run import start as start_module
from guard.run.cli import build_config
from guard.run.supervisor import Supervisor

WAIT_S = 30.0  # a bound on how long the loop may take to react (the loop wakes at least once a second)


class FakeJob:
    """A ``subprocess.Popen`` stand-in: ``stdout``/``stderr`` are pipes whose write ends the test holds."""

    def __init__(self) -> None:
        self.env: dict[str, str] = {}
        self.argv: list[str] = []
        self.returncode: int | None = None
        self.started = threading.Event()
        self._lock = threading.Lock()
        self.out_w = self.err_w = -1

    def __call__(self, argv: list[str], *, env: Mapping[str, str], **kwargs: Any) -> FakeJob:
        self.argv, self.env = list(argv), dict(env)
        assert kwargs["start_new_session"] and kwargs["stdout"] == subprocess.PIPE
        out_r, self.out_w = os.pipe()
        err_r, self.err_w = os.pipe()
        self.stdout, self.stderr = os.fdopen(out_r, "rb", buffering=0), os.fdopen(err_r, "rb", buffering=0)
        self._sh = subprocess.Popen(["sh", "-c", "read code; exit $code"], stdin=subprocess.PIPE,
                                    start_new_session=True)
        self.pid = self._sh.pid
        threading.Thread(target=self._close_when_gone, daemon=True).start()
        self.started.set()
        return self

    def _close_when_gone(self) -> None:
        """A dead process's pipes close: so do the stand-in's, once the ``sh`` is gone (a signal, its exit)."""
        while True:
            try:
                if psutil.Process(self.pid).status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.Error:
                break
            time.sleep(0.02)
        self.close_output()

    def print(self, text: str, *, err: bool = False) -> None:
        os.write(self.err_w if err else self.out_w, text.encode())

    def close_output(self) -> None:
        with self._lock:
            for fd in (self.out_w, self.err_w):
                if fd >= 0:
                    os.close(fd)
            self.out_w = self.err_w = -1

    def exit(self, code: int) -> None:
        """The job ends with ``code``: its output closes, then its process exits."""
        self.close_output()
        assert self._sh.stdin is not None
        try:
            self._sh.stdin.write(f"{code}\n".encode())
            self._sh.stdin.close()
        except OSError:  # already gone (a signal)
            pass

    def cleanup(self) -> None:
        self.close_output()
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._sh.returncode = 0  # the supervisor reaped it; keep Popen's destructor quiet
        for stream in (self._sh.stdin, self.stdout, self.stderr):
            if stream is not None:
                stream.close()


class FakeAgent:
    """An agent's end of the channel, connected from the test."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.connect(path)
        self.sock.settimeout(WAIT_S)

    def send(self, kind: str, **fields: Any) -> None:
        self.sock.send(protocol.encode({"t": kind, **fields}))

    def receive(self, kind: str) -> dict[str, Any]:
        """The next message of type ``kind`` from the supervisor (others are skipped)."""
        while True:
            message = protocol.decode(self.sock.recv(protocol.MAX_MESSAGE_BYTES))
            if message is not None and message["t"] == kind:
                return message


class Harness:
    """One supervisor run on a thread (no signal handlers there: the loop reads ``signals`` all the same)."""

    def __init__(self, tmp_path: Path, *options: str, secrets: tuple[str, ...] = (), clock: FakeClock | None = None,
                 **kwargs: Any) -> None:
        config = build_config(["--no-preflight", *options, "--", "true", "--lr", "1e-4"], dict(os.environ))
        self.clock = clock or FakeClock(1000.0)
        self.job = FakeJob()
        self.out_path = tmp_path / "guard-out.log"
        self._out = os.open(self.out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        self.sup = Supervisor(config, masker=Masker(secrets), clock=self.clock, spawner=self.job, out_fd=self._out,
                              err_fd=self._out, **kwargs)
        self.result: RunResult | None = None
        self.error: BaseException | None = None
        # The loop never turns without waiting: after its timers ran at ``now``, the next due time is later (a
        # time already passed would make the loop spin on one core, select(0) after select(0)); every test checks.
        self.past_due: list[tuple[float, float]] = []
        next_due = self.sup._next_due

        def checked_next_due(now: float) -> float:
            due = next_due(now)
            if due <= now:
                self.past_due.append((now, due))
            return due

        self.sup._next_due = checked_next_due  # type: ignore[method-assign]
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self.job.started.wait(WAIT_S)

    def _run(self) -> None:
        try:
            self.result = self.sup.run()
        except BaseException as exc:
            self.error = exc

    def agent(self, **hello: Any) -> FakeAgent:
        agent = FakeAgent(self.job.env[protocol.ENV_SOCKET])
        agent.send("hello", pid=12345, **hello)
        return agent

    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    def wait_until(self, condition: Callable[[], bool], what: str) -> None:
        end = time.monotonic() + WAIT_S
        while not condition():
            assert time.monotonic() < end, f"the loop did not get there: {what}"
            time.sleep(0.02)

    def finish(self) -> RunResult:
        self._thread.join(WAIT_S)
        assert not self._thread.is_alive(), "the supervisor did not end"
        os.close(self._out)
        if self.error is not None:
            raise self.error
        assert self.result is not None
        assert not self.past_due, f"the loop's next due time had passed after its timers: {self.past_due[:5]}"
        return self.result

    def output(self) -> str:
        return self.out_path.read_text()


@pytest.fixture
def harness(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Harness]]:
    monkeypatch.setattr(start_module, "set_subreaper", lambda: False)  # not for the test process
    made: list[Harness] = []

    def make(*options: str, **kwargs: Any) -> Harness:
        made.append(Harness(tmp_path, *options, **kwargs))
        return made[-1]

    yield make
    for run in made:
        run.job.cleanup()


def test_the_job_gets_the_socket_the_agent_and_its_settings(harness: Callable[..., Harness]) -> None:
    run = harness("--sanity-steps", "4", "--check-every", "7")
    env = run.job.env
    assert run.job.argv == ["true", "--lr", "1e-4"]  # never run: the fake spawner stands in
    assert os.path.exists(env[protocol.ENV_SOCKET])
    assert env["PYTHONPATH"].split(os.pathsep)[0].endswith(os.path.join("inside", "_site"))
    assert (env[protocol.ENV_SANITY_STEPS], env[protocol.ENV_CHECK_EVERY]) == ("4", "7")
    run.job.exit(0)
    run.finish()


def test_printed_losses_pass_the_sanity_check_and_output_is_masked(harness: Callable[..., Harness]) -> None:
    run = harness("--sanity-steps", "3", secrets=("hf_SECRETSECRET",))
    run.job.print("token hf_SECRETSECRET\n")
    for step in range(1, 5):
        run.job.print(f"step {step} loss={3.0 - step / 10:.2f}\n")
    run.job.print("no newline at the end", err=True)
    run.wait_until(lambda: run.sup.state.progress.step == 4, "four printed steps")
    run.job.exit(0)
    result = run.finish()
    assert (result.status, result.reason, result.exit_code) == ("PASS", "ok", 0)
    assert result.step == 4 and result.sanity == [2.9, 2.8, 2.7]
    assert result.details["loss_source"] == "output" and result.details["sanity_status"] == "passed"
    out = run.output()
    assert "hf_SECRETSECRET" not in out and "token ***" in out and "no newline at the end" in out


def test_a_nan_from_the_agent_stops_the_job_and_stands(harness: Callable[..., Harness]) -> None:
    run = harness()
    agent = run.agent(rank=None)
    agent.send("watching", what="torch")
    agent.send("step", step=1, loss=2.5, finite=True, source="backward", n=1)
    agent.send("step", step=2, loss=None, finite=False, source="backward", n=1)
    assert agent.receive("stop") == {"t": "stop"}
    run.job.print("loss=nan\n")  # printed after an agent watches: does not decide
    result = run.finish()  # the SIGTERM ended the stand-in
    assert (result.status, result.reason, result.exit_code) == ("FAIL", "non_finite_loss", 4)
    assert result.step == 2 and result.loss is not None and math.isnan(result.loss)
    assert result.details["job_signal"] == "SIGTERM" and result.details["loss_source"] == "agent"


def test_a_stall_asks_for_stacks_then_stops_the_job(harness: Callable[..., Harness]) -> None:
    run = harness("--stall-timeout", "60s")
    agent = run.agent(rank=0, world_size=1)
    agent.send("step", step=1, loss=2.0, finite=True, source="trainer", n=1)
    run.wait_until(lambda: run.sup.state.progress.step == 1, "the first step")
    run.advance(61.0)
    assert agent.receive("dump") == {"t": "dump"}
    agent.send("progress", begun=2, step=1, where="recv (socket.py:700)")
    run.wait_until(lambda: run.sup.state.facts.hang_where is not None, "the stack answer")
    run.advance(1.0)  # the agents had their moment to print stacks
    assert agent.receive("stop") == {"t": "stop"}
    result = run.finish()
    assert (result.status, result.reason, result.exit_code) == ("FAIL", "stalled", 5)
    assert result.hint is not None and result.hint.startswith("the main thread waits in recv (socket.py:700)")


def test_a_silent_rank_is_named_while_the_other_goes_on(harness: Callable[..., Harness]) -> None:
    run = harness("--stall-timeout", "30s")
    rank0, rank1 = run.agent(rank=0, world_size=2), run.agent(rank=1, world_size=2)
    for agent in (rank0, rank1):
        agent.send("step", step=1, loss=2.0, finite=True, source="backward", n=1)
    run.wait_until(lambda: run.sup.link.training_ranks() == {0, 1}, "both ranks' steps")
    for step in range(2, 6):  # rank 1 goes on, rank 0 is silent
        run.advance(10.0)
        rank1.send("step", step=step, loss=2.0, finite=True, source="backward", n=1)
        run.wait_until(lambda s=step: run.sup.link.newest_rank_step() == s, f"rank 1 at step {step}")
    assert rank0.receive("dump") == {"t": "dump"}
    run.advance(1.0)
    result = run.finish()
    assert (result.reason, result.extra.get("rank")) == ("stalled", 0)


def test_a_failing_trainer_setting_stops_before_training(harness: Callable[..., Harness]) -> None:
    from guard.preflight._models import CheckResult

    def check(config: Mapping[str, Any]) -> list[CheckResult]:
        if config.get("save_strategy") == "no":
            return [CheckResult("save", "fail", "save_strategy=no", hint="save checkpoints")]
        return [CheckResult("save", "pass", "steps")]

    run = harness(trainer_config_check=check)
    agent = run.agent(rank=0)
    agent.send("training_args", config={"save_strategy": "steps", "output_dir": "out"})
    assert agent.receive("ack") == {"t": "ack"}
    agent.send("trainer_config", config={"save_strategy": "no", "output_dir": "out", "max_steps": 10})
    assert agent.receive("stop") == {"t": "stop"}
    result = run.finish()
    assert (result.status, result.reason, result.exit_code) == ("FAIL", "preflight", 3)
    assert result.extra["check"] == "save" and result.hint == "save checkpoints"
    assert result.details["trainer_config"]["max_steps"] == 10


def test_a_crash_names_the_root_exception(harness: Callable[..., Harness]) -> None:
    run = harness()
    agent = run.agent()
    agent.send("exception", exc_type="RuntimeError", message="DataLoader worker (pid 9) exited",
               root="OSError: [Errno 28] No space left on device")
    run.wait_until(lambda: run.sup.state.facts.last_exception is not None, "the exception")
    run.job.exit(1)
    result = run.finish()
    assert (result.status, result.reason, result.exit_code) == ("FAIL", "crash", 1)
    assert result.hint is not None and result.hint.startswith("the disk is full (OSError: [Errno 28]")


def test_an_exit_0_after_train_raised_is_incomplete(harness: Callable[..., Harness]) -> None:
    run = harness()
    agent = run.agent(rank=0)
    agent.send("train_error", exc_type="ValueError", message="bad batch", root=None, step=3, max_steps=10)
    run.wait_until(lambda: run.sup.state.facts.train_error is not None, "train_error")
    run.job.exit(0)
    result = run.finish()
    assert (result.status, result.reason, result.exit_code) == ("FAIL", "incomplete", 7)
    assert "ValueError: bad batch at step 3 of 10" in (result.hint or "")


def test_a_signal_to_the_guard_is_forwarded_and_interrupts(harness: Callable[..., Harness]) -> None:
    run = harness("--grace", "5s")
    agent = run.agent()
    agent.send("step", step=1, loss=1.0, finite=True, source="backward", n=1)
    run.wait_until(lambda: run.sup.state.progress.step == 1, "the first step")
    run.sup.signals.append(signal.SIGTERM)  # what the handler does; the loop acts on its next turn
    result = run.finish()
    assert (result.status, result.reason, result.exit_code) == ("INTERRUPTED", "signal", 143)
    assert result.extra["signal"] == "SIGTERM" and result.details["job_signal"] == "SIGTERM"


def test_the_deadline_asks_for_a_checkpoint_and_pushes_it(harness: Callable[..., Harness],
                                                        tmp_path: Path) -> None:
    from types import SimpleNamespace

    from guard.secure.budget import Deadline, MarginEstimator
    from guard.secure.securing import Securing

    out = tmp_path / "out"
    (out / "checkpoint-3").mkdir(parents=True)
    (out / "checkpoint-3" / "model.safetensors").write_bytes(b"0" * 1000)
    clock = FakeClock(1000.0)
    wall_start = time.time()
    pusher = FakePusher(clock)
    securing = Securing(deadline=Deadline(wall_start, 100.0, wall_start + 100.0, "--timeout"),
                        estimator=MarginEstimator(fixed_margin_s=30.0, log_changes=False),
                        securer=SimpleNamespace(destination="alice/run", token=None),  # type: ignore[arg-type]
                        output_dir=str(out), clock=clock, wall=lambda: wall_start + (clock.now - 1000.0),
                        pusher_factory=lambda dest, token: pusher)
    run = harness("--timeout", "100s", securer=securing, clock=clock)  # one clock for the loop and securing
    agent = run.agent(rank=0, world_size=1)
    agent.send("trainer_config", config={"output_dir": str(out), "save_strategy": "steps", "max_steps": 100})
    agent.send("step", step=3, loss=1.0, finite=True, source="trainer", n=1)
    run.wait_until(lambda: run.sup.state.progress.step == 3, "step 3")
    run.advance(71.0)  # past deadline - margin
    request = agent.receive("checkpoint")
    assert request["stop"] is True
    agent.send("checkpoint_saved", path=str(out / "checkpoint-3"), step=3, save_s=0.5)
    run.wait_until(lambda: bool(pusher.started), "the push")
    run.advance(5.0)
    run.wait_until(lambda: bool(pusher.ended), "the push's end")
    run.job.exit(0)
    result = run.finish()
    assert (result.status, result.reason, result.exit_code) == ("TIMEOUT", "deadline", 75)
    assert result.extra["secured"] == "yes" and result.extra["checkpoint"] == str(out / "checkpoint-3")
    assert pusher.started[0].op == "push_checkpoint" and pusher.started[0].args["step"] == 3


def test_the_loop_waits_while_a_push_outlives_the_job(harness: Callable[..., Harness], tmp_path: Path) -> None:
    # The job exits while the deadline's push is still running: the loop goes on for the push (securing is busy)
    # past the drain time, and waits between its turns (past_due, checked in finish), as it does for the whole of
    # a final model's push. It used to find the drain's end and a memory sample of the exited job always due: a
    # busy loop on one core for as long as the push ran (19 s of CPU in a 45 s run whose push hung on Xet).
    from types import SimpleNamespace

    from guard.secure.budget import Deadline, MarginEstimator
    from guard.secure.securing import Securing

    out = tmp_path / "out"
    (out / "checkpoint-3").mkdir(parents=True)
    (out / "checkpoint-3" / "model.safetensors").write_bytes(b"0" * 1000)
    clock = FakeClock(1000.0)
    wall_start = time.time()
    pusher = FakePusher(clock, overhead_s=20.0)
    securing = Securing(deadline=Deadline(wall_start, 100.0, wall_start + 100.0, "--timeout"),
                        estimator=MarginEstimator(fixed_margin_s=40.0, log_changes=False),
                        securer=SimpleNamespace(destination="alice/run", token=None),  # type: ignore[arg-type]
                        output_dir=str(out), clock=clock, wall=lambda: wall_start + (clock.now - 1000.0),
                        pusher_factory=lambda dest, token: pusher)
    run = harness("--timeout", "100s", securer=securing, clock=clock)
    agent = run.agent(rank=0, world_size=1)
    agent.send("trainer_config", config={"output_dir": str(out), "save_strategy": "steps", "max_steps": 100})
    agent.send("step", step=3, loss=1.0, finite=True, source="trainer", n=1)
    run.wait_until(lambda: run.sup.state.progress.step == 3, "step 3")
    run.advance(61.0)  # past deadline - margin
    agent.receive("checkpoint")
    agent.send("checkpoint_saved", path=str(out / "checkpoint-3"), step=3, save_s=0.5)
    run.wait_until(lambda: bool(pusher.started), "the push")
    run.job.exit(0)
    run.wait_until(lambda: run.sup.upkeep.exited_at is not None, "the job's exit")
    for _ in range(4):  # past the drain time and its wait, the push still running
        run.advance(1.0)
        time.sleep(0.2)  # the loop turns at least once a second of real time
    assert not pusher.ended and run.sup.upkeep.securing()
    assert not run.past_due, run.past_due[:5]
    run.advance(20.0)
    result = run.finish()
    assert result.extra["secured"] == "yes" and pusher.ended
