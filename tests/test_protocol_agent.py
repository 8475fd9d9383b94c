"""Tests for ``guard.protocol`` and the in-job agent (``guard.inside.agent``).

``LossWatch``, the socket client, the API.
"""

from __future__ import annotations

import math
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import guard
from guard import protocol
from guard.inside.agent import Agent, LossWatch
from guard.inside.agent import _core as agent_module
from guard.inside.settings import AgentSettings

# ---------------------------------------------------------------------------------------------------------------
# protocol
# ---------------------------------------------------------------------------------------------------------------


def test_encode_decode_round_trip() -> None:
    message = {"t": "step", "step": 3, "loss": 2.5, "finite": True, "n": 1, "source": "backward", "x": "é"}
    data = protocol.encode(message)
    assert isinstance(data, bytes)
    assert b" " not in data  # compact
    assert protocol.decode(data) == message


def test_non_finite_losses_travel() -> None:
    decoded = protocol.decode(protocol.encode({"t": "step", "loss": math.nan, "other": -math.inf}))
    assert decoded is not None
    assert math.isnan(decoded["loss"]) and decoded["other"] == -math.inf


def test_unknown_objects_become_text() -> None:
    decoded = protocol.decode(protocol.encode({"t": "checkpoint_saved", "path": Path("/a/b")}))
    assert decoded == {"t": "checkpoint_saved", "path": "/a/b"}


@pytest.mark.parametrize("data", [b"", b"not json", b"\xff\xfe", b"[1, 2]", b'"t"', b'{"x": 1}', b'{"t": 5}',
                                  b'{"t": null}'])
def test_decode_refuses_what_is_not_a_message(data: bytes) -> None:
    assert protocol.decode(data) is None


# ---------------------------------------------------------------------------------------------------------------
# LossWatch with a fake agent
# ---------------------------------------------------------------------------------------------------------------


class FakeAgent:
    """Records what ``LossWatch`` sends; ``send`` succeeds unless ``ok`` is False."""

    def __init__(self, ok: bool = True) -> None:
        self.sent: list[dict[str, Any]] = []
        self.waits = 0
        self.ok = ok

    def send(self, message: dict[str, Any]) -> bool:
        self.sent.append(message)
        return self.ok

    def wait_stop(self) -> None:
        self.waits += 1


def _steps(fake: FakeAgent) -> list[tuple[int, int, bool]]:
    return [(m["step"], m["n"], m["finite"]) for m in fake.sent]


def test_float_losses_one_by_one_in_the_sanity_pass_then_every_check_every() -> None:
    fake = FakeAgent()
    watch = LossWatch(fake, sanity_steps=3, check_every=4)  # type: ignore[arg-type]
    for step in range(1, 12):
        watch.observe(10.0 - step, None, "report")
    assert _steps(fake) == [(1, 1, True), (2, 1, True), (3, 1, True), (7, 4, True), (11, 4, True)]
    assert [m["loss"] for m in fake.sent] == [9.0, 8.0, 7.0, 3.0, -1.0]
    assert {m["source"] for m in fake.sent} == {"report"}
    assert {m["t"] for m in fake.sent} == {"step"}
    assert fake.waits == 0


def test_explicit_steps_are_kept() -> None:
    fake = FakeAgent()
    watch = LossWatch(fake, sanity_steps=2, check_every=2)  # type: ignore[arg-type]
    for step in (100, 200, 300, 400):
        watch.observe(1.0, step, "trainer")
    assert [m["step"] for m in fake.sent] == [100, 200, 400]
    assert watch.step == 400


def test_a_float_nan_between_checks_is_sent_at_once_and_waits_for_the_stop() -> None:
    fake = FakeAgent()
    watch = LossWatch(fake, sanity_steps=2, check_every=10)  # type: ignore[arg-type]
    for step in range(1, 6):
        watch.observe(math.nan if step == 5 else 1.0, None, "report")
    assert _steps(fake) == [(1, 1, True), (2, 1, True), (5, 1, False)]  # the bad step itself
    assert math.isnan(fake.sent[-1]["loss"])
    assert fake.waits == 1


