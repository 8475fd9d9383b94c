"""End to end: the checkpoints of jobs that are not Trainers and do not name checkpoint-N folders are secured;
a job stopped by the guard does not run its code after training."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from conftest import JOBS, GuardRun, loaded_s, run_guard, secured_step, signal_when, start_guard
from destinations import Destination

pytestmark = [pytest.mark.slow]

FAST = ["--skip-check", "python=imports are checked by the other tests"]
NANO = str(JOBS / "nanogpt_like.py")


@pytest.mark.parametrize("destination", ["folder", "s3"], indirect=True)
def test_a_loop_that_saves_ckpt_pt_is_secured_at_the_deadline_without_waiting_for_it(
        tmp_path: Path, destination: Destination) -> None:
    out = tmp_path / "out-run"
    started = time.monotonic()
    # a save about every second (100 iterations): the default, every 20, had the guard secure 74 saves in 22 s
    run = run_guard([*FAST, "--timeout", "25s", "--push-to", destination.push_to, NANO, f"--out_dir={out}",
                     "--eval_interval=100"], cwd=tmp_path, env=destination.env, timeout_s=90)
    took_s = time.monotonic() - started
    assert run.returncode == 75, run.stderr[-3000:]
    fields = run.fields()
    assert (fields["status"], fields["secured"]) == ("TIMEOUT", "yes")
    assert fields["checkpoint"] == str(out / "ckpt.pt")
    assert destination.checkpoint_files() == {"ckpt.pt"}
    assert destination.secured_step() == int(fields["secured_step"])  # the destination's record names that step
    assert f"output folder: {out} (the job's --out_dir argument)" in run.stderr
    assert "training finished" not in run.stdout
    assert took_s < 25 + 10


def test_a_loop_that_cannot_be_asked_has_its_saves_after_the_deadline_warning_secured_too(tmp_path: Path) -> None:
    # nanoGPT's shape: after "deadline in Ns" the job runs on until the guard stops it, saving ckpt.pt every
    # eval_interval; each of those saves is secured, not only the first one (the VERDICT resumes from the last).
    out, dest = tmp_path / "out", tmp_path / "dest"
    run = run_guard([*FAST, "--timeout", "25s", "--margin", "12s", "--push-to", str(dest), NANO, f"--out_dir={out}",
                     "--eval_interval=10", "--step_s=0.05"], cwd=tmp_path, timeout_s=90)
    assert run.returncode == 75, run.stderr[-3000:]
    after = run.stderr.split("deadline in", 1)[1]
    assert after.count("secured and verified") >= 2, run.stderr[-3000:]
    fields = run.fields()
    secured_steps = [int(line.rsplit("(step ", 1)[1].split(",")[0]) for line in after.splitlines()
                     if "secured and verified" in line]
    assert secured_steps == sorted(secured_steps) and secured_steps[-1] > secured_steps[0]
    assert f"resumes from step {secured_steps[-1]}" in fields["hint"]


def test_sigterm_reaches_a_loop_without_the_api_at_once_and_its_checkpoint_is_secured(tmp_path: Path) -> None:
    ready, dest = tmp_path / "ready", tmp_path / "dest"
    proc = start_guard([*FAST, "--grace", "20s", "--push-to", str(dest), NANO, f"--ready={ready}"], cwd=tmp_path)
    sent = time.monotonic()
    out, err = signal_when(proc, ready, signal.SIGTERM)
    took_s = time.monotonic() - sent
    verdict = [line for line in out.splitlines() if line.startswith("VERDICT:")][-1]
    assert proc.returncode == 75, err[-3000:]
    assert "INTERRUPTED" in verdict and "secured=yes" in verdict
    # the output folder came from the job's torch.save calls (nanoGPT's default out_dir, no argument)
    assert f"output folder: {tmp_path / 'out'} (where the job saves with torch.save)" in err
    assert (dest / "last-checkpoint" / "ckpt.pt").is_file()
    assert took_s < 20  # not the whole grace spent waiting for a save the job cannot make


def test_a_loop_using_the_api_ends_after_the_requested_save(tmp_path: Path) -> None:
    out, dest = tmp_path / "out", tmp_path / "dest"
    run = run_guard([*FAST, "--timeout", "30s", "--margin", "8s", "--push-to", str(dest), NANO, f"--out_dir={out}",
                     "--api=True",
                     "--eval_interval=100000"], cwd=tmp_path, timeout_s=90)
    assert run.returncode == 75, run.stderr[-3000:]
    assert "ending the process here" in run.stderr
    assert "training finished" not in run.stdout and not (out / "final.pt").exists()
    assert (dest / "last-checkpoint" / "ckpt.pt").is_file()


def test_nothing_recognisable_gets_a_hint_that_says_what_would_be(tmp_path: Path) -> None:
    out, dest = tmp_path / "out", tmp_path / "dest"
    run = run_guard([*FAST, "--timeout", loaded_s(15), "--push-to", str(dest), NANO, f"--out_dir={out}",
                     "--ckpt_name=state.ckpt"], cwd=tmp_path, timeout_s=90)
    assert run.returncode == 124, run.stderr[-3000:]
    hint = run.fields()["hint"]
    assert "checkpoint_saved" in hint and "checkpoint-N" in hint
    assert "--push-to" not in hint and "--output-dir" not in hint


def test_a_trainer_stopped_at_the_deadline_does_not_run_the_code_after_train(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # 12 s of the budget are the Trainer's start (imports, its first steps); the margin is its time to save when
    # asked: at load 6 on 2 cores its save took over 5 s
    run = run_guard([*FAST, "--timeout", loaded_s(24, start_s=12), "--margin", loaded_s(6), "--push-to",
                     str(tmp_path / "dest"),
                     str(JOBS / "slow_trainer.py"), "--output-dir", str(out), "--step-s", "0.05"], timeout_s=200)
    assert run.returncode == 75, run.stderr[-3000:]
    assert "trainer finished" not in run.stdout
    assert not (out / "model.safetensors").exists()  # no "final" model from a half-trained run
    # The Trainer says when each save is done: once the guard counts or secures a folder, it never calls it "still
    # being written". A scan may still catch a save in progress before the Trainer's report of it, and says so
    # (at load 3, checkpoint-150 was found 0.0 s after its trainer_state.json changed).
    lines = run.stderr.splitlines()
    for i, line in enumerate(lines):
        if ": still being written" in line:
            folder = line.split("[guard] ", 1)[-1].split(": still being written", 1)[0].split()[-1]
            known = [earlier for earlier in lines[:i]
                     if f"{folder} counts:" in earlier or f"securing {folder} " in earlier]
            assert not known, (line, known)
    assert (tmp_path / "dest" / "last-checkpoint" / "trainer_state.json").is_file()


def test_a_resumed_run_stopped_before_its_first_save_names_the_resumed_checkpoint_as_secured(tmp_path: Path) -> None:
    # the destination already holds the checkpoint the run resumed from: exit 75 pointing at it, not 124
    dest = tmp_path / "dest"
    # the first run secures a checkpoint and is stopped by SIGTERM once it has
    proc = start_guard([*FAST, "--push-to", str(dest), NANO, f"--out_dir={tmp_path / 'out1'}", "--eval_interval=10",
                        "--step_s=0.05"], cwd=tmp_path)
    stdout, stderr = signal_when(proc, lambda: secured_step(dest) is not None, signal.SIGTERM, wait_s=90)
    first = GuardRun(proc.returncode, stdout, stderr)
    assert first.returncode == 75, first.stderr[-3000:]
    step = first.fields()["hint"].split("resumes from step ", 1)[1].split(";")[0].split(":")[0]
    run = run_guard([*FAST, "--resume", "on", "--timeout", loaded_s(15), "--margin", "10s", "--push-to", str(dest),
                     NANO, f"--out_dir={tmp_path / 'out2'}", "--eval_interval=100000"], cwd=tmp_path, timeout_s=90)
    assert run.returncode == 75, run.stderr[-3000:]
    fields = run.fields()
    assert (fields["status"], fields["secured"]) == ("TIMEOUT", "yes")
    # the resumed checkpoint went back where it came from: the loop's own ckpt.pt in its output folder
    assert fields["checkpoint"].endswith("out2/ckpt.pt"), fields
    assert f"resumes from step {step}" in fields["hint"] and "resumed_from" in fields


def test_after_a_nan_the_loop_s_own_term_save_cannot_overwrite_what_is_secured(tmp_path: Path) -> None:
    # The job's SIGTERM handler rewrites ckpt.pt with the NaN weights: the guard secures the step-40 save first
    # (the job is paused meanwhile), and never publishes a rewritten file under the old step.
    import torch

    out, dest = tmp_path / "out", tmp_path / "dest"
    run = run_guard([*FAST, "--background-push", "off", "--check-every", "1", "--push-to", str(dest), NANO,
                     f"--out_dir={out}", "--nan_at=50", "--save_on_term=True", "--step_s=0.02"], cwd=tmp_path,
                    timeout_s=90)
    assert run.returncode == 4, run.stderr[-3000:]
    fields = run.fields()
    assert (fields["reason"], fields["secured"]) == ("non_finite_loss", "yes"), run.verdict
    secured = torch.load(dest / "last-checkpoint" / "ckpt.pt")
    assert secured["iter_num"] == 40
    assert not any(torch.isnan(v).any() for v in secured["model"].values())


def test_at_the_deadline_a_loop_that_saves_on_sigterm_gets_the_margin_for_its_save(tmp_path: Path) -> None:
    # No periodic saves: the only checkpoint is the one its SIGTERM handler writes, and that save takes 3 s. The
    # guard sends SIGTERM at deadline - margin (not in the last seconds with a 1 s grace), then secures it.
    import torch

    out, dest = tmp_path / "out", tmp_path / "dest"
    run = run_guard([*FAST, "--timeout", "30s", "--margin", "12s", "--push-to", str(dest), NANO, f"--out_dir={out}",
                     "--eval_interval=100000", "--save_on_term=True", "--term_save_s=3", "--step_s=0.02"],
                    cwd=tmp_path, timeout_s=90)
    assert run.returncode == 75, run.stderr[-3000:]
    assert (run.fields()["status"], run.fields()["secured"]) == ("TIMEOUT", "yes")
    assert "saves on SIGTERM itself: SIGTERM now" in run.stderr
    assert torch.load(dest / "last-checkpoint" / "ckpt.pt")["iter_num"] > 0
