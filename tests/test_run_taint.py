"""The taint belongs to the run (issue 33, item 4): a run's first non-finite step is recorded beside its output
folders, and resume refuses every checkpoint of that run at or after it, wherever it lies and whatever happened to
its marker; a marker names the save it marks and is void once that path is written again or another run starts."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import torch
from test_candidates import Rig

from guard.secure import resume
from guard.secure.checkpoints import TRAINER_STATE_NAME, newest_complete
from guard.secure.securer import Securer
from guard.secure.suspects import (
    RunTaint,
    close_taints,
    is_marked_suspect,
    mark_suspect,
    read_taints,
    record_taint,
    tainted_by,
)


def trainer_checkpoint(out: Path, step: int) -> Path:
    folder = out / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    torch.save({"w": torch.full((4,), float(step))}, folder / "model.pt")
    (folder / TRAINER_STATE_NAME).write_text(json.dumps({"global_step": step}))
    return folder


def test_a_marker_is_void_once_its_path_is_written_again(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt.pt"
    ckpt.write_bytes(b"nan weights")
    mark_suspect(ckpt, step=12, first_non_finite_step=9, run_id="run-a")
    assert is_marked_suspect(ckpt) and is_marked_suspect(ckpt, run_id="run-a")
    assert not is_marked_suspect(ckpt, run_id="run-b"), "another run's marker is void during that run"
    ckpt.write_bytes(b"good weights")  # the next run saves the same path
    assert not is_marked_suspect(ckpt) and not is_marked_suspect(ckpt, run_id="run-a")


def test_a_folder_marker_names_its_files_and_is_void_after_a_rewrite(tmp_path: Path) -> None:
    folder = trainer_checkpoint(tmp_path, 40)
    marker = mark_suspect(folder, step=40, first_non_finite_step=30, run_id="run-a")
    assert marker is not None and is_marked_suspect(folder)
    body = json.loads(marker.read_text())
    assert body["path"] == str(folder) and body["run_id"] == "run-a" and body["step"] == 40
    stamp = time.time() + 5
    os.utime(folder / "model.pt", (stamp, stamp))  # saved over in place
    assert not is_marked_suspect(folder)


def test_a_marker_without_a_signature_names_no_save(tmp_path: Path) -> None:
    """The old markers (``{"step", "first_non_finite_step"}``) locked every later run out of the path."""
    ckpt = tmp_path / "ckpt.pt"
    ckpt.write_bytes(b"x")
    (tmp_path / "ckpt.pt.guard-suspect.json").write_text(json.dumps({"step": 9, "first_non_finite_step": 4}))
    assert not is_marked_suspect(ckpt)


def test_a_taint_covers_the_runs_saves_at_or_after_its_step(tmp_path: Path) -> None:
    taint = RunTaint("run-a", 107, started_s=1000.0, tainted_at_s=1100.0)
    assert taint.covers(108, 1090.0) and taint.covers(107, 1200.0)
    assert not taint.covers(100, 1090.0), "before its first non-finite step"
    assert not taint.covers(200, 900.0), "saved before the run started: an earlier run's"
    assert taint.covers(None, 1150.0) and not taint.covers(None, 1050.0), "step unknown: by the time heard"
    record_taint(tmp_path, taint)
    record_taint(tmp_path, RunTaint("run-a", 110, 1000.0, 1200.0))  # a later step never raises the first one
    assert [t.first_step for t in read_taints(tmp_path)] == [107]
    (ended,) = close_taints(tmp_path, run_id="run-b", at_s=1300.0)
    assert ended.ended_s == 1300.0 and not ended.covers(200, 1400.0), "written after a later run started"
    assert close_taints(tmp_path, run_id="run-c", at_s=2000.0)[0].ended_s == 1300.0, "an end stays"
    assert tainted_by([ended])(108, 1200.0) is not None


def test_resume_refuses_a_tainted_runs_checkpoint_that_no_marker_names(tmp_path: Path) -> None:
    """The marker race: ``checkpoint-108``, saved one step after the NaN of step 107 while the folder was "still
    being written", got no marker; the next ``--resume on`` took it ("as new as or newer than the secured step
    100"), weights not finite (6 runs of 6). The run's taint refuses it."""
    securer = Securer(str(tmp_path / "dest"))
    out = tmp_path / "out"
    started = time.time() - 30
    securer.push_checkpoint(trainer_checkpoint(tmp_path / "run1", 100), step=100, deadline=math.inf)
    bad = trainer_checkpoint(out, 108)  # no marker
    record_taint(out, RunTaint("run-a", 107, started_s=started, tainted_at_s=time.time() + 1))
    chosen = resume.choose(out, securer, deadline=time.monotonic() + 60, abort=lambda: False)
    assert chosen is not None and chosen.step == 100 and chosen.source == "destination"
    assert bad.is_dir(), "left where it lies"
    assert read_taints(out)[0].ended_s is not None, "the resume ends the run's taint: what follows is not its"