def test_a_nan_in_the_sanity_pass_is_sent_with_its_step() -> None:
    fake = FakeAgent()
    watch = LossWatch(fake, sanity_steps=5, check_every=10)  # type: ignore[arg-type]
    watch.observe(1.0, None, "backward")
    watch.observe(math.inf, None, "backward")
    assert _steps(fake) == [(1, 1, True), (2, 1, False)]
    assert fake.waits == 1


def test_no_wait_when_the_message_was_not_sent() -> None:
    fake = FakeAgent(ok=False)
    watch = LossWatch(fake, sanity_steps=1, check_every=10)  # type: ignore[arg-type]
    watch.observe(math.nan, None, "report")
    assert fake.waits == 0


def test_flush_sends_what_is_pending_and_nothing_twice() -> None:
    fake = FakeAgent()
    watch = LossWatch(fake, sanity_steps=1, check_every=10)  # type: ignore[arg-type]
    for _ in range(4):
        watch.observe(2.0, None, "report")
    watch.flush("report")
    watch.flush("report")
    assert _steps(fake) == [(1, 1, True), (4, 3, True)]


try:
    import torch
except ImportError:  # the tests that need tensors are skipped
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")


@pytest.fixture
def syncs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Counts every way a tensor's value reaches the host (``item``, ``float()``, ``bool()``, ``tolist``). The
    tensors stand for a device's (a GPU's): ``is_cpu`` is False, so the agent treats them as one's, where reading a
    value is a host-device sync (a CPU tensor's loss is read at its step: there is nothing to sync)."""
    calls: list[str] = []
    monkeypatch.setattr(torch.Tensor, "is_cpu", property(lambda self: False))
    for name in ("item", "__float__", "__bool__", "tolist", "__int__", "numpy"):
        original = getattr(torch.Tensor, name)

        def counted(self: Any, *args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
            calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return calls


@needs_torch
def test_tensor_losses_have_no_host_sync_per_step_after_the_sanity_pass(syncs: list[str]) -> None:
    fake = FakeAgent()
    sanity, every = 3, 10
    watch = LossWatch(fake, sanity_steps=sanity, check_every=every)  # type: ignore[arg-type]
    per_step = []
    for step in range(1, 44):
        before = len(syncs)
        watch.observe(torch.tensor(5.0 - step * 0.01, requires_grad=True) * 1.0, None, "backward")
        per_step.append(len(syncs) - before)
    flush_steps = {sanity + every * k for k in range(1, 5)}  # 13, 23, 33, 43
    for step, count in enumerate(per_step, start=1):
        if step <= sanity or step in flush_steps:
            assert count >= 1, step
        else:
            assert count == 0, (step, syncs)
    assert sum(per_step) <= sanity + 2 * len(flush_steps)
    assert _steps(fake) == [(1, 1, True), (2, 1, True), (3, 1, True)] + [(s, every, True) for s in sorted(flush_steps)]
    assert fake.sent[-1]["loss"] == pytest.approx(5.0 - 43 * 0.01)


@needs_torch
def test_a_cpu_tensors_loss_is_read_at_its_step_and_its_nan_sent_with_the_window() -> None:
    """On the CPU there is no device to sync with: the loss is read at its step (one ``item()``, no buffer copy),
    yet kept in the ``check_every`` window as a device loss is: a finite window is one message every ``check_every``
    steps, and a NaN is sent when its window is read, naming its own step and value (the same on every device)."""
    fake = FakeAgent()
    watch = LossWatch(fake, sanity_steps=2, check_every=5)  # type: ignore[arg-type]
    for step in range(1, 8):
        watch.observe(torch.tensor(1.0 / step, requires_grad=True) * 1.0, None, "backward")
    assert _steps(fake) == [(1, 1, True), (2, 1, True), (7, 5, True)]
    assert watch._buffer is None  # nothing copied on a device
    assert all(isinstance(value, float) for _, value in watch._kept) or not watch._kept
    watch.observe(torch.tensor(math.nan), None, "backward")  # step 8: the window 8..12
    assert isinstance(watch._kept[-1][1], float) and math.isnan(watch._kept[-1][1])  # read at its step
    assert len(fake.sent) == 3  # not sent before its window is read
    for _ in range(4):
        watch.observe(torch.tensor(0.5), None, "backward")
    assert _steps(fake)[-1] == (8, 1, False) and math.isnan(fake.sent[-1]["loss"])
    assert fake.waits == 1


@needs_torch
def test_a_tensor_nan_between_checks_is_still_reported_as_not_finite(syncs: list[str]) -> None:
    fake = FakeAgent()
    watch = LossWatch(fake, sanity_steps=2, check_every=5)  # type: ignore[arg-type]
    for step in range(1, 13):
        loss = torch.tensor(math.nan if step == 4 else 1.0 / step)
        watch.observe(loss, None, "backward")
    # Step 4's NaN is in the window 3..7: read at step 7, the message names step 4 and its NaN (not step 7's loss).
    assert _steps(fake) == [(1, 1, True), (2, 1, True), (4, 1, False), (12, 5, True)]
    assert math.isnan(fake.sent[2]["loss"])
    assert fake.waits == 1


@needs_torch
def test_no_hook_work_during_cuda_graph_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    from guard.inside.agent import _torch

    monkeypatch.setattr(torch.Tensor, "backward", torch.Tensor.backward)  # restored after the test
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", torch.cuda.CUDAGraph.replay)
    capturing = [True]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    agent = Agent(AgentSettings(socket_path=None, sanity_steps=5))
    seen: list[Any] = []
    monkeypatch.setattr(agent, "on_loss", lambda loss, step, source, mean=False: seen.append(loss))
    monkeypatch.setattr(agent_module, "get", lambda: agent)
    _torch.patch(torch)
    w = torch.ones(3, requires_grad=True)
    (w * 2).sum().backward()  # "captured": no .item(), no count
    assert seen == [] and agent.begun == 0
    assert w.grad is not None  # the real backward ran
    capturing[0] = False
    (w * 2).sum().backward()
    assert len(seen) == 1 and agent.begun == 1


@needs_torch
def test_graph_replays_tell_the_supervisor_the_job_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    from guard.inside.agent import _torch

    monkeypatch.setattr(torch.Tensor, "backward", torch.Tensor.backward)
    replays: list[Any] = []
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda self: replays.append(self))
    agent = Agent(AgentSettings(socket_path=None, sanity_steps=5, check_every=3))
    sent: list[dict[str, Any]] = []
    monkeypatch.setattr(agent, "send", lambda message: sent.append(message) or True)
    monkeypatch.setattr(agent_module, "get", lambda: agent)
    _torch.patch(torch)
    graph = object()
    for _ in range(7):
        torch.cuda.CUDAGraph.replay(graph)  # type: ignore[arg-type]
    assert replays == [graph] * 7  # the real replay ran each time
    assert [m for m in sent if m["t"] == "replay"] == [{"t": "replay", "n": 3}, {"t": "replay", "n": 3}]
    assert agent.begun == 7


def test_a_cpu_only_torch_is_never_capturing() -> None:
    from types import SimpleNamespace

    from guard.inside.agent._torch import _capture_probe

    def broken() -> bool:
        raise RuntimeError("Tried to instantiate dummy base class _cuda_isCurrentStreamCapturing")

    assert _capture_probe(SimpleNamespace(cuda=SimpleNamespace(is_initialized=lambda: True,
                                                                is_current_stream_capturing=broken)))() is False
    assert _capture_probe(SimpleNamespace())() is False


@needs_torch
def test_backward_hook_reports_scalar_losses_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from guard.inside.agent import _torch

    monkeypatch.setattr(torch.Tensor, "backward", torch.Tensor.backward)  # restored after the test
    agent = Agent(AgentSettings(socket_path=None, sanity_steps=5))  # a real agent with nobody to talk to
    seen: list[tuple[Any, Any, str]] = []
    monkeypatch.setattr(agent, "on_loss", lambda loss, step, source, mean=False: seen.append((loss, step, source)))
    monkeypatch.setattr(agent_module, "get", lambda: agent)
    _torch.patch(torch)
    wrapped = torch.Tensor.backward
    _torch.patch(torch)  # idempotent
    assert torch.Tensor.backward is wrapped
    w = torch.ones(3, requires_grad=True)
    loss = (w * 2).sum()
    loss.backward()
    (w * 2).backward(torch.ones(3))  # a vector: not a loss
    assert len(seen) == 1
    assert seen[0][0] is loss and seen[0][1:] == (None, "backward")
    assert w.grad is not None and torch.equal(w.grad, torch.full((3,), 4.0))  # the real backward still ran
    agent.backward_hook = False  # a Trainer or guard.report() took over
    (w * 2).sum().backward()
    assert len(seen) == 1


# ---------------------------------------------------------------------------------------------------------------
# The agent's client against a real SOCK_SEQPACKET socket
# ---------------------------------------------------------------------------------------------------------------


class Server:
    """A listening supervisor socket in a short temporary folder (Unix socket paths are limited to 107 bytes)."""

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="gt-")
        self.path = os.path.join(self.folder, "agent.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(self.path)
        self.listener.listen(8)
        self.listener.settimeout(10.0)
        self.conns: list[socket.socket] = []

    def accept(self) -> socket.socket:
        conn, _ = self.listener.accept()
        conn.settimeout(10.0)
        self.conns.append(conn)
        return conn

    def close(self) -> None:
        for conn in self.conns:
            conn.close()
        self.listener.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def recv(conn: socket.socket) -> dict[str, Any]:
    message = protocol.decode(conn.recv(protocol.MAX_MESSAGE_BYTES))
    assert message is not None
    return message


@pytest.fixture
def server() -> Iterator[Server]:
    srv = Server()
    yield srv
    srv.close()


@pytest.fixture
def agents() -> Iterator[list[Agent]]:
    """Agents made by a test; their sockets are closed afterwards (their reader threads then end)."""
    made: list[Agent] = []
    yield made
    for agent in made:
        if agent._sock is not None:
            agent._sock.close()


def _agent(agents: list[Agent], path: str | None, **kwargs: Any) -> Agent:
    agent = Agent(AgentSettings(socket_path=path, **kwargs))
    agents.append(agent)
    return agent


def test_first_send_connects_and_says_hello(server: Server, agents: list[Agent]) -> None:
    agent = _agent(agents, server.path)
    assert agent.send({"t": "train_begin", "max_steps": 10}) is True
    conn = server.accept()
    hello = recv(conn)
    assert hello["t"] == "hello" and hello["pid"] == os.getpid()
    assert {"rank", "local_rank", "world_size", "node_rank"} <= set(hello)
    assert recv(conn) == {"t": "train_begin", "max_steps": 10}


def test_sends_never_block_when_nobody_reads(server: Server, agents: list[Agent]) -> None:
    agent = _agent(agents, server.path)
    results: list[bool] = []
    payload = {"t": "step", "step": 0, "loss": 1.0, "finite": True, "n": 1, "source": "report", "pad": "x" * 200}

    def flood() -> None:
        for i in range(20_000):
            results.append(agent.send({**payload, "step": i}))

    thread = threading.Thread(target=flood, daemon=True)
    thread.start()
    thread.join(timeout=60)  # a hang guard, not a timing assertion: a blocking send would never return
    assert not thread.is_alive(), "agent.send blocked on a full socket"
    assert len(results) == 20_000
    assert results[0] is True
    assert results.count(False) == agent.dropped > 0  # the buffer filled; the rest was dropped, not waited for
    assert not agent.dead
    conn = server.accept()
    assert recv(conn)["t"] == "hello"
    assert recv(conn)["step"] == 0  # what was sent before the buffer filled arrives whole, in order
    assert recv(conn)["step"] == 1


def wait_until(condition: Any, what: str, limit_s: float = 10.0) -> None:
    """Poll until ``condition()`` (the agent's reader thread acts on its own); a hang guard, not a timing assertion."""
    end = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"still waiting for: {what}")
        time.sleep(0.005)


