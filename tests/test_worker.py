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
    assert result.pushed == f"{dest}@{dest / 'last-checkpoint'}"
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
    assert not pid_alive(handle.pid)
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


def test_unknown_operation_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown worker operation"):
        worker.start("rm_rf", {}, time.monotonic() + 1, destination="/tmp/x")
