"""End to end: a stopped run secures step N; the next run with --resume continues from it.

The first run is stopped by SIGTERM once the job has trained (its own output says so), not by a short --timeout:
on a loaded machine a 12-16 s budget can run out before the job's first step, and then nothing is secured. What
is secured on a signal and on a deadline is the same checkpoint request and push (test_secure_e2e covers the
deadline); resuming is what is tested here.
"""

from __future__ import annotations

import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from conftest import JOBS, REPO, GuardRun, kill_quietly, run_guard, start_guard

from tests.hubserver import TOKENS, HubServer

pytestmark = [pytest.mark.slow]

FAST = ["--skip-check", "python=imports are checked by the other tests", "--grace", "10s"]
MAX_STEPS = 400


@pytest.fixture
def hub():
    with HubServer() as server:
        yield server


def stop_when_ready(args: list[str], *, ready: str, env: dict[str, str] | None = None,
                    timeout_s: float = 120) -> GuardRun:
    """Run the guard; SIGTERM it once a line of its output (the job's or its own) contains ``ready``."""
    proc = start_guard(args, env=env)
    seen = threading.Event()
    out: dict[str, list[str]] = {"stdout": [], "stderr": []}

    def read(name: str, stream: subprocess.Popen) -> None:
        for line in stream:  # type: ignore[attr-defined]
            out[name].append(line)
            if ready in line:
                seen.set()

    readers = [threading.Thread(target=read, args=(name, getattr(proc, name)), daemon=True) for name in out]
    for reader in readers:
        reader.start()
    try:
        until = time.monotonic() + timeout_s
        while not seen.is_set() and proc.poll() is None and time.monotonic() < until:
            seen.wait(0.1)
        assert seen.is_set(), "".join(out["stderr"])[-3000:]
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        kill_quietly(proc)
    for reader in readers:
        reader.join(10)
    return GuardRun(proc.returncode, "".join(out["stdout"]), "".join(out["stderr"]))


@pytest.mark.hub
def test_trainer_resumes_from_the_secured_step_and_ends_at_max_steps_and_a_damaged_copy_is_refused(
        hub: HubServer, tmp_path: Path) -> None:
    # one secured run serves both halves: the resume from it, then the same checkpoint damaged on the server
    env = hub.env(token=TOKENS["write"], hf_home=tmp_path / "hf")
    first = stop_when_ready([*FAST, "--push-to", "alice/resumable", str(JOBS / "slow_trainer.py"), "--output-dir",
                             str(tmp_path / "run1"), "--step-s", "0.05", "--max-steps", str(MAX_STEPS),
                             "--save-steps", "20"], ready="checkpoint saved by the job", env=env)
    assert first.returncode == 75, first.stderr[-3000:]
    assert first.fields()["status"] == "INTERRUPTED" and first.fields()["secured"] == "yes"
    secured_step = int(re.search(r"checkpoint-(\d+)", first.fields()["checkpoint"]).group(1))
    assert 0 < secured_step < MAX_STEPS

    second = run_guard([*FAST, "--resume", "on", "--push-to", "alice/resumable", "--output-dir",
                        str(tmp_path / "run2"), str(JOBS / "slow_trainer.py"), "--output-dir", str(tmp_path / "run2"),
                        "--step-s", "0", "--max-steps", str(MAX_STEPS)], env=env, timeout_s=90)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"train_begin global_step={secured_step}" in second.stdout
    steps_run2 = int(re.search(r"steps_this_run=(\d+)", second.stdout).group(1))
    assert secured_step + steps_run2 == MAX_STEPS  # the same optimizer steps in all as an uninterrupted run
    fields = second.fields()
    assert fields["step"] == str(MAX_STEPS)
    assert fields["resumed_from"].startswith(str(tmp_path / "run2" / f"checkpoint-{secured_step}"))

    # the secured checkpoint's weights damaged on the server (in every commit that holds them: a resume fetches at
    # the commit its record names, and the secured checkpoint is now run 2's first save): runs on a fresh machine
    # (an empty Hugging Face cache; run 2's holds intact copies) refuse it, and start fresh when asked to
    for commit in hub.commits("alice/resumable"):
        if "last-checkpoint/model.safetensors" in commit.files:
            hub.corrupt("alice/resumable", "last-checkpoint/model.safetensors", revision=commit.oid)
    env = hub.env(token=TOKENS["write"], hf_home=tmp_path / "hf-fresh")
    refused = run_guard([*FAST, "--resume", "on", "--push-to", "alice/resumable", "--output-dir",
                         str(tmp_path / "run3"), str(JOBS / "slow_trainer.py"), "--output-dir", str(tmp_path / "run3")],
                        env=env, timeout_s=60)
    assert refused.returncode == 3, refused.stderr[-3000:]
    assert refused.fields()["check"] == "resume"
    assert "train_begin" not in refused.stdout
    fresh = run_guard([*FAST, "--resume", "if-valid", "--push-to", "alice/resumable", "--output-dir",
                       str(tmp_path / "run4"), str(JOBS / "slow_trainer.py"), "--output-dir", str(tmp_path / "run4"),
                       "--step-s", "0", "--max-steps", "5", "--save-steps", "100"], env=env, timeout_s=60)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert "train_begin global_step=0" in fresh.stdout


