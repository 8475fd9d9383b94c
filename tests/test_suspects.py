"""Suspects stay suspects: a checkpoint marked as saved after the first non-finite loss is skipped by the scan,
by resume and by every later push, and named in the log."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import pytest

from guard.errors import PushFailedError
from guard.secure import resume
from guard.secure.checkpoints import (
    SUSPECT_MARKER_NAME,
    TRAINER_STATE_NAME,
    is_marked_suspect,
    loose_files,
    mark_suspect,
    newest_complete,
)
from guard.secure.securer import Securer


def trainer_checkpoint(out: Path, step: int) -> Path:
    folder = out / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"w" * 100)
    (folder / TRAINER_STATE_NAME).write_text(json.dumps({"global_step": step}))
    return folder


def test_markers_for_folders_and_loose_files(tmp_path: Path) -> None:
    folder = trainer_checkpoint(tmp_path, 5)
    assert not is_marked_suspect(folder)
    assert mark_suspect(folder, step=5, first_non_finite_step=4) == folder / SUSPECT_MARKER_NAME
    assert is_marked_suspect(folder)
    loose = tmp_path / "ckpt.pt"
    loose.write_bytes(b"x")
    marker = mark_suspect(loose, step=9, first_non_finite_step=4)
    assert marker == tmp_path / "ckpt.pt.guard-suspect.json" and is_marked_suspect(loose)
    body = json.loads(marker.read_text())
    assert body["path"] == str(loose) and (body["step"], body["first_non_finite_step"]) == (9, 4)
    assert (body["size_bytes"], body["mtime_ns"]) == (1, loose.stat().st_mtime_ns)


def test_the_scan_skips_a_suspect_folder_and_names_it(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    trainer_checkpoint(tmp_path, 100)
    bad = trainer_checkpoint(tmp_path, 108)
    mark_suspect(bad, step=108, first_non_finite_step=107)
    with caplog.at_level(logging.INFO, logger="guard.checkpoints"):
        found = newest_complete(tmp_path, now_s=time.time() + 60)
    assert found is not None and found.step == 100
    assert f"skipped checkpoint {bad}: marked suspect" in caplog.text
    # reported by the job as done: still a suspect
    assert newest_complete(tmp_path, now_s=time.time() + 60, reported=[str(bad)]).step == 100  # type: ignore[union-attr]


def test_loose_files_leave_a_suspect_file_out(tmp_path: Path) -> None:
    (tmp_path / "model_step_20.pt").write_bytes(b"a" * 10)
    (tmp_path / "model_step_40.pt").write_bytes(b"b" * 10)
    later = time.time() + 60
    assert loose_files(tmp_path, now_s=later).step == 40  # type: ignore[union-attr]
    mark_suspect(tmp_path / "model_step_40.pt", step=40, first_non_finite_step=31)
    assert loose_files(tmp_path, now_s=later).step == 20  # type: ignore[union-attr]


def test_every_later_push_refuses_a_suspect(tmp_path: Path) -> None:
    securer = Securer(str(tmp_path / "dest"))
    good = trainer_checkpoint(tmp_path / "out", 100)
    securer.push_checkpoint(good, step=100, deadline=math.inf)
    bad = trainer_checkpoint(tmp_path / "out", 108)
    mark_suspect(bad, step=108, first_non_finite_step=107)
    with pytest.raises(PushFailedError, match="marked suspect"):
        securer.push_checkpoint(bad, step=108, deadline=math.inf)
    (tmp_path / "out" / "ckpt.pt").write_bytes(b"z" * 10)
    mark_suspect(tmp_path / "out" / "ckpt.pt", step=110, first_non_finite_step=107)
    with pytest.raises(PushFailedError, match="marked suspect"):
        securer.push_checkpoint(tmp_path / "out", step=110, files=["ckpt.pt"], deadline=math.inf)
    assert json.loads((tmp_path / "dest" / "last-checkpoint" / "guard_manifest.json").read_text())["step"] == 100


def test_resume_never_picks_a_suspect_over_the_secured_one(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # FAIL non_finite_loss: step 100 secured, checkpoint-108 saved after the NaN and left on disk (marked)
    securer = Securer(str(tmp_path / "dest"))
    out = tmp_path / "out"
    securer.push_checkpoint(trainer_checkpoint(tmp_path / "run1", 100), step=100, deadline=math.inf)
    bad = trainer_checkpoint(out, 108)
    mark_suspect(bad, step=108, first_non_finite_step=107)
    with caplog.at_level(logging.INFO, logger="guard"):
        chosen = resume.choose(out, securer, deadline=time.monotonic() + 60, abort=lambda: False)
    assert chosen is not None and chosen.step == 100 and chosen.source == "destination"
    assert f"skipped checkpoint {bad}: marked suspect" in caplog.text
    assert bad.is_dir() and is_marked_suspect(bad)  # left where it is, still marked
