"""End to end: the verdict and the cause for failures users report (issue 21), on tiny real jobs."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from conftest import JOBS, GuardRun, kill_quietly, loaded_s, run_guard, start_guard

from guard.core.masking import Masker
from guard.core.state import JobFacts
from guard.run.diagnose import rank_failure
from guard.run.output import OutputEvents, StreamFilter
from guard.run.upkeep import SAMPLE_EVERY_S

pytestmark = pytest.mark.slow


# -- zero training steps ---------------------------------------------------------------------------------------------


def test_an_empty_dataloader_that_saves_and_exits_0_is_incomplete(tmp_path: Path) -> None:
    run = run_guard([str(JOBS / "empty_loader.py"), "--out", str(tmp_path / "out")], cwd=tmp_path)
    fields = run.fields()
    assert (fields["status"], fields["reason"], run.returncode) == ("FAIL", "incomplete", 7), run.stdout + run.stderr
    assert "no training step" in fields["hint"] and "AdamW" in fields["hint"]
    assert "3 sample(s) with batch_size=8 and drop_last=True" in fields["hint"]
    assert (tmp_path / "out" / "model.pt").exists()  # the job did save; the verdict is the guard's


def test_an_evaluation_script_that_never_trains_passes_and_says_it_ran_no_step(tmp_path: Path) -> None:
    run = run_guard([str(JOBS / "empty_loader.py"), "--eval", "--samples", "16"], cwd=tmp_path)
    fields = run.fields()
    assert (fields["status"], fields["reason"], run.returncode) == ("PASS", "ok", 0), run.stdout + run.stderr
    assert fields["steps"] == "0"
    assert "step" not in fields


# -- a DataLoader worker killed for memory -----------------------------------------------------------------------


def test_a_dataloader_worker_sigkilled_while_holding_the_most_memory_is_oom_with_its_size(tmp_path: Path) -> None:
    ready = tmp_path / "worker.pid"
    proc = start_guard([str(JOBS / "worker_memory.py"), "--mb", "400", "--ready", str(ready)], cwd=tmp_path)
    try:
        deadline = time.monotonic() + 90
        while not ready.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert ready.exists(), proc.communicate(timeout=30)
        time.sleep(SAMPLE_EVERY_S * 2.5)  # the guard samples every process's memory
        os.kill(int(ready.read_text()), signal.SIGKILL)  # as the kernel's OOM killer would
        stdout, stderr = proc.communicate(timeout=90)
    finally:
        kill_quietly(proc)
    fields = GuardRun(proc.returncode, stdout, stderr).fields()
    assert (fields["status"], fields["reason"]) == ("FAIL", "oom"), stdout + stderr[-3000:]
    assert f"DataLoader worker (pid {ready.read_text()}) was killed by SIGKILL holding" in fields["hint"]
    assert "MB resident" in fields["hint"] and "the job's peak" in fields["hint"]
    assert "num_workers" in fields["hint"]
    assert "Connection reset" not in fields["hint"] and "ConnectionResetError" not in fields["hint"]


# -- one torchrun rank raises ----------------------------------------------------------------------------------


@pytest.mark.parametrize("record", [False, True], ids=["plain", "record"])
def test_a_torchrun_rank_that_raises_is_named_with_its_own_error(record: bool, tmp_path: Path) -> None:
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    job = [torchrun, "--standalone", "--nproc-per-node", "2", str(JOBS / "rank_raises.py"), "--raise-rank", "1"]
    run = run_guard(["--no-preflight", "--", *job, *(["--record"] if record else [])], cwd=tmp_path)
    fields = run.fields()
    assert (fields["status"], fields["reason"], fields.get("rank")) == ("FAIL", "crash", "1"), run.stderr[-3000:]
    assert "ValueError: rank 1: bad batch at step 4" in fields["hint"]
    assert "ChildFailedError" not in fields["hint"]


def test_rank_lines_and_error_files_name_the_rank_without_an_agent(tmp_path: Path) -> None:
    error_file = tmp_path / "error.json"
    error_file.write_text(json.dumps({"message": {"message": "KeyError: 'labels'",
                                                  "extraInfo": {"py_callstack": "...", "timestamp": "17"}}}))
    facts = JobFacts(error_files={3: str(error_file), 0: str(tmp_path / "missing.json")})
    assert rank_failure(facts) == (3, "KeyError: 'labels'")
    events = OutputEvents()
    stream = StreamFilter(Masker([]), events=events)
    stream.feed(b"[rank1]: Traceback (most recent call last):\n[rank1]:   File x.py, line 1, in <module>\n"
                b"[rank1]: ValueError: rank 1: loss is nan at step 40\n")
    assert events.rank_exceptions == {1: "ValueError: rank 1: loss is nan at step 40"}
    assert events.last_exception is None  # a rank's lines are its own, not the launcher's


# -- an abort at teardown after training completed -----------------------------------------------------------------


def test_an_abort_after_training_completed_and_saved_is_a_pass_with_a_warning_and_the_final_push(
        tmp_path: Path) -> None:
    out, dest = tmp_path / "out", tmp_path / "dest"
    run = run_guard(["--no-preflight", "--push-to", str(dest), str(JOBS / "abort_after_training.py"),
                     "--output-dir", str(out)], cwd=tmp_path)
    fields = run.fields()
    assert (fields["status"], fields["reason"], run.returncode) == ("PASS", "ok", 0), run.stdout + run.stderr[-3000:]
    assert "SIGABRT" in fields["warning"] and "6 of 6 steps" in fields["warning"]
    assert "process group destroyed while a collective was pending" in fields["warning"]
    assert (dest / "model.safetensors").exists()  # the final push happened
    assert "OOM killer" not in run.stdout
    assert "@" not in fields["pushed"] and fields["pushed"].startswith(str(dest))  # a folder renders as the folder


def test_an_abort_after_training_with_no_final_save_stays_killed(tmp_path: Path) -> None:
    run = run_guard(["--no-preflight", str(JOBS / "abort_after_training.py"), "--output-dir", str(tmp_path / "out"),
                     "--no-save"], cwd=tmp_path)
    fields = run.fields()
    assert (fields["status"], fields["reason"], fields["signal"]) == ("FAIL", "killed", "SIGABRT"), run.stdout


# -- a sustained loss rise -----------------------------------------------------------------------------------------


def test_a_loss_that_jumps_35x_and_stays_is_named_once_and_the_pass_carries_a_warning(tmp_path: Path) -> None:
    run = run_guard([str(JOBS / "loss_rise.py"), "--out", str(tmp_path / "out")], cwd=tmp_path)
    fields = run.fields()
    assert (fields["status"], fields["reason"], run.returncode) == ("PASS", "ok", 0), run.stdout + run.stderr[-3000:]
    assert "the loss rose above 10x its early level" in fields["warning"]
    assert "at step 25" in fields["warning"]
    assert f"{tmp_path / 'out' / 'ckpt-20.pt'} (step 20)" in fields["warning"]
    assert run.stderr.count("the loss rose and stayed up") == 1, run.stderr[-3000:]


def test_the_rise_check_follows_its_options(tmp_path: Path) -> None:
    off = run_guard(["--loss-rise-factor", "50", str(JOBS / "loss_rise.py"), "--out", str(tmp_path / "a")],
                    cwd=tmp_path)
    assert off.returncode == 0 and "warning" not in off.fields(), off.stdout
    short = run_guard(["--loss-rise-steps", "200", str(JOBS / "loss_rise.py"), "--out", str(tmp_path / "b")],
                      cwd=tmp_path)
    assert short.returncode == 0 and "warning" not in short.fields(), short.stdout
    bad = run_guard(["--loss-rise-factor", "0.5", str(JOBS / "loss_rise.py")], cwd=tmp_path)
    assert bad.returncode == 2 and "--loss-rise-factor" in bad.stdout + bad.stderr


# -- a Hub that cannot be resolved, with a Hub destination -------------------------------------------------------


def test_an_unresolvable_hub_endpoint_with_a_hub_destination_fails_preflight(tmp_path: Path) -> None:
    env = {"HF_ENDPOINT": "http://no-such-hub.invalid", "HF_HUB_OFFLINE": "0", "HF_TOKEN": "hf_" + "x" * 34}
    run = run_guard(["--push-to", "hf://alice/run", str(JOBS / "echo_args.py")], env=env, cwd=tmp_path)
    fields = run.fields()
    assert (fields["status"], fields["reason"], fields["check"], run.returncode) == \
        ("FAIL", "preflight", "hub-auth", 3), run.stdout + run.stderr[-2000:]
    assert "args:" not in run.stdout  # the job never started
    skipped = run_guard(["preflight", "--push-to", "hf://alice/run", "--skip-check", "hub-auth=the Hub comes later",
                         str(JOBS / "echo_args.py")], env=env, cwd=tmp_path)
    assert skipped.fields().get("check") != "hub-auth", skipped.stdout + skipped.stderr[-2000:]
    assert "skipped by --skip-check: the Hub comes later" in skipped.stderr


# -- the primary rank's losses only, from the first step ----------------------------------------------------------


def test_the_sanity_pass_holds_rank_0s_losses_only_whatever_rank_reports_first(tmp_path: Path) -> None:
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    # rank 1 reports first on purpose (rank 0 starts 1.5 s later); the primary rank is known beforehand
    report = tmp_path / "report.json"
    run = run_guard(["--no-preflight", "--report", str(report), "--", torchrun, "--standalone",
                     "--nproc-per-node", "2", str(JOBS / "rank_losses.py")], cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    sanity = json.loads(report.read_text())["sanity"]
    assert len(sanity) == 5 and max(sanity) < 100, sanity


# -- stall hints: inside torch.compile, and a job that says nothing ----------------------------------------------


def test_a_stall_inside_torch_compile_says_so_with_what_to_do(tmp_path: Path) -> None:
    # the stall timeout covers the job's silent start (importing torch) too: stretched on a loaded machine
    run = run_guard(["--no-preflight", "--stall-timeout", loaded_s(12), "--grace", "3s", str(JOBS / "slow_compile.py")],
                    cwd=tmp_path, timeout_s=180)
    fields = run.fields()
    assert (fields["status"], fields["reason"]) == ("FAIL", "stalled"), run.stdout + run.stderr[-3000:]
    assert "inside torch.compile" in fields["hint"] and "TORCH_LOGS=recompiles" in fields["hint"]
    assert "a collective, a DataLoader worker" not in fields["hint"]


def test_a_silent_job_without_an_agent_is_told_about_block_buffering(tmp_path: Path) -> None:
    code = "import time; print('working', flush=False); time.sleep(120)"
    run = run_guard(["--no-preflight", "--stall-timeout", "4s", "--grace", "2s", "--", sys.executable, "-I", "-c",
                     code], cwd=tmp_path, timeout_s=120)
    fields = run.fields()
    assert (fields["status"], fields["reason"]) == ("FAIL", "stalled"), run.stdout + run.stderr[-3000:]
    assert "block-buffers" in fields["hint"] and "python -u" in fields["hint"]


# -- step= is the last step the agent counted ----------------------------------------------------------------------


def test_a_hang_between_two_loss_reads_says_the_last_step_counted(tmp_path: Path) -> None:
    # sanity 5 steps, then a read every 10: the last report before the hang is step 15, the hang is at step 21
    run = run_guard(["--no-preflight", "--stall-timeout", "20s", "--grace", "3s", str(JOBS / "hang_at_step.py"),
                     "--steps", "21"], cwd=tmp_path, timeout_s=180)
    fields = run.fields()
    assert (fields["status"], fields["reason"], fields["step"]) == ("FAIL", "stalled", "21"), \
        run.stdout + run.stderr[-3000:]


def test_a_job_killed_between_two_loss_reads_says_the_last_step_counted(tmp_path: Path) -> None:
    # issue 21: "step=5 for a SIGKILL at step 9": the steps after the last loss read were never sent, and a killed
    # process sends nothing more; the agent's count is sent every 0.1 s (no device read), so step= is the last step
    import psutil

    proc = start_guard(["--no-preflight", "--stall-timeout", "600s", str(JOBS / "hang_at_step.py"), "--steps", "21"],
                       cwd=tmp_path)
    try:
        deadline = time.monotonic() + 90
        seen = ""
        while "waiting forever" not in seen and time.monotonic() < deadline and proc.poll() is None:
            seen += proc.stdout.readline()
        time.sleep(1.0)  # the count goes out within 0.1 s
        job = next(p for p in psutil.Process(proc.pid).children() if "hang_at_step" in " ".join(p.cmdline()))
        job.kill()
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        kill_quietly(proc)
    fields = GuardRun(proc.returncode, seen + stdout, stderr).fields()
    assert (fields["status"], fields["reason"], fields["step"]) == ("FAIL", "killed", "21"), stdout + stderr[-3000:]


# -- preflight: a push inside try/except is a warning, not a failure -------------------------------------------------


def test_a_push_inside_try_except_is_a_warning_and_the_job_runs(tmp_path: Path) -> None:
    env = {"HF_TOKEN": "", "HF_HOME": str(tmp_path / "hf")}
    run = run_guard([str(JOBS / "push_in_try.py")], env=env, cwd=tmp_path)
    fields = run.fields()
    assert (fields["status"], fields["reason"], run.returncode) == ("PASS", "ok", 0), run.stdout + run.stderr[-3000:]
    assert "could not push the model: offline" in run.stdout
    assert "is inside try/except: a failure there is caught" in run.stderr


# -- an ephemeral platform with no destination ---------------------------------------------------------------------

HF_JOBS_ENV = {"JOB_ID": "6712ab0c", "CPU_CORES": "2", "MEMORY": "16Gi", "ACCELERATOR": "cpu-basic"}


def test_a_trainer_on_hf_jobs_with_no_destination_fails_preflight_destination(tmp_path: Path) -> None:
    job = [str(JOBS / "abort_after_training.py"), "--output-dir", str(tmp_path / "out")]
    run = run_guard(["preflight", "--skip-check", "gpu=no GPU in the tests", *job], env=HF_JOBS_ENV, cwd=tmp_path)
    fields = run.fields()
    assert (fields["status"], fields["reason"], fields["check"], run.returncode) == \
        ("FAIL", "preflight", "destination", 3), run.stdout + run.stderr[-3000:]
    assert "--push-to hf://NS/NAME" in fields["hint"] and "hub_model_id" in fields["hint"]
    kept = run_guard(["preflight", "--skip-check", "gpu=no GPU in the tests", "--skip-check",
                      "destination=a scratch run", *job], env=HF_JOBS_ENV, cwd=tmp_path)
    assert kept.fields().get("check") != "destination", kept.stdout + kept.stderr[-2000:]
    local = run_guard(["preflight", "--skip-check", "gpu=no GPU in the tests", *job], cwd=tmp_path)
    assert local.fields().get("check") != "destination", local.stdout + local.stderr[-2000:]


