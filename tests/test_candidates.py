"""What securing takes as a checkpoint candidate (issue 33, items 5 and 6): every save the agent reports is one of
its own, wherever it lies (no output folder lock); special files never are; a save renamed after its report is
followed by its signature; once the job's processes are gone its folders are judged by format alone.

The real ``Securing`` (its scans inline), a real folder destination (``guard.secure.securer.Securer``), real files;
a fake clock and loop (``fakes``), pushes run in-process (``secure_machine.InlinePusher``)."""

from __future__ import annotations

import json
import os
import signal
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from fakes import FakeClock, FakeLink, InlineFs
from secure_machine import InlinePusher

from guard.contract import RunResult
from guard.secure import scans
from guard.secure.budget import Deadline, MarginEstimator
from guard.secure.securer import Securer
from guard.secure.securing import SCAN_EVERY_S, Securing

CLOCK_START = 1000.0


class Rig:
    """Securing around a fake loop with a real folder destination; ``output_dir`` None: not given."""

    def __init__(self, tmp_path: Path, *, output_dir: Path | None = None, timeout_s: float | None = None) -> None:
        self.root, self.dest = tmp_path, tmp_path / "dest"
        self.clock = FakeClock(CLOCK_START)
        self.wall_start = time.time()
        self.pusher = InlinePusher(self.clock, lambda: Securer(str(self.dest)))
        deadline = (Deadline(self.wall_start, timeout_s, self.wall_start + timeout_s, "--timeout") if timeout_s
                    else Deadline(self.wall_start, None, None, "none"))
        self.securing = Securing(deadline=deadline, estimator=MarginEstimator(log_changes=False),
                                 securer=Securer(str(self.dest)),
                                 output_dir=str(output_dir) if output_dir is not None else None, clock=self.clock,
                                 wall=self.wall, grace_s=20.0, push_interval_s=0.0,
                                 pusher_factory=lambda dest, token: self.pusher, fs=InlineFs(), run_id="run-b")
        self.link = FakeLink(check_every=4)
        self.securing.before_start(self.wall_start - 1.0)

    def wall(self) -> float:
        """Epoch seconds: the real time (the files' mtimes are real), moved on by the fake clock."""
        return time.time() + (self.clock.now - CLOCK_START)

    def train_to(self, step: int) -> None:
        self.link.state.progress.step, self.link.state.progress.loss_source = step, "agent"
        self.link.ranks = {0: step}
        self.securing.on_step(self.link, self.clock())

    def tick(self, dt: float = 0.5) -> None:
        self.clock.advance(dt)
        self.securing.tick(self.link, self.clock())

    def save(self, path: Path, step: int, value: float | None = None) -> dict[str, Any]:
        """``torch.save`` of a small state dict at ``path``; returns the agent's ``file_saved`` message."""
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"w": torch.full((4,), float(step) if value is None else value), "step": step}, path)
        return file_saved(path, step)

    def report(self, message: dict[str, Any]) -> None:
        self.securing.on_file_saved(self.link, message)

    def end(self, code: int = 0) -> RunResult:
        self.link.exit(code)
        self.securing.on_job_exit(self.link, self.clock())
        for _ in range(200):
            if not self.securing.busy():
                break
            self.tick()
        result = RunResult("PASS", "ok", 0, step=self.link.state.progress.step)
        self.securing.finish(result, step=result.step)
        return result


