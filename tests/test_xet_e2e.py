"""End to end with the Hub's default transfer (Xet) left on, against storage that accepts and never answers."""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from conftest import JOBS, GuardRun, kill_quietly, start_guard, wait_own_cpu_s

from tests.hubserver import TOKENS, HubServer, client_constants

pytestmark = [pytest.mark.slow, pytest.mark.hub]

FAST = ["--skip-check", "python=imports are checked by the other tests"]


@pytest.fixture
def hung_xet_hub():
    with HubServer() as server:
        server.silent_xet_storage()
        yield server


def xet_env(hub: HubServer, tmp_path: Path) -> dict[str, str]:
    env = hub.env(token=TOKENS["write"], hf_home=tmp_path / "hf")
    env.pop("HF_HUB_DISABLE_XET", None)
    env["HF_HUB_DISABLE_XET"] = ""  # the conftest default is 1: Xet stays ON here (empty is false)
    return env


def run_timed(args: list[str], env: dict[str, str]) -> tuple[GuardRun, float, float]:
    """Run the guard with its budget counted from now (``--started-at``, so that the test's clock and the guard's
    deadline agree); returns the run, when its VERDICT line came and when it exited (seconds from now). The
    VERDICT is what must come before the platform's kill; the process then ends (interpreter shutdown). The run's
    ``own_cpu_s`` is the guard process's own CPU time."""
    started, started_at = time.monotonic(), f"{time.time():.3f}"
    proc = start_guard([*FAST, "--started-at", started_at, *args], env=env)
    verdict_at = [math.inf]
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("VERDICT: "):
                verdict_at[0] = time.monotonic() - started

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert proc.stderr is not None
        stderr = proc.stderr.read()
        own_cpu_s = wait_own_cpu_s(proc, timeout_s=120)
        exited_s = time.monotonic() - started
        proc.wait(timeout=10)
    finally:
        kill_quietly(proc)
    reader.join(10)
    return GuardRun(proc.returncode, "".join(lines), stderr, own_cpu_s), verdict_at[0], exited_s


def test_trainer_with_a_45s_timeout_ends_before_it_when_xet_hangs(hung_xet_hub: HubServer, tmp_path: Path) -> None:
    run, verdict_s, exited_s = run_timed(["--grace", "10s", "--timeout", "45s", "--push-to", "alice/xet-hang",
                                          str(JOBS / "slow_trainer.py"), "--output-dir", str(tmp_path / "out"),
                                          "--step-s", "0.1"], env=xet_env(hung_xet_hub, tmp_path))
    fields = run.fields()
    assert verdict_s < 45 and exited_s < 45 + 3, (verdict_s, exited_s, run.stderr[-3000:])
    assert (fields["status"], fields["reason"], fields["exit"], fields.get("secured")) == \
        ("TIMEOUT", "deadline", "124", "no"), run.stderr[-3000:]
    assert run.returncode == 124
    assert any("xet-write-token" in r.path for r in hung_xet_hub.requests), "the push did not go through Xet"
    assert not any(p.startswith("last-checkpoint/") for p in hung_xet_hub.repo_files("alice/xet-hang"))
    # the loop waited for the hung push after the job exited, it did not spin (it used 19.6 s of CPU in a 45 s run
    # when the drain's end stayed due; about 1 s now)
    assert run.own_cpu_s is not None and run.own_cpu_s < 0.2 * exited_s, (run.own_cpu_s, exited_s)


def test_a_background_push_hung_on_xet_does_not_delay_the_deadline(hung_xet_hub: HubServer, tmp_path: Path) -> None:
    run, verdict_s, exited_s = run_timed(["--grace", "10s", "--timeout", "40s", "--margin", "10s", "--push-to",
                                          "alice/xet-bg", str(JOBS / "slow_trainer.py"), "--output-dir",
                                          str(tmp_path / "out"), "--step-s", "0.1", "--save-steps", "5"],
                                         env=xet_env(hung_xet_hub, tmp_path))
    # The Trainer's first save was pushed in the background and hung on Xet long before the deadline came ...
    background = run.stderr.find("in the background")
    near = run.stderr.find("deadline in ")
    assert 0 <= background < near, run.stderr[-3000:]
    assert any("xet-write-token" in r.path for r in hung_xet_hub.requests), "the push did not go through Xet"
    # ... and neither it nor the securing push delayed the VERDICT past the deadline.
    assert verdict_s < 40 and exited_s < 40 + 3, (verdict_s, exited_s, run.stderr[-3000:])
    fields = run.fields()
    assert (fields["status"], fields["reason"], fields["exit"], fields.get("secured")) == \
        ("TIMEOUT", "deadline", "124", "no"), run.stderr[-3000:]
    assert not any(p.startswith("last-checkpoint/") for p in hung_xet_hub.repo_files("alice/xet-bg"))