def test_commands_from_the_supervisor(server: Server, agents: list[Agent]) -> None:
    agent = _agent(agents, server.path)
    for step in range(1, 4):
        agent.on_loss(1.0, step, "report")
    conn = server.accept()
    conn.send(protocol.encode({"t": "checkpoint", "at_step": 5}))
    wait_until(lambda: agent.checkpoint_request is not None, "the checkpoint request")
    assert agent.checkpoint_request == {"t": "checkpoint", "at_step": 5}
    assert not agent.checkpoint_due()  # at step 3 of 5
    agent.on_loss(1.0, 5, "report")
    assert agent.checkpoint_due()
    assert not agent.stop_requested
    conn.send(protocol.encode({"t": "stop"}))
    wait_until(lambda: agent.stop_requested, "the stop request")


def test_a_closed_supervisor_makes_the_agent_silent(server: Server, agents: list[Agent]) -> None:
    agent = _agent(agents, server.path)
    assert agent.send({"t": "train_begin"})
    conn = server.accept()
    conn.close()
    wait_until(lambda: agent.dead, "the reader to see the end of the channel")
    assert agent.send({"t": "train_end"}) is False
    agent.wait_stop()  # returns at once: nobody is left to stop the job
    agent.wait_ack()


def test_no_listener_means_unwatched_not_broken(agents: list[Agent], tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    agent = _agent(agents, str(tmp_path / "nobody.sock"))
    assert agent.send({"t": "hello"}) is False
    assert agent.send({"t": "hello"}) is False
    assert agent.dead
    err = capsys.readouterr().err
    assert err.count("cannot reach the supervisor") <= 1


def test_a_forked_child_stays_silent(server: Server, agents: list[Agent], monkeypatch: pytest.MonkeyPatch) -> None:
    agent = _agent(agents, server.path)
    monkeypatch.setattr(agent_module, "_AGENT", agent)
    assert agent.send({"t": "train_begin"})
    pid = os.fork()
    if pid == 0:  # the child: a DataLoader worker
        code = 0 if (agent.send({"t": "step"}) is False and agent_module.get() is None) else 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert agent_module.get() is agent


# ---------------------------------------------------------------------------------------------------------------
# get() and the public API
# ---------------------------------------------------------------------------------------------------------------


def test_get_returns_none_without_a_supervisor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent_module, "_AGENT", None)
    monkeypatch.delenv(protocol.ENV_SOCKET, raising=False)
    assert agent_module.get() is None