def file_saved(path: Path, step: int) -> dict[str, Any]:
    st = os.stat(path)
    return {"t": "file_saved", "path": str(path), "step": step, "rank": 0, "size": st.st_size,
            "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


def saved_step(path: Path) -> int:
    return int(torch.load(path, weights_only=True)["step"])


def recorded_step(dest: Path) -> int | None:
    manifest = dest / "last-checkpoint" / "guard_manifest.json"
    return json.loads(manifest.read_text())["step"] if manifest.exists() else None


# -- no output folder lock (item 5) ------------------------------------------------------------------------------


def test_saves_into_new_folders_are_each_a_candidate_and_the_final_push_takes_the_newest(tmp_path: Path) -> None:
    """Before: the output folder was locked onto the first save's parent (``out/run-10``): the later saves were
    ignored, step 10 was pushed as the final model and as ``last-checkpoint`` of a 50-step run."""
    rig = Rig(tmp_path)
    for step in (10, 20, 30, 40, 50):
        rig.train_to(step)
        rig.report(rig.save(tmp_path / "out" / f"run-{step}" / "model.pt", step))
        rig.tick(1.5)
        rig.tick(1.5)
    result = rig.end()
    assert result.status == "PASS"
    assert saved_step(rig.dest / "model.pt") == 50, "the final model is the newest save"
    assert recorded_step(rig.dest) == 50 and saved_step(rig.dest / "last-checkpoint" / "model.pt") == 50
    assert rig.securing.output_dir == str(tmp_path / "out" / "run-50")


def test_a_save_to_dev_null_or_a_fifo_is_never_a_candidate_nor_the_output_folder(tmp_path: Path) -> None:
    """Before: ``torch.save(obj, "/dev/null")`` made ``/dev`` the output folder and the real ``out/ckpt.pt`` was
    never secured."""
    rig = Rig(tmp_path)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    rig.train_to(5)
    rig.report({"t": "file_saved", "path": "/dev/null", "step": 5, "rank": 0, "size": 0, "mtime_ns": 0, "inode": 0})
    rig.report({"t": "file_saved", "path": str(fifo), "step": 5, "rank": 0})
    rig.tick(1.5)
    assert rig.securing.output_dir is None and rig.securing.plan.report().newest is None
    rig.train_to(10)
    rig.report(rig.save(tmp_path / "out" / "ckpt.pt", 10))
    rig.tick(1.5)
    rig.end()
    assert rig.securing.output_dir == str(tmp_path / "out")
    assert recorded_step(rig.dest) == 10 and saved_step(rig.dest / "last-checkpoint" / "ckpt.pt") == 10


def test_disk_names_what_a_special_file_is(tmp_path: Path) -> None:
    disk = scans.Disk()
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    assert disk.file_saved("/dev/null", 3, None).special == "a character device"
    assert disk.file_saved(str(fifo), 3, str(tmp_path)).special == "a FIFO"
    seen = disk.file_saved("/dev/null", 3, None)
    assert seen.info is None and seen.output_dir is None


def _timm_save(folder: Path, epoch: int, *, rename: bool) -> dict[str, Any]:
    """timm's ``CheckpointSaver``: ``tmp.pth.tar`` saved, its report taken, then renamed to ``last.pth.tar`` and
    hard-linked as ``checkpoint-N.pth.tar`` (timm PR #693); ``rename`` False: the report is handled before the
    rename (the caller renames later)."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / "tmp.pth.tar"
    torch.save({"epoch": epoch, "step": epoch, "w": torch.ones(3)}, tmp)
    message = file_saved(tmp, epoch)
    if rename:
        _timm_rename(folder, epoch)
    return message


def _timm_rename(folder: Path, epoch: int) -> None:
    os.replace(folder / "tmp.pth.tar", folder / "last.pth.tar")
    os.link(folder / "last.pth.tar", folder / f"checkpoint-{epoch}.pth.tar")


def test_a_save_renamed_before_its_report_is_handled_is_found_by_its_signature(tmp_path: Path) -> None:
    """timm writes ``tmp.pth.tar`` and renames it to ``last.pth.tar`` (timm PR #693); before: never taken, though
    whole on disk (``.pth.tar`` was no model file, and the reported name was gone)."""
    rig = Rig(tmp_path)
    folder = tmp_path / "output" / "train" / "exp"
    rig.train_to(1)
    rig.report(_timm_save(folder, 1, rename=True))
    rig.tick(1.5)
    newest = rig.securing.plan.report().newest
    assert newest is not None and newest.path == folder / "last.pth.tar" and newest.step == 1
    rig.end()
    assert recorded_step(rig.dest) == 1
    assert saved_step(rig.dest / "last-checkpoint" / "last.pth.tar") == 1


def test_a_save_whose_temporary_folder_was_renamed_before_its_report_is_handled_is_found(tmp_path: Path) -> None:
    """A plain loop saves ``out/tmp-checkpoint-N/model.pt`` and renames the folder to ``checkpoint-N`` right after
    (transformers #29399's pattern), before the guard looks at the report. Before: the save was taken for gone and,
    with no --output-dir, the output folder was never learnt: SIGTERM after 25 s of saves every 6 s said 'no
    complete checkpoint to secure' (exit 143)."""
    rig = Rig(tmp_path)
    out = tmp_path / "out"
    rig.train_to(60)
    scratch, final = out / "tmp-checkpoint-60", out / "checkpoint-60"
    scratch.mkdir(parents=True)
    torch.save({"step": 60, "w": torch.ones(3)}, scratch / "model.pt")
    message = file_saved(scratch / "model.pt", 60)
    (scratch / "trainer_state.json").write_text(json.dumps({"global_step": 60}))
    os.rename(scratch, final)
    rig.report(message)
    rig.tick(1.5)
    assert rig.securing.output_dir == str(out)
    rig.tick(SCAN_EVERY_S + 2.5)
    newest = rig.securing.plan.report().newest
    assert newest is not None and newest.path == final and newest.step == 60
    rig.end()
    assert recorded_step(rig.dest) == 60
    assert sorted(p.name for p in (rig.dest / "last-checkpoint").iterdir()) == [
        "guard_manifest.json", "model.pt", "trainer_state.json"]


def test_a_save_still_under_its_temporary_name_is_followed_until_renamed(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    folder = tmp_path / "output" / "train" / "exp"
    rig.train_to(1)
    rig.report(_timm_save(folder, 1, rename=False))
    rig.tick(1.5)
    assert rig.securing.plan.report().newest is None, "tmp.pth.tar is about to be renamed: not taken under it"
    assert rig.securing.output_dir == str(folder)
    _timm_rename(folder, 1)
    rig.tick(SCAN_EVERY_S + 0.5)
    newest = rig.securing.plan.report().newest
    assert newest is not None and newest.path == folder / "last.pth.tar" and newest.step == 1
    rig.tick(1.5)
    assert recorded_step(rig.dest) == 1 and saved_step(rig.dest / "last-checkpoint" / "last.pth.tar") == 1
    rig.train_to(2)
    rig.report(_timm_save(folder, 2, rename=False))  # the next epoch: its rename replaces last.pth.tar
    _timm_rename(folder, 2)
    rig.end()  # the exit's scan finds it renamed; the final model is pushed from its folder
    assert saved_step(rig.dest / "last.pth.tar") == 2


def test_a_file_saved_into_a_checkpoint_folder_makes_the_folder_a_candidate(tmp_path: Path) -> None:
    """``out/checkpoint-N/model.pt`` saved by a plain loop: the folder is taken whole once the job trained on,
    without the 2 s settle time (a loop that saves every second never had one that old)."""
    rig = Rig(tmp_path)
    out = tmp_path / "out"
    rig.train_to(10)
    message = rig.save(out / "checkpoint-10" / "model.pt", 10)
    (out / "checkpoint-10" / "trainer_state.json").write_text(json.dumps({"global_step": 10}))
    rig.report(message)
    rig.train_to(11)  # trained on past the save
    rig.tick(0.1)
    newest = rig.securing.plan.report().newest
    assert newest is not None and newest.path == out / "checkpoint-10"
    assert set(newest.files) == {"model.pt", "trainer_state.json"}


# -- a stopped job writes nothing (item 6) ----------------------------------------------------------------------


def _rotating_folder(out: Path, step: int) -> Path:
    for old in out.glob("checkpoint-*"):
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    folder = out / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    torch.save({"w": torch.ones(2), "step": step}, folder / "model.pt")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return folder


def test_once_the_job_is_gone_its_freshest_folder_counts_at_once(tmp_path: Path) -> None:
    """A loop that saves ``checkpoint-N/`` every ~1 s (written by other means) and deletes the older ones never has
    one unchanged for 2 s; before, after the job was stopped the guard still waited for the folder to be
    "unchanged": the exit's scan found nothing."""
    out = tmp_path / "out"
    rig = Rig(tmp_path, output_dir=out)
    rig.train_to(30)
    _rotating_folder(out, 30)
    rig.link.exit(-signal.SIGKILL)
    rig.securing.on_job_exit(rig.link, rig.clock())  # the exit's scan, inline: no clock moved
    newest = rig.securing.plan.report().newest
    assert newest is not None and newest.path == out / "checkpoint-30"


def test_a_stopped_jobs_folder_still_needs_its_format_whole(tmp_path: Path) -> None:
    out = tmp_path / "out"
    rig = Rig(tmp_path, output_dir=out)
    folder = out / "checkpoint-7"
    folder.mkdir(parents=True)
    torch.save({"w": torch.ones(64)}, folder / "model.pt")
    data = (folder / "model.pt").read_bytes()
    (folder / "model.pt").write_bytes(data[: len(data) // 2])  # cut short by the kill
    other = out / "checkpoint-8"
    other.mkdir()
    (other / "model.bin").write_bytes(b"no format the guard knows" * 10)  # cannot be judged by format: waits
    rig.link.exit(-signal.SIGKILL)
    rig.securing.on_job_exit(rig.link, rig.clock())
    assert rig.securing.plan.report().newest is None
    assert zipfile.is_zipfile(folder / "model.pt") is False


@pytest.mark.parametrize("alive", [True, False])
def test_the_settle_time_applies_while_a_process_of_the_job_still_runs(tmp_path: Path, alive: bool) -> None:
    out = tmp_path / "out"
    rig = Rig(tmp_path, output_dir=out)
    _rotating_folder(out, 12)
    rig.link.exit(-signal.SIGTERM)
    rig.link.alive = alive  # the main process ended; a child (a data loader, a launcher's rank) may not have
    rig.securing.on_job_exit(rig.link, rig.clock())
    newest = rig.securing.plan.report().newest
    assert (newest is None) == alive
