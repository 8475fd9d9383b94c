"""Complete checkpoints on disk: partial folders are skipped (and named in the log), never returned."""

from __future__ import annotations

import json
import logging
import os
import pickle
from pathlib import Path

import pytest

from guard.errors import SupervisorError
from guard.secure.checkpoints import (
    GUARD_MARKER_NAME,
    INCOMPLETE_SENTINEL_NAME,
    TRAINER_STATE_NAME,
    CheckpointInfo,
    describe,
    newest_complete,
    why_incomplete,
)

NOW = 1_787_236_200.0


def write(path: Path, size: int, *, mtime_s: float = NOW - 60) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    # files of a format the guard checks hold that format (a whole pickle, valid JSON), about ``size`` bytes
    data = (pickle.dumps(b"x" * size) if path.suffix == ".pkl" else json.dumps("x" * size).encode()
            if path.suffix == ".json" else b"x" * size)
    path.write_bytes(data)
    os.utime(path, (mtime_s, mtime_s))
    return path


def trainer_checkpoint(output_dir: Path, step: int, *, mtime_s: float = NOW - 60, state: bool = True) -> Path:
    """A folder laid out like Trainer._save_checkpoint's (model, optimizer, scheduler, rng, state last)."""
    folder = output_dir / f"checkpoint-{step}"
    write(folder / "model.safetensors", 1000, mtime_s=mtime_s)
    write(folder / "optimizer.pt", 2000, mtime_s=mtime_s)
    write(folder / "scheduler.pt", 10, mtime_s=mtime_s)
    write(folder / "rng_state.pth", 20, mtime_s=mtime_s)
    if state:
        state_file = folder / TRAINER_STATE_NAME
        state_file.write_text(json.dumps({"global_step": step, "log_history": []}))
        os.utime(state_file, (mtime_s, mtime_s))
    return folder


def test_picks_the_newest_complete_by_step_number(tmp_path):
    for step in (9, 10, 100):
        trainer_checkpoint(tmp_path, step)
    info = newest_complete(tmp_path, now_s=NOW)
    assert isinstance(info, CheckpointInfo)
    assert info.path == tmp_path / "checkpoint-100"
    assert info.step == 100


def test_info_lists_files_size_and_newest_mtime(tmp_path):
    folder = trainer_checkpoint(tmp_path, 5)
    write(folder / "sub" / "extra.bin", 7, mtime_s=NOW - 30)
    info = newest_complete(tmp_path, now_s=NOW)
    assert info.files == ("model.safetensors", "optimizer.pt", "rng_state.pth", "scheduler.pt", "sub/extra.bin",
                          TRAINER_STATE_NAME)
    assert info.size_bytes == 1000 + 2000 + 10 + 20 + 7 + (folder / TRAINER_STATE_NAME).stat().st_size
    assert info.newest_mtime_s == NOW - 30


def test_skips_a_folder_without_state_file(tmp_path, caplog):
    trainer_checkpoint(tmp_path, 100)
    trainer_checkpoint(tmp_path, 200, state=False)
    with caplog.at_level(logging.INFO, logger="guard.checkpoints"):
        info = newest_complete(tmp_path, now_s=NOW)
    assert info.step == 100
    assert "checkpoint-200" in caplog.text and f"no {TRAINER_STATE_NAME}" in caplog.text


def test_skips_a_folder_still_being_written(tmp_path, caplog):
    trainer_checkpoint(tmp_path, 100)
    trainer_checkpoint(tmp_path, 200, mtime_s=NOW - 0.5)
    with caplog.at_level(logging.INFO, logger="guard.checkpoints"):
        info = newest_complete(tmp_path, now_s=NOW, stable_for_s=2.0)
    assert info.step == 100
    assert "checkpoint-200" in caplog.text and "still being written" in caplog.text
    # the same folder counts once it has been left alone long enough
    assert newest_complete(tmp_path, now_s=NOW + 5, stable_for_s=2.0).step == 200


