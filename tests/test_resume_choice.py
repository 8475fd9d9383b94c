"""Resume picks the newest complete checkpoint, secured or local, never a partial folder, and fetches the revision
the guard recorded, not the destination's HEAD. Real worker processes, a real folder destination and the local
Hub server."""

from __future__ import annotations

import json
import math
import os
import threading
import time
from pathlib import Path

import pytest

from guard.secure import resume
from guard.secure.checkpoints import TRAINER_STATE_NAME
from guard.secure.securer import Securer
from tests.hubserver import TOKENS, HubServer, client_constants


def trainer_checkpoint(out: Path, step: int, *, state: bool = True, payload: bytes = b"w") -> Path:
    folder = out / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(payload * 100)
    (folder / "optimizer.pt").write_bytes(b"o" * 50)
    if state:
        (folder / TRAINER_STATE_NAME).write_text(json.dumps({"global_step": step}))
    return folder


def deadline(s: float = 60.0) -> float:
    return time.monotonic() + s


def test_a_newer_complete_local_checkpoint_wins_and_a_partial_one_is_moved_aside(tmp_path: Path) -> None:
    dest = Securer(str(tmp_path / "dest"))
    dest.push_checkpoint(trainer_checkpoint(tmp_path / "run1", 10), step=10, deadline=math.inf)
    out = tmp_path / "out"
    trainer_checkpoint(out, 20)
    trainer_checkpoint(out, 30, state=False)  # the Trainer was killed while saving it
    chosen = resume.choose(out, dest, deadline=deadline(), abort=lambda: False)
    assert chosen is not None
    assert (chosen.path, chosen.step, chosen.source) == (out / "checkpoint-20", 20, "output folder")
    assert not (out / "checkpoint-30").exists()
    assert (out / f"checkpoint-30{resume.PARTIAL_SUFFIX}" / "optimizer.pt").is_file()  # kept, named, never used
    assert not (out / "checkpoint-10").exists()  # nothing fetched
    assert chosen.info is not None and (chosen.info.path, chosen.info.step) == (chosen.path, 20)  # for securing
    assert sorted(chosen.info.files) == sorted([TRAINER_STATE_NAME, "model.safetensors", "optimizer.pt"])


def test_an_older_local_checkpoint_loses_to_the_secured_one(tmp_path: Path) -> None:
    dest = Securer(str(tmp_path / "dest"))
    dest.push_checkpoint(trainer_checkpoint(tmp_path / "run1", 30), step=30, deadline=math.inf)
    out = tmp_path / "out"
    trainer_checkpoint(out, 20)
    trainer_checkpoint(out, 40, state=False)
    chosen = resume.choose(out, dest, deadline=deadline(), abort=lambda: False)
    assert (chosen.path, chosen.step, chosen.source) == (out / "checkpoint-30", 30, "destination")
    assert (out / "checkpoint-30" / TRAINER_STATE_NAME).is_file()
    assert (out / f"checkpoint-40{resume.PARTIAL_SUFFIX}").is_dir()
    assert chosen.info is not None and (chosen.info.path, chosen.info.step) == (out / "checkpoint-30", 30)


def test_nothing_anywhere_starts_fresh_and_a_plain_loops_folders_are_left_alone(tmp_path: Path, caplog) -> None:
    out = tmp_path / "out"
    (out / "checkpoint-5").mkdir(parents=True)
    # a loop's own folder, no Trainer files: not moved; its model.pt is cut short (no central directory): not used
    (out / "checkpoint-5" / "model.pt").write_bytes(b"PK\x03\x04" + b"x" * 100)
    with caplog.at_level("INFO", logger="guard.resume"):
        assert resume.choose(out, Securer(str(tmp_path / "dest")), deadline=deadline(), abort=lambda: False) is None
    assert "starting fresh" in caplog.text
    assert (out / "checkpoint-5").is_dir()


def hung_output_folder(out: Path) -> Path:
    """A DeepSpeed-like save whose ``latest`` is a named pipe without a writer: reading it, as the completeness
    check does, blocks like a ``stat()`` on a hung NFS or Lustre hard mount (``tests/jobs/stuck_folder.py``)."""
    (out / "global_step5").mkdir(parents=True)
    (out / "global_step5" / "mp_rank_00_model_states.pt").write_bytes(b"weights" * 100)
    fifo = out / "latest"
    os.mkfifo(fifo)
    return fifo


