"""The agent never waits for, nor wedges, the job: forks during its stdout flush, DataLoader workers started with
spawn or forkserver, a hung rank relay store, and two threads calling backward. Real torch on the CPU, real
DataLoaders, real sockets."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, kill_quietly

from guard import protocol
from guard.inside.agent import Agent, _core
from guard.inside.settings import AgentSettings

torch = pytest.importorskip("torch")

SITE = REPO / "guard" / "inside" / "_site"


class Supervisor:
    """The supervisor's end of the agent socket: accepts every connection on a thread, keeps every message."""

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="ga-")
        self.path = os.path.join(self.folder, "agent.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(self.path)
        self.listener.listen(16)
        self.listener.settimeout(0.2)
        self.messages: list[dict[str, Any]] = []
        self.conns: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                continue
            self.conns.append(conn)
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        while True:
            try:
                data = conn.recv(protocol.MAX_MESSAGE_BYTES)
            except OSError:
                return
            if not data:
                return
            message = protocol.decode(data)
            if message is not None:
                self.messages.append(message)

    def hellos(self) -> list[dict[str, Any]]:
        return [m for m in self.messages if m["t"] == "hello"]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for conn in self.conns:
            conn.close()
        self.listener.close()
        shutil.rmtree(self.folder, ignore_errors=True)


@pytest.fixture
def supervisor() -> Iterator[Supervisor]:
    sup = Supervisor()
    yield sup
    sup.close()


def job_env(socket_path: str, **extra: str) -> dict[str, str]:
    """The environment the guard gives a Python job: the agent's sitecustomize first on the path."""
    env = dict(os.environ)
    env.pop("PYTHONUNBUFFERED", None)
    env["PYTHONPATH"] = os.pathsep.join([str(SITE), str(REPO), env.get("PYTHONPATH", "")])
    env[protocol.ENV_SOCKET] = socket_path
    env.update(extra)
    return env


# ---------------------------------------------------------------------------------------------------------------
# A fork while the flusher holds stdout's lock
# ---------------------------------------------------------------------------------------------------------------

FORK_DURING_FLUSH = """\
import fcntl, os, sys, time
import torch
from torch.utils.data import DataLoader, Dataset

# Fill the pipe to the reader (who does not read yet), without blocking this thread.
flags = fcntl.fcntl(1, fcntl.F_GETFL)
fcntl.fcntl(1, fcntl.F_SETFL, flags | os.O_NONBLOCK)
try:
    while True:
        os.write(1, b"f" * 4095 + b"\\n")
except BlockingIOError:
    pass
fcntl.fcntl(1, fcntl.F_SETFL, flags)
sys.stdout.write("buffered, for the agent's flusher\\n")  # no flush here: the flusher's write now blocks
time.sleep(0.5)
open(sys.argv[1], "w").close()

class Items(Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, i):
        print(f"worker item {i}", flush=True)
        return torch.tensor(float(i))

loader = DataLoader(Items(), num_workers=2, multiprocessing_context="fork", timeout=20)
print("batches", len(list(loader)), flush=True)
"""


def test_a_fork_during_the_stdout_flush_leaves_the_child_a_usable_stdout(tmp_path: Path,
                                                                         supervisor: Supervisor) -> None:
    # The DataLoader forks its workers while the agent's flusher thread sits in a write to a full stdout, holding
    # the BufferedWriter's lock. The fork handlers make the fork wait for that flush to end, so that no worker
    # inherits the lock held by a thread it does not have (bpo-6721). Note: CPython 3.11.7 here lets the child
    # through even without them (it then waits for the pipe like any writer), so this checks that the handlers
    # never wedge a fork (the wait ends with the flush) rather than reproducing the hang.
    script, ready = tmp_path / "job.py", tmp_path / "filled"
    script.write_text(FORK_DURING_FLUSH)
    proc = subprocess.Popen([sys.executable, str(script), str(ready)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=job_env(supervisor.path), start_new_session=True)
    try:
        end = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < end and proc.poll() is None:
            time.sleep(0.05)
        assert ready.exists(), proc.stderr.read().decode()[-2000:] if proc.stderr else ""
        time.sleep(1.5)  # the DataLoader forks now, while the flusher's write still waits for us
        out, err = proc.communicate(timeout=90)
    finally:
        kill_quietly(proc)
    text = out.decode()
    assert proc.returncode == 0, err.decode()[-3000:]
    assert "batches 4" in text
    assert sorted(line for line in text.splitlines() if line.startswith("worker item")) == \
        [f"worker item {i}" for i in range(4)]


def test_fork_handlers_hold_the_flush_lock_only_around_the_fork() -> None:
    _core._register_fork_handlers()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the flush lock is free here (released after the fork)
        ok = _core._FLUSHING.acquire(timeout=5)
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.close(write)
    try:
        assert os.read(read, 1) == b"1"
        assert _core._FLUSHING.acquire(timeout=5)  # and in the parent
        _core._FLUSHING.release()
    finally:
        os.close(read)
        os.waitpid(pid, 0)


# ---------------------------------------------------------------------------------------------------------------
# DataLoader workers started with spawn or forkserver: no agent of their own
# ---------------------------------------------------------------------------------------------------------------

SPAWNING_LOADER = """\
import os, sys
import torch
from torch.utils.data import DataLoader, Dataset

class Items(Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, i):
        return torch.tensor(float(i))

if __name__ == "__main__":
    for method in sys.argv[1].split(","):
        batches = list(DataLoader(Items(), num_workers=2, multiprocessing_context=method, timeout=60))
        print(method, len(batches), flush=True)
    w = torch.ones(2, requires_grad=True)
    (w * 3).sum().backward()  # the training process itself: its agent reports this loss
"""


@pytest.mark.parametrize("methods", ["spawn", "forkserver"])
def test_spawn_and_forkserver_workers_carry_no_agent(tmp_path: Path, supervisor: Supervisor, methods: str) -> None:
    script = tmp_path / "job.py"
    script.write_text(SPAWNING_LOADER)
    proc = subprocess.run([sys.executable, str(script), methods], capture_output=True, text=True, timeout=180,
                          env=job_env(supervisor.path, RANK="3", WORLD_SIZE="4", GUARD_AGENT_SANITY_STEPS="1"),
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for method in methods.split(","):
        assert f"{method} 4" in proc.stdout
    time.sleep(0.5)  # the last messages in flight
    hellos = supervisor.hellos()
    assert len(hellos) == 1, hellos  # the main process only: no worker, no forkserver with the parent's RANK
    assert hellos[0]["rank"] == 3
    steps = [m for m in supervisor.messages if m["t"] == "step"]
    assert steps and steps[0]["loss"] == pytest.approx(6.0)


def test_the_role_is_read_from_the_command_line() -> None:
    spawn = ["python", "-c", "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5, pipe_handle=7)",
             "--multiprocessing-fork"]
    forkserver = ["python", "-c", "from multiprocessing.forkserver import main; main(3, 4, ['__main__'], **{})"]
    tracker = ["python", "-c", "from multiprocessing.resource_tracker import main;main(5)"]
    assert _core.multiprocessing_role(spawn) == "spawn"
    assert _core.multiprocessing_role(forkserver) == "helper"
    assert _core.multiprocessing_role(tracker) == "helper"
    assert _core.multiprocessing_role(["python", "train.py", "-c", "cfg.yaml"]) is None
    assert _core.multiprocessing_role(["python", "-c", "print(1)"]) is None


def test_a_dormant_agent_connects_once_it_reports_a_loss(supervisor: Supervisor) -> None:
    # A torch.multiprocessing.spawn rank starts like a DataLoader worker: it connects when it trains, and says what
    # it held back first.
    agent = Agent(AgentSettings(socket_path=supervisor.path, sanity_steps=1))
    agent.dormant = True
    try:
        assert agent.send({"t": "watching", "what": "torch"}) is True
        time.sleep(0.3)
        assert supervisor.messages == [] and agent._sock is None
        agent.on_loss(2.5, 1, "report")
        end = time.monotonic() + 10
        while len(supervisor.messages) < 3 and time.monotonic() < end:
            time.sleep(0.02)
        assert [m["t"] for m in supervisor.messages] == ["hello", "watching", "step"]
    finally:
        if agent._sock is not None:
            agent._sock.close()


# ---------------------------------------------------------------------------------------------------------------
# The rank relay: off the reader thread, one key per elastic restart
# ---------------------------------------------------------------------------------------------------------------


class HungStore:
    """A store whose ``set`` hangs (its host is gone) until ``release``."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls: list[str] = []

    def set(self, key: str, value: str) -> None:
        self.calls.append(key)
        self.release.wait(30)


def test_a_hung_store_does_not_stop_the_agent_reading_stop_and_dump(tmp_path: Path) -> None:
    folder = tempfile.mkdtemp(prefix="gr-")
    path = os.path.join(folder, "agent.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(1)
    listener.settimeout(10)
    agent = Agent(AgentSettings(socket_path=path))
    store = HungStore()
    try:
        agent.relay.store, agent.relay.rank, agent.relay.probed = store, 0, True
        assert agent.send({"t": "api", "name": "should_checkpoint"})
        conn, _ = listener.accept()
        conn.send(protocol.encode({"t": "checkpoint", "stop": True, "at_step": 5}))
        conn.send(protocol.encode({"t": "stop"}))
        end = time.monotonic() + 10
        while not agent.stop_requested and time.monotonic() < end:
            time.sleep(0.02)
        assert agent.stop_requested, "the reader thread waited on the store"
        assert agent.checkpoint_request is not None
        assert store.calls == ["jobguard/checkpoint/0"]
        conn.close()
    finally:
        store.release.set()
        if agent._sock is not None:
            agent._sock.close()
        listener.close()
        shutil.rmtree(folder, ignore_errors=True)


def test_a_request_of_the_attempt_before_an_elastic_restart_is_not_adopted(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    first = Agent(AgentSettings(socket_path=None))
    first.relay.store, first.relay.rank, first.relay.probed = store, 0, True
    first.relay.publish({"t": "checkpoint", "stop": True, "at_step": 7})
    end = time.monotonic() + 10
    while not store.check(["jobguard/checkpoint/0"]) and time.monotonic() < end:
        time.sleep(0.02)
    assert store.check(["jobguard/checkpoint/0"])
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # torchrun restarted the workers; the store stays
    later = Agent(AgentSettings(socket_path=None))
    later.relay.store, later.relay.rank, later.relay.probed = store, 1, True
    later.relay.poll(0, 1)
    assert later.checkpoint_request is None  # the old attempt's request is not this one's
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    same = Agent(AgentSettings(socket_path=None))
    same.relay.store, same.relay.rank, same.relay.probed = store, 1, True
    same.relay.poll(0, 1)
    assert same.checkpoint_request == {"t": "checkpoint", "stop": True, "at_step": 7}


# ---------------------------------------------------------------------------------------------------------------
# Two threads calling backward
# ---------------------------------------------------------------------------------------------------------------


def test_two_threads_calling_backward_keep_their_own_scaled_losses(monkeypatch: pytest.MonkeyPatch) -> None:
    from guard.inside.agent import _torch

    monkeypatch.setattr(torch.Tensor, "backward", torch.Tensor.backward)  # restored after the test
    monkeypatch.setattr(torch.amp.GradScaler, "scale", torch.amp.GradScaler.scale)
    monkeypatch.setattr(torch.amp.GradScaler, "update", torch.amp.GradScaler.update)
    agent = Agent(AgentSettings(socket_path=None, sanity_steps=5))
    seen: list[float] = []
    monkeypatch.setattr(agent, "on_loss", lambda loss, step, source, mean=False: seen.append(float(loss)))
    monkeypatch.setattr(_core, "get", lambda: agent)
    _torch.patch(torch)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    a_scaled, b_done = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def thread_a() -> None:
        try:
            w = torch.ones(1, requires_grad=True)
            scaled = scaler.scale((w * 2.0).sum())  # loss 2.0, scaled 2048
            a_scaled.set()
            b_done.wait(10)
            scaled.backward()
        except BaseException as exc:
            errors.append(exc)

    def thread_b() -> None:
        try:
            a_scaled.wait(10)
            w = torch.ones(1, requires_grad=True)
            scaler.scale((w * 5.0).sum()).backward()  # loss 5.0, meanwhile
        except BaseException as exc:
            errors.append(exc)
        finally:
            b_done.set()

    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not errors, errors
    assert seen == [5.0, 2.0]  # each backward watched its own thread's unscaled loss, not 2048


def test_loss_state_is_per_thread() -> None:
    agent = Agent(AgentSettings(socket_path=None))
    agent.scaled, agent.user_loss = ("scaled", "loss"), "user"
    other: list[Any] = []
    thread = threading.Thread(target=lambda: other.extend([agent.scaled, agent.user_loss]))
    thread.start()
    thread.join()
    assert other == [None, None]
    assert agent.scaled == ("scaled", "loss") and agent.user_loss == "user"


if sys.platform != "linux":  # pragma: no cover
    pytestmark = pytest.mark.skip("Linux: fork, forkserver, SOCK_SEQPACKET")