def test_a_folder_whose_save_the_guard_saw_settles_quietly(tmp_path, caplog):
    """A folder the job's ``torch.save`` into was seen (``quiet``) is judged at that save: the scans' settle rule
    says nothing about it at INFO. Before, a plain loop's log had "skipped checkpoint out/checkpoint-40: still being
    written (state.pt changed 0.6s ago)" for a save already secured."""
    trainer_checkpoint(tmp_path, 100)
    newer = trainer_checkpoint(tmp_path, 200, mtime_s=NOW - 0.5)
    with caplog.at_level(logging.INFO, logger="guard.checkpoints"):
        assert newest_complete(tmp_path, now_s=NOW, stable_for_s=2.0, quiet={os.path.realpath(newer)}).step == 100
    assert "still being written" not in caplog.text
    with caplog.at_level(logging.DEBUG, logger="guard.checkpoints"):
        newest_complete(tmp_path, now_s=NOW, stable_for_s=2.0, quiet={os.path.realpath(newer)})
    assert "checkpoint-200: still being written" in caplog.text  # still there at debug


def test_with_no_process_left_a_folder_counts_by_format_and_the_log_says_so(tmp_path, caplog):
    """The job's processes are gone (``stable_for_s`` 0): no "unchanged for 0.0s", which read as a contradiction."""
    trainer_checkpoint(tmp_path, 300, mtime_s=NOW - 0.1)
    with caplog.at_level(logging.INFO, logger="guard.checkpoints"):
        assert newest_complete(tmp_path, now_s=NOW, stable_for_s=0.0).step == 300
    assert "unchanged for 0.0s" not in caplog.text
    assert "whole by format (no process of the job is running to write it)" in caplog.text


def test_skips_a_folder_with_the_jit_sentinel(tmp_path, caplog):
    trainer_checkpoint(tmp_path, 100)
    folder = trainer_checkpoint(tmp_path, 200)
    write(folder / INCOMPLETE_SENTINEL_NAME, 0)
    with caplog.at_level(logging.INFO, logger="guard.checkpoints"):
        assert newest_complete(tmp_path, now_s=NOW).step == 100
    assert INCOMPLETE_SENTINEL_NAME in caplog.text
    assert why_incomplete(folder, now_s=NOW).startswith(INCOMPLETE_SENTINEL_NAME)


def test_skips_a_folder_whose_sizes_change_between_passes(tmp_path):
    trainer_checkpoint(tmp_path, 100)
    growing = trainer_checkpoint(tmp_path, 200) / "optimizer.pt"
    calls = {"n": 0}

    def stat(path):
        result = os.stat(path)
        if path == str(growing):
            calls["n"] += 1
            values = list(result)  # the writer appends between any two looks (mtime not updated yet)
            values[6] += 4096 * calls["n"]  # st_size
            return os.stat_result(values)
        return result

    assert newest_complete(tmp_path, now_s=NOW, stat=stat).step == 100
    assert "changed while scanning" in why_incomplete(growing.parent, now_s=NOW, stat=stat)


def test_accepts_the_guard_marker_instead_of_the_state_file(tmp_path):
    folder = tmp_path / "checkpoint-3"
    write(folder / "weights.pt", 100)
    write(folder / "optimizer.pt", 100)  # a Trainer-style file: the save is finished only with its last file
    assert why_incomplete(folder, now_s=NOW) is not None
    write(folder / GUARD_MARKER_NAME, 10)
    assert why_incomplete(folder, now_s=NOW) is None
    assert newest_complete(tmp_path, now_s=NOW).step == 3


def test_no_complete_checkpoint_gives_none(tmp_path):
    assert newest_complete(tmp_path / "missing", now_s=NOW) is None
    assert newest_complete(tmp_path, now_s=NOW) is None
    (tmp_path / "checkpoint-1").mkdir()
    trainer_checkpoint(tmp_path, 2, state=False)
    assert newest_complete(tmp_path, now_s=NOW) is None
    assert why_incomplete(tmp_path / "checkpoint-1", now_s=NOW) == "empty"


def test_ignores_names_that_are_not_checkpoint_n(tmp_path):
    trainer_checkpoint(tmp_path, 1)
    for name in ("tmp-checkpoint-50", "checkpoint-abc", "checkpoint-7-old", "runs"):
        folder = tmp_path / name
        write(folder / TRAINER_STATE_NAME, 5)
    write(tmp_path / "checkpoint-9", 10)  # a file, not a folder
    assert newest_complete(tmp_path, now_s=NOW).path == tmp_path / "checkpoint-1"