def release(fifo: Path) -> None:
    """Open the pipe's writing end once, so the thread blocked reading it (given up by the guard) ends."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:  # no reader left
        pass


def choose_in_thread(*args: object, **kwargs: object) -> tuple[threading.Thread, list[object]]:
    outcome: list[object] = []

    def call() -> None:
        try:
            outcome.append(resume.choose(*args, **kwargs))  # type: ignore[arg-type]
        except BaseException as exc:  # the test reads it
            outcome.append(exc)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    return thread, outcome


@pytest.mark.parametrize("signalled", [False, True])
def test_a_hung_output_folder_ends_the_choice_at_its_deadline_or_at_a_signal(tmp_path: Path, signalled: bool) -> None:
    out = tmp_path / "out"
    fifo = hung_output_folder(out)
    abort = threading.Event()
    try:
        thread, outcome = choose_in_thread(out, Securer(str(tmp_path / "dest")),
                                           deadline=deadline(60.0 if signalled else 1.0), abort=abort.is_set)
        if signalled:
            thread.join(1.0)
            assert thread.is_alive()  # still waiting on the folder: neither the deadline nor a signal yet
            abort.set()
        thread.join(30.0)
        assert not thread.is_alive(), "choose() waited on the hung output folder"
    finally:
        release(fifo)
    (raised,) = outcome
    if signalled:
        assert isinstance(raised, resume.Interrupted), raised
    else:
        assert isinstance(raised, resume.FetchTimedOut), raised
        assert "did not answer" in raised.message and str(out) in raised.message and "mount" in (raised.hint or "")


def test_a_signal_ends_the_fetch(tmp_path: Path) -> None:
    dest = Securer(str(tmp_path / "dest"))
    dest.push_checkpoint(trainer_checkpoint(tmp_path / "run1", 10), step=10, deadline=math.inf)
    with pytest.raises(resume.Interrupted):
        resume.choose(tmp_path / "out", dest, deadline=deadline(), abort=lambda: True)


@pytest.mark.hub
def test_the_recorded_revision_is_fetched_not_head(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import HfApi

    with HubServer() as hub, client_constants():
        for name, value in hub.env(token=TOKENS["write"], hf_home=tmp_path / "hf").items():
            monkeypatch.setenv(name, value)  # for the worker processes
        api = HfApi(endpoint=hub.url, token=TOKENS["write"])
        securer = Securer("alice/recorded", api=api, token=TOKENS["write"])
        securer.push_checkpoint(trainer_checkpoint(tmp_path / "run", 10, payload=b"a"), step=10, deadline=deadline())
        second = securer.push_checkpoint(trainer_checkpoint(tmp_path / "run", 20, payload=b"b"), step=20,
                                         deadline=deadline())
        # someone moves HEAD: an unrelated commit that even rewrites last-checkpoint/
        (tmp_path / "other.safetensors").write_bytes(b"z" * 100)
        api.upload_file(path_or_fileobj=str(tmp_path / "other.safetensors"),
                        path_in_repo="last-checkpoint/model.safetensors", repo_id="alice/recorded",
                        commit_message="unrelated change")
        api.upload_file(path_or_fileobj=b"# notes\n", path_in_repo="README.md", repo_id="alice/recorded",
                        commit_message="readme")
        assert api.repo_info("alice/recorded").sha != second.revision
        out = tmp_path / "out"
        chosen = resume.choose(out, Securer("alice/recorded", token=TOKENS["write"]), deadline=deadline(),
                               abort=lambda: False)
    assert (chosen.step, chosen.revision, chosen.source) == (20, second.revision, "destination")
    assert (out / "checkpoint-20" / "model.safetensors").read_bytes() == b"b" * 100
    assert os.listdir(out) == ["checkpoint-20"]


def test_a_hub_repo_without_a_checkpoint_leaves_the_local_one_to_resume(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A Hub repo that exists but holds no ``last-checkpoint/`` (a README only: made by hand, or a model card pushed
    before the first record): its HEAD is read as a record of unknown step, the fetch finds nothing there, and the
    output folder's own complete checkpoint is resumed. Before, the run started fresh beside it ("nothing secured
    ... starting fresh"), the local checkpoint-20 ignored."""
    from huggingface_hub import HfApi

    with HubServer() as hub, client_constants():
        for name, value in hub.env(token=TOKENS["write"], hf_home=tmp_path / "hf").items():
            monkeypatch.setenv(name, value)  # for the worker processes
        api = HfApi(endpoint=hub.url, token=TOKENS["write"])
        api.create_repo("alice/empty")
        api.upload_file(path_or_fileobj=b"# notes\n", path_in_repo="README.md", repo_id="alice/empty",
                        commit_message="readme")
        out = tmp_path / "out"
        trainer_checkpoint(out, 20)
        chosen = resume.choose(out, Securer("alice/empty", token=TOKENS["write"]), deadline=deadline(),
                               abort=lambda: False)
    assert chosen is not None and (chosen.path, chosen.step, chosen.source) == (out / "checkpoint-20", 20,
                                                                                  "output folder")


def accelerate_save(saved: Path, n: int) -> Path:
    """``Accelerator.save_state()`` with automatic naming: ``checkpoints/checkpoint_N`` (N counts the saves)."""
    folder = saved / f"checkpoint_{n}"
    folder.mkdir(parents=True)
    for name in ("model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl"):
        (folder / name).write_bytes(b"\x80\x04K\x01." if name.endswith((".bin", ".pkl")) else b"w" * 10)
    return folder


def test_accelerates_save_counted_folders_compare_by_number_not_by_step(tmp_path: Path, monkeypatch) -> None:
    # the secured checkpoint_2 is step 300 (the agent's step); the killed run then wrote checkpoint_3 whole but the
    # guard had not pushed it: accelerate's load_state() takes checkpoint_3, so the resume is from it
    monkeypatch.chdir(tmp_path)
    saved = Path("project") / "checkpoints"
    dest = Securer(str(tmp_path / "dest"))
    monkeypatch.setattr("guard.secure.checkpoints.check_files", lambda folder, files, **kw: [])
    dest.push_checkpoint(accelerate_save(saved, 2), step=300, deadline=math.inf)
    newer = accelerate_save(saved, 3)
    chosen = resume.choose(saved, dest, deadline=deadline(), abort=lambda: False)
    assert chosen is not None and (chosen.path, chosen.source) == (newer, "output folder"), chosen
    older = Path("project2") / "checkpoints"
    accelerate_save(older, 1)
    chosen = resume.choose(older, dest, deadline=deadline(), abort=lambda: False)  # checkpoint_1 < checkpoint_2
    assert chosen is not None and (chosen.source, chosen.step) == ("destination", 300), chosen
