"""Checkpoint layouts as jobs write them (guard.secure.checkpoints): DeepSpeed's global_stepN with its latest file,
a torch.distributed.checkpoint folder (.metadata written last), accelerate's folders, a plain loop's folder; files
written by the test the way those libraries write them (torch itself for the formats)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest

from guard.secure.checkpoints import newest_complete, why_incomplete

torch = pytest.importorskip("torch")
LATER = 4_000_000_000.0  # far in the future: every file settled


def deepspeed_save(out: Path, step: int, *, ranks: int = 2, latest: bool = True) -> Path:
    folder = out / f"global_step{step}"
    folder.mkdir(parents=True)
    torch.save({"module": torch.nn.Linear(4, 4).state_dict()}, folder / "mp_rank_00_model_states.pt")
    for rank in range(ranks):
        torch.save({"optimizer_state_dict": {"step": step}}, folder / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    if latest:
        (out / "latest").write_text(f"global_step{step}")
    return folder


def test_deepspeed_global_step_is_complete_once_latest_names_it(tmp_path: Path) -> None:
    old = deepspeed_save(tmp_path, 10)
    new = deepspeed_save(tmp_path, 20, latest=False)  # every rank's part written, latest not yet moved
    assert "latest" in (why_incomplete(new, now_s=LATER) or "")
    found = newest_complete(tmp_path, now_s=LATER)
    assert found is not None and found.path == old and found.step == 10
    (tmp_path / "latest").write_text("global_step20")
    found = newest_complete(tmp_path, now_s=LATER)
    assert found is not None and found.path == new and found.step == 20
    assert set(found.files) == {"mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                "zero_pp_rank_1_mp_rank_00_optim_states.pt"}


def test_deepspeed_without_latest_is_not_complete(tmp_path: Path) -> None:
    folder = deepspeed_save(tmp_path, 5, latest=False)
    assert "no latest file" in (why_incomplete(folder, now_s=LATER) or "")


def test_a_distcp_folder_is_complete_once_its_metadata_names_every_shard(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "step_30"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": torch.nn.Linear(16, 16).state_dict()}, checkpoint_id=str(folder))
    found = newest_complete(tmp_path, now_s=LATER)
    assert found is not None and found.path == folder and ".metadata" in found.files
    meta = (folder / ".metadata").read_bytes()
    (folder / ".metadata").unlink()  # rank 0 writes it last
    assert ".metadata" in (why_incomplete(folder, now_s=LATER) or "")
    (folder / ".metadata").write_bytes(meta)
    (folder / "__1_0.distcp").write_bytes(b"x" * 64)  # another rank's shard the metadata does not name
    assert "not whole by format" in (why_incomplete(folder, now_s=LATER) or "")


def test_accelerate_folder_needs_its_rng_state_and_a_plain_folder_settles(tmp_path: Path) -> None:
    acc = tmp_path / "checkpoints" / "checkpoint_2"
    acc.mkdir(parents=True)
    torch.save({"state": {}}, acc / "optimizer.bin")
    torch.save({"w": torch.zeros(2)}, acc / "pytorch_model.bin")
    assert "no trainer_state.json" in (why_incomplete(acc, now_s=LATER) or "")  # random_states_0.pkl comes last
    torch.save({"rng": 1}, acc / "random_states_0.pkl")
    assert why_incomplete(acc, now_s=LATER) is None
    plain = tmp_path / "run" / "checkpoint-4"
    plain.mkdir(parents=True)
    torch.save({"w": torch.zeros(2)}, plain / "model.pt")
    assert why_incomplete(plain, now_s=LATER) is None
    assert why_incomplete(plain, now_s=os.stat(plain / "model.pt").st_mtime + 0.5) is not None  # not settled yet


def test_a_half_written_accelerate_folder_is_moved_aside_before_the_job_starts(tmp_path: Path) -> None:
    from guard.secure import resume

    project = tmp_path / "checkpoints"
    done = project / "checkpoint_1"
    done.mkdir(parents=True)
    for name in ("optimizer.bin", "pytorch_model.bin", "random_states_0.pkl"):
        torch.save({"x": 1}, done / name)
    half = project / "checkpoint_2"
    half.mkdir()
    torch.save({"x": 1}, half / "optimizer.bin")  # killed before random_states_0.pkl
    plain = project / "step_9"
    plain.mkdir()
    (plain / "notes.txt").write_text("a loop's own folder")
    moved = resume.move_aside_partials(project, newer_than=1)
    # out of checkpoints/: accelerate's load_state() would take checkpoint_2.partial-guard there (its number 2)
    assert moved == [tmp_path / "checkpoint_2.partial-guard"] and not half.exists() and plain.is_dir()
    assert newest_complete(project, now_s=LATER).path == done  # type: ignore[union-attr]


def test_accelerates_save_counted_folders_are_compared_by_number_and_a_model_alone_is_partial(tmp_path: Path) -> None:
    # ProjectConfiguration(automatic_checkpoint_naming=True): checkpoint_N counts the saves; the secured step 300 is
    # checkpoint_2. A killed save_state left checkpoint_3 with model.safetensors alone (it writes that first).
    from safetensors.torch import save_file

    from guard.secure import resume

    saved = tmp_path / "project" / "checkpoints"
    done = saved / "checkpoint_2"
    done.mkdir(parents=True)
    save_file({"w": torch.zeros(2)}, str(done / "model.safetensors"))
    for name in ("optimizer.bin", "scheduler.bin", "random_states_0.pkl"):
        torch.save({"x": 1}, done / name)
    half = saved / "checkpoint_3"
    half.mkdir()
    save_file({"w": torch.zeros(2)}, str(half / "model.safetensors"))
    older = saved / "checkpoint_1"
    older.mkdir()
    save_file({"w": torch.zeros(2)}, str(older / "model.safetensors"))  # older than the chosen one: left alone
    moved = resume.move_aside_partials(saved, newer_than=300, chosen=done)
    assert moved == [tmp_path / "project" / "checkpoint_3.partial-guard"], moved
    assert sorted(os.listdir(saved)) == ["checkpoint_1", "checkpoint_2"]