def test_seen_set_logs_each_skip_once(tmp_path, caplog):
    trainer_checkpoint(tmp_path, 1)
    trainer_checkpoint(tmp_path, 2, state=False)
    seen: set[tuple[str, str]] = set()
    with caplog.at_level(logging.INFO, logger="guard.checkpoints"):
        for _ in range(3):
            newest_complete(tmp_path, now_s=NOW, seen=seen)
    assert len([r for r in caplog.records if "checkpoint-2" in r.getMessage()]) == 1


def test_describe_a_trainer_folder_takes_global_step(tmp_path):
    folder = trainer_checkpoint(tmp_path, 40)
    info = describe(folder, step=999)
    assert info.step == 40
    assert TRAINER_STATE_NAME in info.files


def test_describe_a_custom_folder_takes_the_callers_step(tmp_path):
    folder = tmp_path / "my-save"
    write(folder / "model.pt", 50)
    assert describe(folder, step=12).step == 12
    assert describe(folder).step is None
    (folder / GUARD_MARKER_NAME).write_text(json.dumps({"step": 7}))
    assert describe(folder).step == 7


def test_describe_a_single_file(tmp_path):
    path = write(tmp_path / "ckpt.pt", 321)
    info = describe(path, step=3)
    assert info == CheckpointInfo(path=path, step=3, size_bytes=321, files=("ckpt.pt",), newest_mtime_s=NOW - 60,
                                  step_source="reported", admitted_by="reported")
    assert info.folder == tmp_path


def test_describe_falls_back_to_the_folder_name(tmp_path):
    folder = tmp_path / "checkpoint-8"
    write(folder / "model.pt", 5)
    assert describe(folder).step == 8


def test_describe_a_missing_path_is_an_error_with_a_hint(tmp_path):
    with pytest.raises(SupervisorError) as info:
        describe(tmp_path / "nope")
    assert "checkpoint_saved" in info.value.hint
    (tmp_path / "empty").mkdir()
    with pytest.raises(SupervisorError):
        describe(tmp_path / "empty")


def test_an_earlier_runs_checkpoints_count_only_when_resumed_from(tmp_path, caplog):
    import time as _time

    old = trainer_checkpoint(tmp_path, 46, mtime_s=NOW - 3600)
    write(tmp_path / "model_step_30.pt", 10, mtime_s=NOW - 3600)
    started = _time.time() + 0.01  # the job starts after the earlier run's files were written
    _time.sleep(0.05)
    with caplog.at_level(logging.INFO, logger="guard.checkpoints"):
        assert newest_complete(tmp_path, now_s=NOW, since_s=started) is None
    assert f"skipped checkpoint {old}: found and left alone" in caplog.text
    assert "model_step_30.pt (saved before this run started" in caplog.text
    assert newest_complete(tmp_path, now_s=NOW, since_s=started, resumed=[str(old)]).path == old
    assert newest_complete(tmp_path, now_s=NOW).path == old  # without the rule: as before
    new = trainer_checkpoint(tmp_path, 10, mtime_s=NOW - 3000)  # this run's (a back-dated mtime changes nothing)
    assert newest_complete(tmp_path, now_s=NOW, since_s=started).path == new


def test_a_plain_loops_checkpoint_folder_counts_once_settled_and_whole(tmp_path):
    torch = pytest.importorskip("torch")
    folder = tmp_path / "checkpoint-20"
    folder.mkdir()
    torch.save({"w": torch.zeros(3)}, folder / "model.pt")
    (folder / "config.json").write_text("{}")
    for name in ("model.pt", "config.json"):
        os.utime(folder / name, (NOW - 60, NOW - 60))
    assert why_incomplete(folder, now_s=NOW) is None
    assert why_incomplete(folder, now_s=NOW - 59) is not None  # just written: not settled yet
    data = (folder / "model.pt").read_bytes()
    (folder / "model.pt").write_bytes(data[: len(data) // 2])
    os.utime(folder / "model.pt", (NOW - 60, NOW - 60))
    assert "not whole by format" in (why_incomplete(folder, now_s=NOW) or "")
    (folder / "model.pt").unlink()
    assert why_incomplete(folder, now_s=NOW) == "no model file"