def test_custom_loop_resumes_through_resume_path(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    first = stop_when_ready([*FAST, "--push-to", str(dest), str(REPO / "examples" / "train_loop.py"), "--steps",
                             "100000", "--save-every", "100000", "--log-every", "10", "--output-dir",
                             str(tmp_path / "run1")], ready="step=10 ")
    assert first.returncode == 75, first.stderr[-3000:]
    assert first.fields()["status"] == "INTERRUPTED" and first.fields()["secured"] == "yes"
    step = int(re.search(r"checkpoint-(\d+)", first.fields()["checkpoint"]).group(1))
    second = run_guard([*FAST, "--resume", "on", "--push-to", str(dest), "--output-dir", str(tmp_path / "run2"),
                        str(REPO / "examples" / "train_loop.py"), "--steps", str(step + 5), "--output-dir",
                        str(tmp_path / "run2"), "--save-every", "1000"], timeout_s=90)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"at step {step}" in second.stdout
    assert "resumed_from=" in second.verdict
    assert second.fields()["step"] == str(step + 5)  # the .backward() count continues from the checkpoint


def test_requeue_runs_scontrol_after_the_verdict_and_survives_slurms_sigterm(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "scontrol-calls"
    scontrol = bin_dir / "scontrol"
    report = tmp_path / "report.json"
    # Like Slurm, the requeue is followed by a SIGTERM to the guard; the VERDICT and the report are out by then.
    scontrol.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\n[ \"$1\" = requeue ] || exit 1\n"
                        f"test -f {report} && echo report-written >> {calls}\nkill -TERM $PPID\nsleep 0.5\nexit 0\n")
    scontrol.chmod(0o755)
    import os

    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "0"}
    # Stopped as Slurm preempts a job (SIGTERM), once it trains: a secured stop (exit 75) is requeued.
    run = stop_when_ready([*FAST, "--requeue", "--report", str(report), "--push-to", str(tmp_path / "dest"),
                           str(REPO / "examples" / "train_loop.py"), "--steps", "100000", "--save-every", "100000",
                           "--log-every", "10", "--output-dir", str(tmp_path / "out")], ready="step=10 ", env=env)
    assert run.returncode == 75, run.stderr[-3000:]
    assert "requeue 4242" in calls.read_text()
    assert "report-written" in calls.read_text()
    assert run.verdict.startswith("VERDICT: INTERRUPTED") and "secured=yes" in run.verdict
    assert "platform: slurm" in run.stderr


def test_sigterm_during_preflight_ends_the_guard_within_grace(tmp_path: Path) -> None:
    import os
    import signal
    import time

    import psutil
    from conftest import start_guard

    lib = tmp_path / "lib"
    lib.mkdir()
    pid_file = tmp_path / "import-pid"
    (lib / "slowimport.py").write_text(f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
                                       "time.sleep(120)\n")
    script = tmp_path / "train.py"
    script.write_text("import slowimport\nprint('never')\n")
    proc = start_guard(["--grace", "4s", str(script)], env={"PYTHONPATH": f"{REPO}{os.pathsep}{lib}"})
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() and time.monotonic() < deadline:  # preflight is importing the module
            time.sleep(0.1)
        assert pid_file.exists()
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        took_s = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert out.strip().splitlines()[-1].startswith("VERDICT: INTERRUPTED reason=signal")
    assert took_s < 4
    assert "never" not in out
    importer = int(pid_file.read_text())
    time.sleep(0.5)
    assert not psutil.pid_exists(importer) or psutil.Process(importer).status() == psutil.STATUS_ZOMBIE
