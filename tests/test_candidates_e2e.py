"""End to end, issue 33 items 4, 5 and 6: what the guard takes as a checkpoint candidate and what the next run
resumes from. Real guard, real job processes, torch on the CPU, a folder destination."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import JOBS, loaded_s, run_guard, secured_step

from guard.secure.suspects import SUSPECT_MARKER_NAME, mark_suspect, read_taints

pytestmark = [pytest.mark.slow]

FAST = ["--skip-check", "python=imports are checked by the other tests"]


def test_saves_into_new_folders_are_each_secured_and_dev_null_is_no_output_folder(tmp_path: Path) -> None:
    """Before: the output folder was locked onto the first save's parent (``out/run-10``): a 50-step run ended
    ``PASS`` with step 10 pushed as the final model and as ``last-checkpoint``; a ``torch.save`` to ``/dev/null``
    made ``/dev`` the output folder and nothing real was secured."""
    out, dest = tmp_path / "out", tmp_path / "dest"
    run = run_guard([*FAST, "--push-interval", "0s", "--push-to", str(dest), str(JOBS / "new_folders.py"), str(out),
                     "--steps", "50", "--every", "10", "--dev-null"], timeout_s=120)
    fields = run.fields()
    assert (fields["status"], run.returncode) == ("PASS", 0), run.stderr[-3000:]
    assert fields["checkpoint"] == str(out / "run-50" / "model.pt"), run.verdict
    assert torch.load(dest / "model.pt", weights_only=True)["step"] == 50, "the final model is the newest save"
    assert secured_step(dest) == 50
    assert "/dev/null, a character device: not a checkpoint" in run.stderr
    assert not any(p.name == "null" for p in dest.rglob("*"))


def test_timms_renamed_save_is_followed_and_secured(tmp_path: Path) -> None:
    """timm's ``CheckpointSaver`` saves ``tmp.pth.tar`` and renames it to ``last.pth.tar`` (timm PR #693); before,
    nothing of it was ever taken, though whole on disk."""
    out, dest = tmp_path / "out", tmp_path / "dest"
    run = run_guard([*FAST, "--push-interval", "0s", "--push-to", str(dest), str(JOBS / "timm_saver.py"), str(out),
                     "--epochs", "4", "--steps-per-epoch", "10"], timeout_s=120)
    fields = run.fields()
    assert (fields["status"], run.returncode) == ("PASS", 0), run.stderr[-3000:]
    assert torch.load(dest / "last.pth.tar", weights_only=True)["epoch"] == 4
    secured = dest / "last-checkpoint" / "last.pth.tar"
    assert secured.exists() and sorted(p.name for p in secured.parent.iterdir()) == ["guard_manifest.json",
                                                                                      "last.pth.tar"]
    assert torch.load(secured, weights_only=True)["epoch"] * 10 == secured_step(dest)
    assert not (dest / "last-checkpoint" / "tmp.pth.tar").exists()


def test_a_job_rotating_a_folder_a_second_loses_at_most_one_save_interval(tmp_path: Path) -> None:
    """A loop saving ``checkpoint-N/`` (model and ``trainer_state.json``) about every second and deleting the older
    one never had a folder unchanged for 2 s: before, ``TIMEOUT exit=124 secured=no`` (or 543 of 783 steps lost);
    after the job was stopped the guard still waited for the folder to be "unchanged"."""
    out, dest = tmp_path / "out", tmp_path / "dest"
    every = 20
    run = run_guard([*FAST, "--timeout", loaded_s(30), "--push-to", str(dest), str(JOBS / "rotating_folders.py"),
                     str(out), "--every", str(every), "--step_s", "0.05"], timeout_s=120)
    fields = run.fields()
    assert (fields["status"], fields["secured"], run.returncode) == ("TIMEOUT", "yes", 75), run.stderr[-3000:]
    lost = int(fields["step"]) - int(fields["secured_step"])
    assert 0 <= lost <= every, run.verdict
    assert secured_step(dest) == int(fields["secured_step"])


def test_a_healthy_run_saving_in_place_after_a_nan_run_is_secured(tmp_path: Path) -> None:
    """nanoGPT's pattern (``out/ckpt.pt`` saved in place): after one NaN run marked it suspect, a healthy run had
    14 saves of 14 refused and ended ``TIMEOUT exit=124 secured=no``, its hint blaming the margin."""
    out, dest = tmp_path / "out", tmp_path / "dest"
    nano = str(JOBS / "nanogpt_like.py")
    first = run_guard([*FAST, "--push-interval", "0s", "--push-to", str(dest), nano, f"--out_dir={out}",
                       "--eval_interval=20", "--nan_at=30", "--max_iters=200"], timeout_s=120)
    assert first.fields()["reason"] == "non_finite_loss", first.stderr[-3000:]
    # the NaN run's taint, beside its folder: step 30's NaN came from the weights after step 29, suspect from there
    assert read_taints(out) and read_taints(out)[0].first_step == 29, read_taints(out)
    # its save after the NaN, marked as the guard marks one (whichever of the run's saves it saw last)
    assert mark_suspect(out / "ckpt.pt", step=40, first_non_finite_step=30, run_id=read_taints(out)[0].run_id)
    # saves more than snapshots.SNAPSHOT_BELOW_S apart: each one is pushed from out/ckpt.pt itself, marker beside it
    run = run_guard([*FAST, "--timeout", loaded_s(30), "--push-interval", "0s", "--push-to", str(dest), nano,
                     f"--out_dir={out}", "--eval_interval=550", "--step_s=0.02"], timeout_s=120)
    fields = run.fields()
    assert (fields["status"], fields["secured"], run.returncode) == ("TIMEOUT", "yes", 75), run.stderr[-3000:]
    state = torch.load(dest / "last-checkpoint" / "ckpt.pt", weights_only=True)
    assert all(bool(torch.isfinite(t).all()) for t in state["model"].values())


def test_resume_never_takes_a_tainted_runs_checkpoint_whatever_its_marker(tmp_path: Path) -> None:
    """The marker race: a folder saved just after the NaN while "still being written" got no marker, and the next
    ``--resume on`` took it (6 runs of 6). The run's taint, recorded beside the output folder, refuses it."""
    out, dest = tmp_path / "out", tmp_path / "dest"
    job = [str(JOBS / "rotating_folders.py"), str(out), "--every", "10", "--step_s", "0.02"]
    first = run_guard([*FAST, "--check-every", "100000", "--push-interval", "0s", "--push-to", str(dest), *job,
                       "--nan-at", "25"], timeout_s=120)
    assert first.fields()["reason"] == "non_finite_loss", first.stderr[-3000:]
    assert (out / "checkpoint-30").is_dir() and secured_step(dest) == 20, first.stderr[-3000:]
    for marker in out.rglob(SUSPECT_MARKER_NAME):  # as the race left it: no marker
        marker.unlink()
    run = run_guard([*FAST, "--resume", "on", "--push-to", str(dest), *job, "--steps", "12"], timeout_s=120)
    fields = run.fields()
    assert fields["status"] == "PASS", run.stderr[-3000:]
    assert "checkpoint-30" not in fields.get("resumed_from", ""), run.verdict
    assert "checkpoint-20" in fields["resumed_from"], run.verdict