def test_a_later_runs_checkpoint_is_not_the_tainted_runs(tmp_path: Path) -> None:
    securer = Securer(str(tmp_path / "dest"))
    out = tmp_path / "out"
    securer.push_checkpoint(trainer_checkpoint(tmp_path / "run1", 100), step=100, deadline=math.inf)
    record_taint(out, RunTaint("run-a", 107, started_s=time.time() - 60, tainted_at_s=time.time() - 50))
    close_taints(out, run_id="run-b", at_s=time.time() - 40)  # run b started on this folder then
    later = trainer_checkpoint(out, 120)  # run b's, healthy
    chosen = resume.choose(out, securer, deadline=time.monotonic() + 60, abort=lambda: False)
    assert chosen is not None and chosen.path == later and chosen.source == "output folder"


def test_securing_records_its_taint_beside_every_output_folder(tmp_path: Path) -> None:
    out = tmp_path / "out"
    other = tmp_path / "other-run"
    record_taint(out, RunTaint("run-a", 5, started_s=time.time() - 100, tainted_at_s=time.time() - 90))
    rig = Rig(tmp_path, output_dir=out)
    assert read_taints(out)[0].ended_s == rig.wall_start - 1.0, "run-a ended when this run started"
    rig.train_to(10)
    rig.securing.on_taint(rig.link, 9)
    mine = {t.run_id: t for t in read_taints(out)}["run-b"]
    # a NaN loss at step 9 came from the weights saved at step 8: the run's saves are suspect from 8 on
    assert (mine.first_step, mine.started_s, mine.ended_s) == (8, rig.wall_start - 1.0, None)
    rig.securing.folder.new_folder(str(other))  # a folder this run reaches later gets it too
    assert [t.first_step for t in read_taints(other)] == [8]


def test_a_healthy_run_saving_in_place_after_a_nan_run_is_not_locked_out(tmp_path: Path) -> None:
    """nanoGPT's pattern (``out/ckpt.pt`` saved in place): after one NaN run marked it, a healthy run had 14 saves
    of 14 refused and ended ``TIMEOUT exit=124 secured=no`` with a hint blaming the margin."""
    out = tmp_path / "out"
    out.mkdir()
    torch.save({"w": torch.full((4,), float("nan")), "step": 12}, out / "ckpt.pt")
    mark_suspect(out / "ckpt.pt", step=12, first_non_finite_step=9, run_id="run-a")
    rig = Rig(tmp_path, output_dir=out)
    for step in (4, 8, 12):
        rig.train_to(step)
        rig.report(rig.save(out / "ckpt.pt", step))
        rig.tick(1.5)
        rig.tick(1.5)
        manifest = json.loads((rig.dest / "last-checkpoint" / "guard_manifest.json").read_text())
        assert manifest["step"] == step
    assert torch.load(rig.dest / "last-checkpoint" / "ckpt.pt", weights_only=True)["step"] == 12


def test_this_runs_marker_still_refuses_its_own_unchanged_save(tmp_path: Path) -> None:
    out = tmp_path / "out"
    trainer_checkpoint(out, 10)
    bad = trainer_checkpoint(out, 20)
    mark_suspect(bad, step=20, first_non_finite_step=15, run_id="run-b")
    later = time.time() + 60
    found = newest_complete(out, now_s=later, run_id="run-b")
    assert found is not None and found.step == 10
    found = newest_complete(out, now_s=later, run_id="run-c")
    assert found is not None and found.step == 20, "another run's marker is its taint's business"