def test_get_makes_one_agent_per_process(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(agent_module, "_AGENT", None)
    monkeypatch.setenv(protocol.ENV_SOCKET, str(tmp_path / "s.sock"))
    monkeypatch.setenv(protocol.ENV_CHECK_EVERY, "7")
    first = agent_module.get()
    assert first is not None and first is agent_module.get()
    assert first.settings.check_every == 7
    assert first._sock is None  # no connection until there is something to say


@needs_torch
def test_public_api_is_a_no_op_without_a_supervisor(monkeypatch: pytest.MonkeyPatch, syncs: list[str]) -> None:
    monkeypatch.setattr(agent_module, "_AGENT", None)
    monkeypatch.delenv(protocol.ENV_SOCKET, raising=False)
    assert guard.report(step=1, loss=2.0) is None
    assert guard.report(step=2, loss=torch.tensor(2.0)) is None
    assert guard.report(loss=None) is None
    assert guard.should_checkpoint() is False
    assert guard.should_stop() is False
    assert guard.checkpoint_saved("/nowhere", step=3) is None
    assert guard.resume_path() is None
    assert syncs == []  # not even a read of the tensor
    assert agent_module._AGENT is None


def test_public_api_with_a_supervisor(server: Server, agents: list[Agent], monkeypatch: pytest.MonkeyPatch,
                                      tmp_path: Path) -> None:
    monkeypatch.setattr(agent_module, "_AGENT", None)
    monkeypatch.setenv(protocol.ENV_SOCKET, server.path)
    monkeypatch.setenv(protocol.ENV_SANITY_STEPS, "1")
    monkeypatch.setenv(protocol.ENV_RESUME_PATH, str(tmp_path / "resume"))
    agent = agent_module.get()
    assert agent is not None
    agents.append(agent)
    assert guard.resume_path() == str(tmp_path / "resume")
    guard.report(step=1, loss=2.5)
    assert agent.backward_hook is False  # report() takes over from the .backward() hook
    conn = server.accept()
    assert recv(conn)["t"] == "hello"
    assert recv(conn) == {"t": "step", "step": 1, "loss": 2.5, "finite": True, "n": 1, "source": "report"}
    assert not guard.should_checkpoint() and not guard.should_stop()
    # the first use of each API call is announced once: the supervisor learns the job can answer requests
    assert recv(conn) == {"t": "api", "name": "should_checkpoint"}
    assert recv(conn) == {"t": "api", "name": "should_stop"}
    conn.send(protocol.encode({"t": "checkpoint", "stop": True}))
    wait_until(guard.should_checkpoint, "the checkpoint request")
    guard.report(step=2, loss=2.0)  # pending: one step since the last send
    guard.checkpoint_saved(tmp_path / "ckpt")  # this script reads should_stop(): it is not ended here
    assert recv(conn) == {"t": "api", "name": "stop_served"}  # the loop got the stop: its end is no finished run
    assert recv(conn) == {"t": "api", "name": "checkpoint_saved"}
    assert recv(conn) == {"t": "step", "step": 2, "loss": 2.0, "finite": True, "n": 1, "source": "report"}
    saved = recv(conn)
    assert saved["t"] == "checkpoint_saved"
    assert (saved["path"], saved["step"], saved["requested"]) == (str(tmp_path / "ckpt"), 2, True)
    assert guard.should_stop()  # the request said: then stop
    assert not guard.should_checkpoint()


def test_a_script_that_does_not_read_should_stop_ends_after_the_requested_save(
        server: Server, agents: list[Agent], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(agent_module, "_AGENT", None)
    monkeypatch.setenv(protocol.ENV_SOCKET, server.path)
    agent = agent_module.get()
    agents.append(agent)
    guard.report(step=1, loss=2.5)
    conn = server.accept()
    conn.send(protocol.encode({"t": "checkpoint"}))  # a save without a stop: the job goes on
    wait_until(guard.should_checkpoint, "the checkpoint request")
    guard.checkpoint_saved(tmp_path / "a")
    conn.send(protocol.encode({"t": "checkpoint", "stop": True}))
    wait_until(guard.should_checkpoint, "the stop request")
    with pytest.raises(SystemExit) as ended:
        guard.checkpoint_saved(tmp_path / "b")
    assert ended.value.code == 0
    guard.checkpoint_saved("")  # ignored with a warning, never a push of the working folder
    kinds = []
    conn.settimeout(2.0)
    while True:
        try:
            kinds.append(recv(conn))
        except (TimeoutError, OSError):
            break
        if sum(m.get("t") == "checkpoint_saved" for m in kinds) == 2:
            break
    assert [m["path"] for m in kinds if m["t"] == "checkpoint_saved"] == [str(tmp_path / "a"), str(tmp_path / "b")]


def test_a_rank_that_does_not_report_the_save_ends_when_it_asks_again(
        server: Server, agents: list[Agent], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent_module, "_AGENT", None)
    monkeypatch.setenv(protocol.ENV_SOCKET, server.path)
    agent = agent_module.get()
    agents.append(agent)
    guard.report(step=1, loss=2.5)
    conn = server.accept()
    conn.send(protocol.encode({"t": "checkpoint", "stop": True}))
    wait_until(guard.should_checkpoint, "the stop request")  # this rank saves its part (or waits at a barrier)
    with pytest.raises(SystemExit):
        guard.should_checkpoint()  # the next step: its part is done


# ---------------------------------------------------------------------------------------------------------------
# The last steps of a run (end to end: the agent inside a real job under the guard)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
@needs_torch
def test_a_nan_in_the_last_steps_before_a_normal_exit_is_caught() -> None:
    from conftest import JOBS, run_guard

    run = run_guard(["--sanity-steps", "2", "--check-every", "10", str(JOBS / "plain_loop.py"), "--steps", "8",
                     "--nan-at", "7"])
    assert run.returncode == 4, run.verdict
    assert run.fields()["reason"] == "non_finite_loss"


def test_checkpoint_saved_marks_a_plain_folder_complete(tmp_path, monkeypatch) -> None:
    from guard import _mark_complete
    from guard.secure.checkpoints import newest_complete

    folder = tmp_path / "checkpoint-12"
    folder.mkdir()
    (folder / "model.pt").write_bytes(b"weights")
    now_s = (folder / "model.pt").stat().st_mtime  # just written: not settled, and no completion file
    assert newest_complete(tmp_path, now_s=now_s) is None
    _mark_complete(str(folder), 12)
    found = newest_complete(tmp_path, now_s=now_s + 3600)  # its completion file written, then settled
    assert (folder / "guard_checkpoint.json").exists()
    assert found is not None and found.step == 12


def test_a_load_of_the_jobs_own_save_at_the_resumed_path_is_no_resume(agents: list[Agent], tmp_path: Path) -> None:
    # word_language_model: ``--save model.pt`` each epoch, ``torch.load`` of it only after training
    resumed = tmp_path / "model.pt"
    agent = _agent(agents, None, resume_path=str(resumed), resume_step=15)
    agent.file_saved(str(resumed), 0.01)
    agent.resume_seen(str(resumed))
    assert not agent.resumed and agent.watch.step == 0 and "resume_loaded" not in agent.api_used
    fresh = _agent(agents, None, resume_path=str(resumed), resume_step=15)
    fresh.resume_seen(str(resumed))  # loaded before any save: the resumed checkpoint
    assert fresh.resumed and fresh.watch.step == 15 and "resume_loaded" in fresh.api_used


# ---------------------------------------------------------------------------------------------------------------
# Gradient accumulation: one step per optimizer step, its loss combined from its micro-batches
# ---------------------------------------------------------------------------------------------------------------


def _accumulate(watch: LossWatch, steps: int, accum: int, loss_of: Any, *, mean: bool = False) -> None:
    """``steps`` optimizer steps of ``accum`` micro-batches: ``loss_of(step, micro)`` each, then the step."""
    watch.optimizer_built()
    optimizer = object()
    for step in range(1, steps + 1):
        for micro in range(accum):
            watch.observe(loss_of(step, micro), None, "backward", mean=mean)
        watch.optimizer_stepped(optimizer)


def test_under_accumulation_a_step_is_an_optimizer_step_and_its_loss_the_sum_of_its_micro_batches() -> None:
    """A plain loop dividing each micro-batch's loss by 4: the step's loss is their sum (the mean of the undivided
    losses, what nanoGPT prints), whether the sanity pass or a window (which ends inside a step: check_every=3)
    reads it; windows send whole steps only, the sanity pass lasts 2 optimizer steps (not 2 .backward() calls)."""
    fake = FakeAgent()
    watch = LossWatch(fake, sanity_steps=2, check_every=3)  # type: ignore[arg-type]
    _accumulate(watch, 6, 4, lambda step, micro: (10.0 * step + micro) / 4)
    watch.flush("exit")
    sent = [(m["step"], m["loss"]) for m in fake.sent]
    expected = {step: sum(10.0 * step + micro for micro in range(4)) / 4 for step in range(1, 7)}
    assert sent[:2] == [(1, expected[1]), (2, expected[2])]  # the sanity pass: each step once it is whole
    assert [step for step, _ in sent] == sorted({step for step, _ in sent})  # never a step twice, never back
    assert all(loss == pytest.approx(expected[step]) for step, loss in sent)  # never a partial step's loss
    assert sent[-1][0] == 6 and all(m["finite"] for m in fake.sent)


def test_a_loss_given_to_accelerate_or_deepspeed_is_averaged_over_the_micro_batches() -> None:
    """``accelerator.backward(loss)`` divides by the accumulation steps itself: the user's losses are averaged."""
    fake = FakeAgent()
    watch = LossWatch(fake, sanity_steps=3, check_every=10)  # type: ignore[arg-type]
    _accumulate(watch, 3, 4, lambda step, micro: float(step + micro), mean=True)
    assert [(m["step"], m["loss"]) for m in fake.sent] == [(1, 2.5), (2, 3.5), (3, 4.5)]


def test_a_non_finite_micro_batch_is_sent_at_once_with_its_optimizer_step() -> None:
    fake = FakeAgent()
    watch = LossWatch(fake, sanity_steps=1, check_every=100)  # type: ignore[arg-type]
    _accumulate(watch, 5, 4, lambda step, micro: math.nan if (step, micro) == (4, 2) else 1.0)
    bad = [m for m in fake.sent if not m["finite"]]
    assert [(m["step"], m["n"]) for m in bad] == [(4, 1)] and fake.waits == 1


def test_an_optimizer_whose_steps_are_never_seen_falls_back_to_a_step_per_backward() -> None:
    """Built through torch.optim but stepped where the global hook does not see it: after UNSTEPPED_LIMIT
    .backward() calls the watch counts a step per call again, so losses keep coming (before, every call stayed
    'step 1' and, held as one unfinished step, nothing would have been sent)."""
    from guard.inside.agent._losses import UNSTEPPED_LIMIT

    fake = FakeAgent()
    watch = LossWatch(fake, sanity_steps=1, check_every=10)  # type: ignore[arg-type]
    watch.optimizer_built()
    for _ in range(UNSTEPPED_LIMIT + 30):
        watch.observe(1.0, None, "backward")
    assert fake.sent and fake.sent[-1]["step"] > UNSTEPPED_LIMIT and watch.step_base is None


def test_a_distributed_checkpoint_save_is_reported_by_each_rank(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    """``torch.distributed.checkpoint.save`` returned: each rank reports the folder as ``checkpoint_saved`` (rank 0
    as the world's process zero), the step from its ``step_N`` name; a save through a storage writer alone is not
    reported, nor one under a Trainer."""
    from types import SimpleNamespace

    from guard.inside.agent import _torch

    calls: list[Any] = []
    module = SimpleNamespace(save=lambda state, **kwargs: calls.append(kwargs) or "metadata")
    agent = Agent(AgentSettings(socket_path=None, sanity_steps=5))
    sent: list[dict[str, Any]] = []
    monkeypatch.setattr(agent, "send", lambda message: sent.append(message) or True)
    monkeypatch.setattr(agent_module, "get", lambda: agent)
    _torch.patch_dcp(module)
    wrapped = module.save
    _torch.patch_dcp(module)  # idempotent
    assert module.save is wrapped
    monkeypatch.setenv("RANK", "1")
    assert module.save({"w": 1}, checkpoint_id=str(tmp_path / "step_40")) == "metadata"  # the real save's answer
    module.save({"w": 1}, storage_writer=object())
    monkeypatch.setenv("RANK", "0")
    module.save({"w": 1}, checkpoint_id=tmp_path / "latest")
    assert len(calls) == 3
    saved = [m for m in sent if m["t"] == "checkpoint_saved"]
    assert [(m["path"], m["step"], m["zero"]) for m in saved] == [
        (str(tmp_path / "step_40"), 40, False), (str(tmp_path / "latest"), agent.watch.step, True)]
    agent.trainer = True  # a Trainer reports its own saves
    module.save({"w": 1}, checkpoint_id=str(tmp_path / "step_60"))
    assert len([m for m in sent if m["t"] == "checkpoint_saved"]) == 2
