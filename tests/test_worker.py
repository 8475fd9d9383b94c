"""The securing worker: a child process that pushes, verifies and fetches, and that can be killed at any time."""

from __future__ import annotations

import hashlib
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import pid_alive

from guard.core.children import CHILDREN
from guard.secure import worker


def make_checkpoint(folder: Path, step: int, size_bytes: int = 4096) -> Path:
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * (size_bytes // 256))
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return folder


def wait(handle: worker.Handle, limit_s: float = 60.0) -> worker.WorkResult:
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        result = handle.poll()
        if result is not None:
            return result
        time.sleep(0.05)
    handle.kill()
    raise AssertionError("the worker did not end")


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """An address that accepts connections (the kernel's backlog) and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


def test_folder_push_returns_plain_data(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "out" / "checkpoint-7", 7)
    dest = tmp_path / "dest"
    result = wait(worker.start("push_checkpoint", {"local_dir": str(ckpt), "step": 7}, time.monotonic() + 60,
                               destination=str(dest)))
    assert result.ok, result.error
    assert result.pushed == str(dest / 'last-checkpoint')
    assert result.files == ("model.safetensors", "trainer_state.json") and result.step == 7
    assert result.size_bytes == sum(p.stat().st_size for p in ckpt.iterdir())
    secured = dest / "last-checkpoint" / "model.safetensors"
    assert hashlib.sha256(secured.read_bytes()).digest() == hashlib.sha256(
        (ckpt / "model.safetensors").read_bytes()).digest()
    json.dumps(result.data)  # plain data


def test_a_failure_is_data_with_a_hint(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    result = wait(worker.start("push_checkpoint", {"local_dir": str(empty), "step": 1}, time.monotonic() + 60,
                               destination=str(tmp_path / "dest")))
    assert not result.ok and result.error_type == "PushFailedError"
    assert "has no files" in (result.error or "") and result.hint
    assert not (tmp_path / "dest" / "last-checkpoint").exists()


@pytest.mark.slow
def test_a_hung_hub_push_ends_at_its_deadline_and_is_not_secured(tmp_path: Path, silent_endpoint: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", silent_endpoint)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    ckpt = make_checkpoint(tmp_path / "checkpoint-3", 3)
    started = time.monotonic()
    handle = worker.start("push_checkpoint", {"local_dir": str(ckpt), "step": 3}, started + 4.0,
                          destination="alice/hung", token="hf_test")
    result = wait(handle)
    assert time.monotonic() - started < 7.0
    assert not result.ok and result.pushed is None
    assert not pid_alive(handle.pid)


@pytest.mark.slow
def test_kill_ends_the_whole_worker_at_once(tmp_path: Path, silent_endpoint: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", silent_endpoint)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    ckpt = make_checkpoint(tmp_path / "checkpoint-3", 3)
    handle = worker.start("push_checkpoint", {"local_dir": str(ckpt), "step": 3}, time.monotonic() + 600,
                          destination="alice/hung", token="hf_test")
    time.sleep(1.5)
    assert handle.poll() is None
    result = handle.kill("killed")
    assert result.killed and not result.ok and result.error_type == "killed"
    assert _reaped(handle) and not pid_alive(handle.pid)
    assert handle.poll() is result


@pytest.mark.slow
def test_run_bounded_returns_when_the_abort_flag_is_set(tmp_path: Path, silent_endpoint: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", silent_endpoint)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    flags: list[int] = []
    started = time.monotonic()

    def abort() -> bool:
        if time.monotonic() - started > 1.0:
            flags.append(15)
        return bool(flags)

    result = worker.run_bounded("fetch_last_checkpoint", {"into_dir": str(tmp_path / "into")}, started + 600, abort,
                                destination="alice/hung", token="hf_test")
    assert result.error_type == "killed" and not result.ok
    assert time.monotonic() - started < 10.0


def _reaped(handle: worker.Handle, limit_s: float = 10.0) -> bool:
    """Poll a killed handle until its child was reaped (``poll`` reaps it; it never waits)."""
    end = time.monotonic() + limit_s
    while not handle.reaped and time.monotonic() < end:
        handle.poll()
        time.sleep(0.02)
    return handle.reaped


HELD_AT_START = """\
import os, time
if os.environ.get("HOLD_RELEASE"):
    open(os.environ["HOLD_STARTED"], "w").close()
    while not os.path.exists(os.environ["HOLD_RELEASE"]):
        time.sleep(0.02)
"""


def _held_environ(tmp_path: Path) -> tuple[dict[str, str], Path, Path]:
    """An environment whose Python children wait at start-up (a ``sitecustomize``) until ``release`` exists: a
    worker that does not read its request yet (a loaded machine, a slow filesystem under its imports)."""
    import os

    site = tmp_path / "held_site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HELD_AT_START)
    started, release = tmp_path / "child-started", tmp_path / "release"
    environ = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
                   HOLD_STARTED=str(started), HOLD_RELEASE=str(release))
    return environ, started, release


def test_a_request_over_a_pipe_buffer_does_not_wait_for_the_child(tmp_path: Path) -> None:
    # A sharded checkpoint (FSDP/DeepSpeed-like shard files with no format of their own): 2000 files, a request of
    # ~120 KiB, over a pipe's 64 KiB. start() returns while the child has not read anything yet; the child then gets
    # the whole request.
    import threading

    ckpt = tmp_path / "out" / "checkpoint-9"
    names = [f"pytorch_model_fsdp_0/__{i // 100}_{i % 100}.shard-{i:05d}-of-02000.dat" for i in range(2000)]
    for name in names:
        (ckpt / name).parent.mkdir(parents=True, exist_ok=True)
        (ckpt / name).write_bytes(b"s" * 16)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 9}))
    files = [*names, "trainer_state.json"]
    assert len(json.dumps(files)) > 1 << 16
    environ, child_started, release = _held_environ(tmp_path)
    handles: list[worker.Handle] = []
    starter = threading.Thread(target=lambda: handles.append(worker.start(
        "push_checkpoint", {"local_dir": str(ckpt), "step": 9, "files": files}, time.monotonic() + 120,
        destination=str(tmp_path / "dest"), environ=environ)), daemon=True)
    starter.start()
    starter.join(timeout=30)
    returned = bool(handles)
    release.touch()  # let the child go on either way (the old code waits for it to read the request)
    starter.join(timeout=30)
    assert returned, "start() waited for the worker to read a request larger than a pipe's buffer"
    assert child_started.exists() or not handles[0].reaped
    result = wait(handles[0], 120)
    assert result.ok, result.error
    assert len(result.files) == 2001 and result.step == 9


def test_kill_never_waits_for_the_child_and_poll_reaps_it_later(tmp_path: Path) -> None:
    import signal

    environ, child_started, release = _held_environ(tmp_path)
    handle = worker.start("peek_last_checkpoint", {}, time.monotonic() + 600, destination=str(tmp_path / "dest"),
                          environ=environ)
    try:
        end = time.monotonic() + 60
        while not child_started.exists() and time.monotonic() < end:
            time.sleep(0.02)

        def no_wait(timeout: float | None = None) -> int:
            raise AssertionError("kill() waited for the worker to die")

        handle.proc.wait = no_wait  # type: ignore[method-assign]
        result = handle.kill("deadline")
        assert result.error_type == "deadline" and not result.ok
        assert _reaped(handle), "poll() did not reap the killed worker"
        assert handle.proc.returncode == -signal.SIGKILL
        assert worker.reap_killed() == 0 and CHILDREN.owner(handle.pid) is None
        assert handle.request_dir is None  # the request's folder is gone with the child
    finally:
        release.touch()


def test_the_request_file_is_private_and_the_token_is_not_in_it(tmp_path: Path) -> None:
    import os
    import stat

    environ, _started, release = _held_environ(tmp_path)
    handle = worker.start("peek_last_checkpoint", {}, time.monotonic() + 600, destination=str(tmp_path / "dest"),
                          token="hf_secret_token_value", environ=environ)
    try:
        assert handle.request_dir is not None
        request = Path(handle.request_dir) / "request.json"
        assert stat.S_IMODE(os.stat(handle.request_dir).st_mode) == 0o700
        assert stat.S_IMODE(request.stat().st_mode) == 0o600
        assert "hf_secret_token_value" not in request.read_text()
        release.touch()
        result = wait(handle)
        assert result.ok and result.data is None  # nothing secured there yet
        assert not request.exists()
    finally:
        release.touch()
        handle.kill()


def test_unknown_operation_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown worker operation"):
        worker.start("rm_rf", {}, time.monotonic() + 1, destination="/tmp/x")


def _child(code: str) -> worker.Handle:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    return worker.Handle(proc, "push_checkpoint", deadline=float("inf"), clock=_Ticks())


class _Ticks:
    """A clock that moves one second per reading: progress_at says which poll saw the progress."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def _poll_until(handle: worker.Handle, done: object, limit_s: float = 60.0) -> None:
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        handle.poll()
        if callable(done) and done():
            return
        time.sleep(0.05)
    raise AssertionError("the condition did not come")


def test_a_worker_that_moves_no_byte_shows_no_progress_and_one_that_moves_bytes_does(
        caplog: pytest.LogCaptureFixture) -> None:
    # /proc/<pid>/io: bytes read and written by the child, less its own lines to the guard
    idle = _child("import sys, time; print('ready', flush=True); time.sleep(60)")
    busy = _child("import os, sys, time\nprint('ready', flush=True)\nwhile True:\n"
                  "    open(os.devnull, 'wb').write(b'x' * 200_000); time.sleep(0.05)")
    try:
        with caplog.at_level("INFO", logger="guard.secure.worker"):
            _poll_until(idle, lambda: caplog.text.count("worker: ready") >= 1)
            _poll_until(busy, lambda: caplog.text.count("worker: ready") >= 2)
        idle_mark, busy_mark = idle.progress_at, busy.progress_at
        for _ in range(10):
            idle.poll()
            time.sleep(0.05)
        assert idle.progress_at == idle_mark  # asleep: nothing moved, whatever the polls
        _poll_until(busy, lambda: busy.progress_at > busy_mark)
    finally:
        idle.kill()
        busy.kill()


def test_a_push_killed_after_its_record_moved_reports_the_step_the_destination_holds(tmp_path: Path) -> None:
    """Issue 33 item 3: a checkpoint push killed in its cleanup, after the folder swap (accelerate's
    complete_nlp_example at the end of its window), says which step the destination's record names now; one killed
    before it says none."""
    ckpt = make_checkpoint(tmp_path / "out" / "checkpoint-7", 7, size_bytes=4_000_000)
    dest = tmp_path / "dest"
    early = worker.start("push_checkpoint", {"local_dir": str(ckpt), "step": 7}, time.monotonic() + 60,
                         destination=str(tmp_path / "other"))
    killed_early = early.kill()
    assert killed_early.killed and killed_early.recorded_step is None and killed_early.pushed is None

    handle = worker.start("push_checkpoint", {"local_dir": str(ckpt), "step": 7}, time.monotonic() + 60,
                          destination=str(dest))
    manifest = dest / "last-checkpoint" / "guard_manifest.json"
    end = time.monotonic() + 60
    while not manifest.is_file() and time.monotonic() < end:
        time.sleep(0.01)
    assert json.loads(manifest.read_text())["step"] == 7  # the record moved: the swap is done
    time.sleep(0.2)  # its line is written right after the swap (the worker may have ended meanwhile: the same)
    result = handle.kill()
    assert not result.ok and result.recorded_step == 7
    assert result.pushed == str(dest / 'last-checkpoint')
