"""End to end: the VERDICT tells the truth (issue "Truthful verdicts", run-time half), on tiny real jobs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import JOBS, guard_env, loaded_s, run_guard

pytestmark = pytest.mark.slow


def _fields(verdict: str) -> dict[str, str]:
    import shlex

    parts = shlex.split(verdict[len("VERDICT: "):])
    return {"status": parts[0], **dict(p.split("=", 1) for p in parts[1:])}


def _merged(args: list[str], log: Path, env: dict[str, str] | None = None) -> int:
    """Run the guard with stdout and stderr into one log file (``2>&1``); returns its exit code."""
    with log.open("wb") as handle:
        proc = subprocess.run([sys.executable, "-m", "guard", *args], stdout=handle, stderr=subprocess.STDOUT,
                              env=guard_env(env), timeout=120)
    return proc.returncode


# -- 1. the VERDICT starts a line ---------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_verdict_starts_a_line_after_an_unterminated_progress_bar_in_a_merged_log(tmp_path: Path,
                                                                                  stream: str) -> None:
    log = tmp_path / "job.log"
    code = _merged([str(JOBS / "unterminated.py"), "--stream", stream], log)
    text = log.read_text()
    assert code == 0, text
    assert "loss=0.5\n" in text  # the bar's line was broken before the guard wrote
    assert "\nVERDICT: PASS reason=ok exit=0" in text
    assert all(line.startswith("[guard]") for line in text.splitlines() if "[guard]" in line), text
    watch = subprocess.run([sys.executable, "-m", "guard", "watch", str(log)], capture_output=True,
                           env=guard_env(), timeout=60)
    assert watch.returncode == 0, watch.stdout.decode()[-800:]


def test_verdict_starts_a_line_on_stdout_alone(tmp_path: Path) -> None:
    run = run_guard([str(JOBS / "unterminated.py"), "--code", "3"])
    last = run.stdout.split("\n")[-2]
    assert last.startswith("VERDICT: FAIL reason=crash exit=1"), repr(run.stdout[-300:])  # 3 is preflight's code
    assert "job_exit=3" in last
    assert run.stdout.split("\n")[-3].endswith("loss=0.5")


def test_the_last_unterminated_line_of_a_command_is_read_for_losses_and_errors(tmp_path: Path) -> None:
    run = run_guard(["--", "sh", "-c", r"printf 'step 1 loss=2.0\nstep 2 loss=2.1\nstep 3 loss=nan'"])
    assert run.fields()["reason"] == "non_finite_loss", run.stdout + run.stderr
    assert run.fields()["step"] == "3"
    script = "printf 'Traceback (most recent call last):\\n  File \"x.py\", line 1\\nValueError: bad shape'; exit 1"
    run = run_guard(["--", "sh", "-c", script])
    assert run.fields()["reason"] == "crash"
    assert "ValueError: bad shape" in run.fields()["hint"]


# -- 3. no false alarm from numbers the job prints ------------------------------------------------------------------


def test_set_up_prints_of_inf_and_nan_do_not_decide_while_the_agent_is_there() -> None:
    run = run_guard([str(JOBS / "setup_prints.py"), "--steps", "12"])
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    fields = run.fields()
    assert (fields["status"], fields["reason"], fields["step"]) == ("PASS", "ok", "12")
    assert "reading losses from the job's output" not in run.stderr


def test_a_command_without_agent_is_judged_on_its_step_lines_only() -> None:
    ok = "echo 'best loss: inf'; echo 'val loss nan'; for i in 1 2 3; do echo \"step $i loss=2.$i\"; done"
    run = run_guard(["--sanity-steps", "3", "--", "sh", "-c", ok])
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.fields()["step"] == "3" and run.fields()["loss"] == "2.3"
    bad = ok + "; echo 'step 4 loss=nan'; sleep 20"
    run = run_guard(["--sanity-steps", "3", "--", "sh", "-c", bad])
    assert (run.fields()["reason"], run.fields()["step"], run.fields()["loss"]) == ("non_finite_loss", "4", "nan")


# -- 9. secrets on the job's command line ---------------------------------------------------------------------------


def test_command_line_secrets_are_masked_in_the_guards_lines_the_output_and_the_report(tmp_path: Path) -> None:
    key, token = "wandb-0123456789abcdef", "tok-secret-98765"
    report = tmp_path / "report.json"
    run = run_guard(["--report", str(report), str(JOBS / "echo_args.py"), "--wandb-key", key,
                     f"--hf_token={token}", "--lr", "3e-4"])
    assert run.returncode == 0, run.stderr
    everything = run.stdout + run.stderr + report.read_text()
    assert key not in everything and token not in everything
    assert "--wandb-key *** --hf_token=*** --lr 3e-4" in run.stdout
    assert "command:" in run.stderr and "--wandb-key ***" in run.stderr


# -- 8. the log stays readable ---------------------------------------------------------------------------------------


def test_an_exception_the_job_caught_is_not_logged_as_its_error_on_a_pass() -> None:
    run = run_guard([str(JOBS / "caught_error.py")])
    assert run.returncode == 0, run.stderr
    assert "FileNotFoundError" in run.stderr  # the job's own traceback passes through
    assert "[guard] the job's last exception" not in run.stderr


def test_trainer_saves_are_counted_in_the_heartbeat(tmp_path: Path) -> None:
    run = run_guard(["--heartbeat", "1s", str(JOBS / "slow_trainer.py"), "--output-dir", str(tmp_path / "out"),
                     "--max-steps", "24", "--step-s", "0.1", "--save-steps", "4"])
    assert run.returncode == 0, run.stderr[-3000:]
    saved = [line for line in run.stderr.splitlines() if "checkpoint saved by the job" in line]
    assert len(saved) == 1, saved
    beats = [line for line in run.stderr.splitlines() if "heartbeat" in line and "saves=" in line]
    assert beats, run.stderr[-3000:]
    assert "checkpoint-" in beats[-1]


# -- 4. an exit 0 that is not a finished run ---------------------------------------------------------------------


def test_a_swallowed_trainer_error_is_incomplete_with_the_cause_and_the_checkpoint_before_it_secured(
        tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    run = run_guard(["--push-to", str(dest), str(JOBS / "swallowed.py"), "--output-dir", str(tmp_path / "out"),
                     "--fail-at", "29", "--save-steps", "10"])
    assert run.returncode == 7, run.stdout[-1500:] + run.stderr[-3000:]
    fields = run.fields()
    assert (fields["status"], fields["reason"], fields["secured"]) == ("FAIL", "incomplete", "yes"), run.verdict
    assert "No space left on device" in fields["hint"]  # the root of the chain, not the wrapper's message
    assert "step 29 of 200" in fields["hint"]
    assert fields["checkpoint"].endswith("checkpoint-20"), run.verdict
    assert (dest / "last-checkpoint" / "trainer_state.json").is_file()
    assert not (dest / "model.safetensors").exists()  # not pushed as a final model


def test_a_callback_that_stops_training_early_is_a_pass(tmp_path: Path) -> None:
    run = run_guard([str(JOBS / "swallowed.py"), "--output-dir", str(tmp_path / "out"), "--stop-at", "12"])
    assert run.returncode == 0, run.stdout[-1500:] + run.stderr[-3000:]
    assert (run.fields()["reason"], run.fields()["step"]) == ("ok", "12")


# -- 5. step=, rank= and loss= of a non-finite loss --------------------------------------------------------------


def test_non_finite_step_is_the_first_bad_step_not_where_it_was_read() -> None:
    run = run_guard(["--check-every", "10", str(JOBS / "plain_loop.py"), "--steps", "200", "--nan-at", "25",
                     "--step-s", "0.01"])
    assert run.returncode == 4, run.stderr[-3000:]
    fields = run.fields()
    assert (fields["reason"], fields["step"], fields["loss"]) == ("non_finite_loss", "25", "nan")


@pytest.mark.parametrize("check_every", ["10", "1"])
def test_a_nan_on_rank_1_after_the_sanity_pass_names_rank_1_and_its_step(check_every: str) -> None:
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    run = run_guard(["--no-preflight", "--grace", "8s", "--check-every", check_every, "--", torchrun, "--standalone",
                     "--nproc-per-node", "2", str(JOBS / "ddp_loop.py"), "--nan-rank", "1", "--nan-at", "25",
                     "--step-s", "0.02"], timeout_s=120)
    assert run.returncode == 4, run.stderr[-3000:]
    fields = run.fields()
    assert (fields["reason"], fields["rank"], fields["step"], fields["loss"]) == ("non_finite_loss", "1", "25", "nan")


# -- 2. the loss the user means ----------------------------------------------------------------------------------


def _last_printed_loss(stdout: str) -> str:
    return [line for line in stdout.splitlines() if line.startswith("step ")][-1].split("loss=")[1]


def test_the_unscaled_loss_is_reported_under_a_grad_scaler() -> None:
    run = run_guard([str(JOBS / "amp_loop.py"), "--steps", "30"])
    assert run.returncode == 0, run.stderr[-3000:]
    fields = run.fields()
    assert fields["step"] == "30"
    assert fields["loss"] == _last_printed_loss(run.stdout)  # not 65536x it
    first = [float(v) for v in run.stderr.split("losses are finite: ")[1].split("\n")[0].split()]
    assert first[0] < 100, first  # the sanity pass saw the real loss too


def test_the_loss_given_to_accelerate_backward_is_reported() -> None:
    run = run_guard([str(JOBS / "amp_loop.py"), "--steps", "12", "--accelerate"])
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.fields()["loss"] == _last_printed_loss(run.stdout)  # not divided by the 4 accumulation steps


def test_the_loss_given_to_a_deepspeed_engine_backward_is_reported() -> None:
    # DeepSpeedEngine.backward divides by the 4 accumulation steps and multiplies by the fp16 loss scale (2**16)
    # 12 micro-steps are 3 optimizer steps: a sanity pass of 2 of them (it counts optimizer steps)
    run = run_guard(["--sanity-steps", "2", str(JOBS / "deepspeed_loop.py"), "--steps", "12"])
    assert run.returncode == 0, run.stderr[-3000:]
    fields = run.fields()
    assert fields["step"] == "3"  # optimizer steps, as DeepSpeed's global_steps: 12 micro-steps of 4 each
    assert fields["loss"] == _last_printed_loss(run.stdout)  # not 16384x it
    first = [float(v) for v in run.stderr.split("losses are finite: ")[1].split("\n")[0].split()]
    assert first[0] < 100, first  # the sanity pass saw the real loss too


def test_a_loss_scale_that_keeps_collapsing_is_non_finite_loss_with_an_fp16_hint() -> None:
    run = run_guard(["--max-skipped-steps", "20", str(JOBS / "amp_loop.py"), "--steps", "400", "--collapse",
                     "--step-s", "0.01"])
    assert run.returncode == 4, run.stdout[-1000:] + run.stderr[-3000:]
    fields = run.fields()
    assert (fields["status"], fields["reason"]) == ("FAIL", "non_finite_loss")
    assert "fp16 overflow" in fields["hint"] and "skipped" in fields["hint"]
    assert "loss" not in fields  # the loss itself stayed finite
    assert 20 <= int(fields["step"]) <= 40
    assert "step 400 " not in run.stdout


# -- 6. a loss that explodes while staying finite ----------------------------------------------------------------


def test_a_finite_loss_explosion_is_named_once_and_in_the_hint_of_the_crash_that_follows() -> None:
    run = run_guard([str(JOBS / "diverge.py")])
    assert run.returncode == 1, run.stderr[-3000:]
    named = [line for line in run.stderr.splitlines() if "the loss exploded" in line]
    assert len(named) == 1 and named[0].startswith("[guard] "), named
    fields = run.fields()
    assert fields["reason"] == "crash"
    assert "the loss exploded" in fields["hint"] and "OverflowError" in fields["hint"]


# -- 7. hints name the root cause --------------------------------------------------------------------------------


def _in_private_mount(tmpfs: str, size: str, guard_args: list[str]) -> subprocess.CompletedProcess:
    """Run the guard in a mount namespace of its own (``unshare -m``) with a tiny tmpfs on ``tmpfs``."""
    import shlex
    import shutil as sh

    if os.geteuid() != 0 or sh.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a private mount namespace")
    cmd = (f"mount -t tmpfs -o size={size} tmpfs {shlex.quote(tmpfs)} && exec "
           + " ".join(shlex.quote(a) for a in [sys.executable, "-m", "guard", *guard_args]))
    proc = subprocess.run(["unshare", "-m", "sh", "-c", cmd], capture_output=True, text=True, env=guard_env(),
                          timeout=120)
    if "mount:" in proc.stderr and "VERDICT" not in proc.stdout:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()[:200]}")
    return proc


def test_a_dataloader_worker_out_of_shared_memory_is_named_behind_the_wrapper() -> None:
    proc = _in_private_mount("/dev/shm", "256k", ["--no-preflight", str(JOBS / "shm_loader.py")])
    verdict = proc.stdout.strip().splitlines()[-1]
    fields = _fields(verdict)
    assert fields["reason"] == "crash", proc.stderr[-3000:]
    assert "unable to allocate shared memory" in fields["hint"]
    assert "Caught RuntimeError in DataLoader" not in fields["hint"]
    assert "--shm-size" in fields["hint"]


def test_torch_save_into_a_full_disk_says_disk_full_with_the_free_space(tmp_path: Path) -> None:
    full = tmp_path / "full"
    full.mkdir()
    proc = _in_private_mount(str(full), "64k", ["--no-preflight", "--output-dir", str(full),
                                                 str(JOBS / "disk_full.py"), str(full)])
    fields = _fields(proc.stdout.strip().splitlines()[-1])
    assert fields["reason"] == "crash", proc.stderr[-3000:]
    assert "the disk is full" in fields["hint"] and "unexpected pos" in fields["hint"]
    assert f"free of 65.5 kB in {full}" in fields["hint"]  # the 64 KiB tmpfs


def test_a_hang_after_training_ended_names_where_it_hangs(tmp_path: Path) -> None:
    # the stall timeout covers the job's silent start (importing transformers) too: stretched on a loaded machine
    run = run_guard(["--stall-timeout", loaded_s(15), "--grace", "5s", str(JOBS / "hang_after_training.py"),
                     "--output-dir", str(tmp_path / "out")], timeout_s=120)
    assert run.returncode == 5, run.stderr[-3000:]
    hint = run.fields()["hint"]
    assert "training ended at step 6" in hint
    assert "upload_results (hang_after_training.py:" in hint
    assert "no training step for" not in hint