def test_a_signal_during_the_final_push_ends_within_grace(hung_xet_hub: HubServer, tmp_path: Path) -> None:
    proc = start_guard([*FAST, "--grace", "4s", "--background-push", "off", "--push-to", "alice/xet-final",
                        str(JOBS / "slow_trainer.py"), "--output-dir", str(tmp_path / "out"), "--step-s", "0",
                        "--max-steps", "12", "--save-steps", "100"], env=xet_env(hung_xet_hub, tmp_path))
    seen = threading.Event()
    lines: list[str] = []

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if "securing the final model" in line:
                seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert seen.wait(90), "".join(lines)[-3000:]
        time.sleep(1.0)  # the push is under way (hung on the storage)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        stdout = proc.stdout.read() if proc.stdout else ""
        proc.wait(timeout=30)
        ended_s = time.monotonic() - signalled
    finally:
        kill_quietly(proc)
    reader.join(5)
    assert ended_s < 4.0, ended_s
    verdict = stdout.strip().splitlines()[-1]
    assert verdict.startswith("VERDICT: INTERRUPTED reason=signal exit=143"), verdict + "".join(lines)[-3000:]
    assert "secured=no" in verdict and "signal=SIGTERM" in verdict
    assert proc.returncode == 143


# -- the resume fetch through Xet ---------------------------------------------------------------------------------


def secure_a_checkpoint(hub: HubServer, repo_id: str, tmp_path: Path, step: int = 20) -> None:
    """A checkpoint secured the guard's way (commit ``guard: checkpoint step N``), pushed over LFS (Xet off)."""
    from huggingface_hub import HfApi

    from guard.secure.hub import Securer

    folder = tmp_path / "seed" / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(os.urandom(2_000_000))
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    with client_constants():
        api = HfApi(endpoint=hub.url, token=TOKENS["write"])
        Securer(repo_id, api=api).push_checkpoint(folder, step=step, deadline=time.monotonic() + 60)


def test_the_resume_fetch_hung_on_xet_ends_within_its_bound(hung_xet_hub: HubServer, tmp_path: Path) -> None:
    secure_a_checkpoint(hung_xet_hub, "alice/xet-resume", tmp_path)
    run, verdict_s, exited_s = run_timed(["--timeout", "30s", "--resume", "on", "--push-to", "alice/xet-resume",
                                          "--output-dir", str(tmp_path / "out"), str(JOBS / "plain_loop.py"),
                                          "--steps", "5"], env=xet_env(hung_xet_hub, tmp_path))
    assert any("xet-read-token" in r.path for r in hung_xet_hub.requests), "the download did not go through Xet"
    # The fetch may take half of the budget: it was killed then, and the guard said so before the 30 s deadline.
    assert verdict_s < 30 and exited_s < 30 + 3, (verdict_s, exited_s, run.stderr[-3000:])
    fields = run.fields()
    assert (fields["status"], fields["check"], run.returncode) == ("FAIL", "resume", 3), run.stderr[-3000:]
    assert "did not finish" in run.stderr and "damaged" not in run.verdict, run.stdout[-2000:] + run.stderr[-2000:]
    assert "step 5 done" not in run.stdout  # the job never started on a half-fetched checkpoint
    assert not list((tmp_path / "out").glob("checkpoint-*"))  # nothing partial left where the job would look


def test_a_signal_during_the_resume_fetch_on_xet_ends_within_grace(hung_xet_hub: HubServer, tmp_path: Path) -> None:
    secure_a_checkpoint(hung_xet_hub, "alice/xet-resume-sig", tmp_path)
    proc = start_guard([*FAST, "--grace", "4s", "--resume", "on", "--push-to", "alice/xet-resume-sig",
                        "--output-dir", str(tmp_path / "out"), str(JOBS / "plain_loop.py"), "--steps", "5"],
                       env=xet_env(hung_xet_hub, tmp_path))
    try:
        until = time.monotonic() + 90
        while not any("xet-read-token" in r.path for r in hung_xet_hub.requests) and time.monotonic() < until:
            time.sleep(0.1)  # the fetch is under way in hf_xet
        assert proc.poll() is None and any("xet-read-token" in r.path for r in hung_xet_hub.requests)
        time.sleep(1.0)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=30)
        ended_s = time.monotonic() - signalled
    finally:
        kill_quietly(proc)
    assert ended_s < 4.0, (ended_s, stderr[-3000:])
    verdict = stdout.strip().splitlines()[-1]
    assert verdict.startswith("VERDICT: INTERRUPTED reason=signal") and "exit=143" in verdict, verdict + stderr[-3000:]
    assert proc.returncode == 143
    assert "step 5 done" not in stdout
