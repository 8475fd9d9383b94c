"""What counts as a checkpoint beyond checkpoint-N folders, where the output folder is, which reported paths are
refused, and what the hint says when nothing is recognisable."""

from __future__ import annotations

import json
import logging
import os
import pickle
import stat
from pathlib import Path

import pytest

from guard.errors import SupervisorError
from guard.secure.checkpoints import (
    TRAINER_STATE_NAME,
    SavedFiles,
    describe,
    list_files,
    loose_files,
    newest_complete,
)
from guard.secure.layout import (
    check_reported_path,
    is_plausible_output_dir,
    nothing_found_hint,
    output_dir_from_args,
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


# -- the output folder from the job's arguments ------------------------------------------------------------------


@pytest.mark.parametrize(("args", "expected"), [
    (["--output_dir", "runs/a", "--lr", "1"], ("runs/a", "--output_dir")),
    (["--output-dir=out/b"], ("out/b", "--output-dir")),
    (["--device=cpu", "--out_dir=out-shakespeare"], ("out-shakespeare", "--out_dir")),
    (["--save", "/ckpt/megatron"], ("/ckpt/megatron", "--save")),
    (["--out_dir", "first", "--out_dir", "second"], ("second", "--out_dir")),  # argparse keeps the last one
    (["--save", "--other"], None),  # a flag without a value
    (["--output_dir"], None),
    (["--", "--output_dir", "x"], None),  # past a bare --: not the job's options
    (["--output_dirs", "x", "--saved", "y"], None),  # other flags with the same start
    (["--save=a", "--output-dir", "b"], ("b", "--output-dir")),  # --output_dir/--output-dir before --save
])
def test_output_dir_from_args(args, expected):
    assert output_dir_from_args(args) == expected


# -- reported paths ------------------------------------------------------------------------------------------------


def test_reported_paths_that_would_push_the_wrong_thing_are_refused(tmp_path, monkeypatch):
    work = tmp_path / "work"
    (work / "out" / "checkpoint-5").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    for bad in ("", "   ", None, "/", ".", str(work), str(tmp_path), str(tmp_path / "home")):
        with pytest.raises(SupervisorError) as err:
            check_reported_path(bad, output_dir=None, cwd=work)
        assert "checkpoint_saved" in err.value.hint
    with pytest.raises(SupervisorError, match="outside its output folder"):
        check_reported_path(str(tmp_path / "elsewhere"), output_dir="out", cwd=work)
    assert check_reported_path("out/checkpoint-5", output_dir="out", cwd=work) == work / "out" / "checkpoint-5"
    assert check_reported_path("out", output_dir=str(work / "out"), cwd=work) == work / "out"
    assert not is_plausible_output_dir(work, cwd=work)
    assert not is_plausible_output_dir(work / ".cache" / "x", cwd=work)
    assert is_plausible_output_dir(work / "out", cwd=work)


def test_the_hint_never_names_a_flag_already_given(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "state.bin").write_bytes(b"x")  # something was saved, in a form not recognised
    hint = nothing_found_hint(output_dir=str(ckpt), destination_given=True)
    assert "--push-to" not in hint and "--output-dir" not in hint
    assert "guard.checkpoint_saved(path)" in hint and "checkpoint-N" in hint and "ckpt" in hint
    assert "--output-dir" in nothing_found_hint(output_dir=None, destination_given=True)
    assert "--push-to" in nothing_found_hint(output_dir="ckpt", destination_given=False)


def test_an_output_folder_with_nothing_in_it_says_the_job_never_reached_a_save(tmp_path):
    for folder in (tmp_path / "missing", tmp_path):
        hint = nothing_found_hint(output_dir=str(folder), destination_given=True, step=40)
        assert "never reached a save" in hint and "checkpoint_saved" not in hint


def test_a_job_stopped_before_its_second_step_is_told_its_start_up_took_the_time(tmp_path):
    """TRL's sft with a 60 s budget at load 15-18: stopped at step 1 with nothing saved, and the hint said to save
    more often; the time went to its start-up."""
    for step, said in ((None, "no training step"), (0, "0 training steps"), (1, "1 training step,")):
        hint = nothing_found_hint(output_dir=str(tmp_path), destination_given=True, step=step)
        assert said in hint and "start-up" in hint and "--timeout" in hint and "more often" not in hint


# -- loose model files, accelerate folders, reported folders -------------------------------------------------------


def test_nanogpt_ckpt_pt_is_a_checkpoint_once_stable(tmp_path):
    write(tmp_path / "ckpt.pt", 500, mtime_s=NOW - 0.5)
    assert newest_complete(tmp_path, now_s=NOW) is None  # still being written
    info = newest_complete(tmp_path, now_s=NOW + 5)
    assert info is not None
    assert info.path == tmp_path / "ckpt.pt" and info.folder == tmp_path and info.files == ("ckpt.pt",)
    assert info.step is None and info.size_bytes == 500


def test_loose_files_group_by_the_step_in_their_names(tmp_path):
    write(tmp_path / "model_step_100.pt", 10, mtime_s=NOW - 90)
    write(tmp_path / "optim_step_100.pt", 20, mtime_s=NOW - 90)
    write(tmp_path / "model_step_200.pt", 30, mtime_s=NOW - 30)
    write(tmp_path / "optim_step_200.pt", 40, mtime_s=NOW - 30)
    write(tmp_path / "training_args.bin", 5, mtime_s=NOW - 10)  # the Trainer's arguments: not model state
    write(tmp_path / "notes.txt", 5, mtime_s=NOW - 10)
    info = loose_files(tmp_path, now_s=NOW)
    assert info.files == ("model_step_200.pt", "optim_step_200.pt")
    assert info.step == 200 and info.step_source == "name" and info.path == tmp_path


def test_folders_win_over_loose_files_and_a_trainer_ignores_them(tmp_path):
    write(tmp_path / "last.pt", 10)
    assert newest_complete(tmp_path, now_s=NOW).files == ("last.pt",)
    assert newest_complete(tmp_path, now_s=NOW, loose=False) is None
    folder = tmp_path / "checkpoint-4"
    write(folder / "model.safetensors", 10)
    (folder / TRAINER_STATE_NAME).write_text(json.dumps({"global_step": 4}))
    os.utime(folder / TRAINER_STATE_NAME, (NOW - 60, NOW - 60))
    info = newest_complete(tmp_path, now_s=NOW)
    assert info.path == folder and info.step == 4 and info.step_source == "trainer_state"


def test_accelerate_save_state_folders(tmp_path):
    for step in (50, 100):
        folder = tmp_path / f"step_{step}"
        write(folder / "model.safetensors", 10)
        write(folder / "optimizer.bin", 10)
    write(tmp_path / "step_50" / "random_states_0.pkl", 3)  # written last by save_state
    info = newest_complete(tmp_path, now_s=NOW, loose=False)
    assert info.path == tmp_path / "step_50" and info.step == 50 and info.step_source == "name"
    write(tmp_path / "step_100" / "random_states_0.pkl", 3)
    assert newest_complete(tmp_path, now_s=NOW).step == 100
    auto = tmp_path / "checkpoint_120"  # automatic_checkpoint_naming
    write(auto / "model.safetensors", 10)
    write(auto / "random_states_0.pkl", 3)
    assert newest_complete(tmp_path, now_s=NOW).path == auto


def test_accelerate_epoch_folders_are_checkpoints_taken_whole(tmp_path):
    # accelerate's examples with --checkpointing_steps epoch: save_state(f"{out}/epoch_{epoch}"). Before, epoch_0
    # was no checkpoint folder: the files the agent saw saved (optimizer.bin, scheduler.bin) were secured without the
    # model.safetensors accelerate writes with safetensors, epoch_0 was the output folder and the final model push
    # copied every epoch_N folder. N counts epochs: the step is the agent's (scans), the name's N only orders them.
    from guard.secure.layout import output_dir_for_save, output_dir_of_save

    out = tmp_path / "out"
    for name in ("model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl"):
        write(out / "epoch_0" / name, 10)
    assert output_dir_for_save(out / "epoch_0" / "optimizer.bin") == out
    assert output_dir_of_save(tmp_path / "epoch_0" / "optimizer.bin", cwd=tmp_path) == tmp_path  # --output_dir .
    info = SavedFiles().add(out / "epoch_0" / "optimizer.bin", 500)
    assert info is not None and info.path == out / "epoch_0" and info.step == 500
    assert set(info.files) == {"model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl"}
    write(out / "epoch_1" / "model.safetensors", 10)  # epoch_1 still being written: no random_states_0.pkl yet
    found = newest_complete(out, now_s=NOW, loose=False, steps={str(out / "epoch_0"): 500})
    assert found is not None and found.path == out / "epoch_0" and found.step == 500


def test_a_folder_the_job_said_it_finished_needs_no_mtime_rule(tmp_path, caplog):
    folder = tmp_path / "checkpoint-7"
    write(folder / "model.safetensors", 10, mtime_s=NOW)
    (folder / TRAINER_STATE_NAME).write_text("{}")
    os.utime(folder / TRAINER_STATE_NAME, (NOW, NOW))
    with caplog.at_level(logging.INFO, logger="guard.checkpoints"):
        assert newest_complete(tmp_path, now_s=NOW, reported=[str(folder)]).path == folder
    assert "still being written" not in caplog.text
    assert newest_complete(tmp_path, now_s=NOW, loose=False) is None  # unreported: the mtime rule applies


def test_a_reported_folder_reached_through_a_symlink_is_never_still_being_written(tmp_path, caplog):
    # The job reports /link/out/checkpoint-20 (its abspath), the supervisor resolves it; the guard scans the output
    # folder by the name it was given (through the link): the scan must still honour the report.
    real = tmp_path / "real"
    folder = real / "out" / "checkpoint-20"
    write(folder / "model.safetensors", 10, mtime_s=NOW - 0.3)
    write(folder / TRAINER_STATE_NAME, 2, mtime_s=NOW - 0.2)
    os.symlink(real, tmp_path / "link")
    through_link = tmp_path / "link" / "out"
    with caplog.at_level(logging.INFO, logger="guard.checkpoints"):
        found = newest_complete(through_link, now_s=NOW, reported=[str(folder.resolve())])
        assert found is not None and found.step == 20
        found = newest_complete(real / "out", now_s=NOW, reported=[str(through_link / "checkpoint-20")])
        assert found is not None and found.step == 20
    assert "still being written" not in caplog.text


def test_the_supervisor_scan_honours_what_the_job_said(tmp_path, caplog):
    """The Trainer's save event, then a scan 0.8 s later (a signal's tick): no "still being written" line."""
    import time
    from types import SimpleNamespace

    from guard.secure.budget import Deadline, MarginEstimator
    from guard.secure.securing import Securing

    real = tmp_path / "real"
    folder = real / "out" / "checkpoint-20"
    now = time.time()
    write(folder / "model.safetensors", 10, mtime_s=now - 0.3)
    write(folder / TRAINER_STATE_NAME, 2, mtime_s=now - 0.2)
    os.symlink(real, tmp_path / "link")
    output_dir = str(tmp_path / "link" / "out")
    sup = SimpleNamespace(node_rank=None, training_ranks=lambda: {0}, world_size=lambda: 1, outcome=None, job=None,
                          job_exit_code=lambda: None, job_alive=lambda: True)
    from fakes import InlineFs

    securing = Securing(deadline=Deadline(now, None, None, "none"), estimator=MarginEstimator(log_changes=False),
                        output_dir=output_dir, fs=InlineFs())
    securing.trainer_seen = True
    with caplog.at_level(logging.INFO):
        securing.on_checkpoint_saved(sup, {"t": "checkpoint_saved", "path": f"{output_dir}/checkpoint-20",
                                           "step": 20, "zero": True, "rank": 0})
        securing._scan(sup)
    assert "checkpoint saved by the job" in caplog.text
    assert "still being written" not in caplog.text and "skipped" not in caplog.text
    assert securing.plan.report().newest is not None and securing.plan.report().newest.step == 20


def test_symlinks_are_never_followed_out_of_a_checkpoint(tmp_path, caplog):
    secret = write(tmp_path / "outside" / "id_rsa", 7)
    folder = tmp_path / "out" / "checkpoint-3"
    write(folder / "model.pt", 10)
    (folder / GUARD_MARKER).write_text("{}")
    os.symlink(secret, folder / "leak.pt")
    os.symlink(tmp_path / "outside", folder / "dirlink")
    os.symlink("model.pt", folder / "alias.pt")  # inside: counts as that file's content
    with caplog.at_level(logging.WARNING, logger="guard.checkpoints"):
        files = list_files(folder)
    assert files == ["alias.pt", GUARD_MARKER, "model.pt"]
    assert "leak.pt" in caplog.text and "dirlink" in caplog.text
    assert "leak.pt" not in describe(folder).files


GUARD_MARKER = "guard_checkpoint.json"


def test_saved_files_group_one_save_and_carry_the_agents_step(tmp_path):
    saved = SavedFiles()
    write(tmp_path / "ckpt" / "model.pt", 10)
    info = saved.add(tmp_path / "ckpt" / "model.pt", 40)
    assert info.files == ("model.pt",) and info.step == 40 and info.step_source == "reported"
    write(tmp_path / "ckpt" / "optim.pt", 20)
    info = saved.add(tmp_path / "ckpt" / "optim.pt", 40)
    assert info.files == ("model.pt", "optim.pt") and info.folder == tmp_path / "ckpt" and info.size_bytes == 30
    info = saved.add(tmp_path / "ckpt" / "model.pt", 80)  # the next save starts a new set
    assert info.files == ("model.pt",) and info.step == 80
    write(tmp_path / "ckpt" / "data.json", 5)
    assert saved.add(tmp_path / "ckpt" / "data.json", 80) is None  # not a model file


# -- the folder destination --------------------------------------------------------------------------------------


def test_a_folder_destination_pushes_exactly_the_files_with_default_permissions(tmp_path):
    from guard.secure.securer import Securer

    out = tmp_path / "out"
    write(out / "ckpt.pt", 100)
    write(out / "log.txt", 5)
    old = os.umask(0o022)
    try:
        result = Securer(str(tmp_path / "dest")).push_checkpoint(out, step=9, deadline=float("inf"),
                                                                files=["ckpt.pt"])
    finally:
        os.umask(old)
    target = tmp_path / "dest" / "last-checkpoint"
    assert result.files == ("ckpt.pt",)
    assert sorted(p.name for p in target.iterdir()) == ["ckpt.pt", "guard_manifest.json"]
    assert stat.S_IMODE(target.stat().st_mode) == 0o755


def test_the_slurm_recipe_does_not_start_the_grace_flow_early():
    recipe = (Path(__file__).resolve().parent.parent / "docs" / "slurm.md").read_text()
    directives = [line for line in recipe.splitlines() if line.startswith("#SBATCH")]
    assert directives and not any("--signal" in line for line in directives)


def test_a_save_into_a_hidden_or_temporary_folder_is_not_a_checkpoint_yet(tmp_path):
    saved = SavedFiles()
    for folder in (".partial-checkpoint-1", "tmp", "ckpt.tmp"):
        write(tmp_path / folder / "model.pt", 10)
        assert saved.add(tmp_path / folder / "model.pt", 1) is None


def test_the_output_folder_of_a_save_is_the_parent_of_its_checkpoint_folder(tmp_path):
    from guard.secure.layout import output_dir_for_save

    out = tmp_path / "out"
    assert output_dir_for_save(out / "checkpoint-20" / "model.pt") == out
    assert output_dir_for_save(out / "tmp-checkpoint-20" / "model.pt") == out
    assert output_dir_for_save(out / "checkpoints" / "checkpoint_3" / "optimizer.bin") == out / "checkpoints"
    assert output_dir_for_save(out / "step_7" / "optimizer.bin") == out
    assert output_dir_for_save(out / "global_step5" / "mp_rank_00_model_states.pt") == out
    assert output_dir_for_save(out / "ckpt.pt") == out
    assert output_dir_for_save(out / "run1" / "model.pt") == out / "run1"


def test_the_working_folder_is_learnt_from_a_save_only_into_a_checkpoint_folder_in_it(tmp_path):
    # accelerate's complete_nlp_example: --output_dir defaults to ".", accelerator.save_state("step_10")
    from guard.secure.layout import output_dir_of_save

    work = tmp_path / "work"
    assert output_dir_of_save(work / "step_10" / "optimizer.bin", cwd=work) == work
    assert output_dir_of_save(work / "checkpoint-20" / "model.pt", cwd=work) == work
    assert output_dir_of_save(work / "out" / "ckpt.pt", cwd=work) == work / "out"
    assert output_dir_of_save(work / "model.pt", cwd=work) is None  # a loose file: never the whole working folder
    assert output_dir_of_save(work / "sub" / "model.pt", cwd=work / "sub") is None
    assert output_dir_of_save(tmp_path / "step_3" / "x.bin", cwd=work) is None  # above the working folder
    assert output_dir_of_save(work / ".cache" / "step_3" / "x.bin", cwd=work) is None


def test_a_flag_naming_a_file_gives_its_folder():
    from guard.secure.layout import output_dir_from_args

    assert output_dir_from_args(["--save", "model.pt"]) == (".", "--save")
    assert output_dir_from_args(["--save=runs/wlm/model.pt"]) == ("runs/wlm", "--save")
    assert output_dir_from_args(["--save", "ckpts"]) == ("ckpts", "--save")


def test_the_resume_checkpoint_just_fetched_is_never_still_being_written(tmp_path, caplog):
    """The fetch placed checkpoint-20 a moment before the job started: the first scan takes it as it is."""
    import time

    folder = tmp_path / "out" / "checkpoint-20"
    now = time.time()
    write(folder / "model.safetensors", 10, mtime_s=now - 0.3)
    write(folder / TRAINER_STATE_NAME, 2, mtime_s=now - 0.2)
    started = time.time() + 0.01  # the job starts after the fetch
    with caplog.at_level(logging.INFO):
        info = newest_complete(tmp_path / "out", now_s=started + 0.5, since_s=started, resumed=[str(folder)])
    assert info is not None and info.step == 20 and info.admitted_by == "resumed"
    assert "still being written" not in caplog.text and "skipped" not in caplog.text
    # rewritten by the job since it started: the settle rule again
    time.sleep(0.02)
    write(folder / "model.safetensors", 10, mtime_s=time.time())
    assert newest_complete(tmp_path / "out", now_s=time.time(), since_s=started, resumed=[str(folder)]) is None


def test_the_final_model_files_leave_out_every_checkpoint_folder(tmp_path):
    # accelerate's complete_nlp_example --output_dir out: out/step_10/ ... are checkpoints, not the final model
    from guard.secure.dest.local import final_model_files

    out = tmp_path / "out"
    for rel in ("step_10/optimizer.bin", "checkpoints/checkpoint_0/model.safetensors", "checkpoint_2/x.bin",
                "global_step5/a.pt", "checkpoint-3/model.safetensors", "model.safetensors", "config.json"):
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(b"0")
    assert final_model_files(out) == ["config.json", "model.safetensors"]


def test_a_save_under_the_machines_own_temporary_folder_is_the_jobs_save(tmp_path):
    """A loop saving /tmp/out/ckpt.pt (the Slurm recipe's ${TMPDIR:-/tmp}/$SLURM_JOB_ID/out where TMPDIR is /tmp):
    before, /tmp counted as a scratch folder of the job's and the save was never taken as the job's (the scan found
    it later as 'step None', secured as step 0); a job's own temporary folder still is one."""
    import shutil
    import uuid

    out = Path("/tmp") / f"guard-test-out-{uuid.uuid4().hex[:8]}"
    try:
        write(out / "ckpt.pt", 10)
        info = SavedFiles().add(out / "ckpt.pt", 100)
        assert info is not None and info.step == 100 and info.files == ("ckpt.pt",)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    write(tmp_path / "out" / "tmp-save" / "ckpt.pt", 10)
    assert SavedFiles().add(tmp_path / "out" / "tmp-save" / "ckpt.pt", 100) is None
