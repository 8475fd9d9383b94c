"""End to end: the time budget and secured checkpoints, against the local Hub test server and folders."""

from __future__ import annotations

import hashlib
import json
import signal
import time
from pathlib import Path

import pytest
from conftest import JOBS, REPO, kill_quietly, run_guard, signal_when, start_guard

from tests.hubserver import TOKENS, HubServer

pytestmark = [pytest.mark.slow]

FAST = ["--skip-check", "python=imports are checked by the other tests", "--grace", "10s"]


@pytest.fixture
def hub():
    with HubServer() as server:
        yield server


def hub_env(hub: HubServer, tmp_path: Path, token: str = TOKENS["write"]) -> dict[str, str]:
    return hub.env(token=token, hf_home=tmp_path / "hf")


def sha256s(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.hub
def test_slow_trainer_with_a_40s_timeout_is_secured_on_the_hub_through_its_500s(hub: HubServer,
                                                                                 tmp_path: Path) -> None:
    # the Hub answers the first two commits with 500: they are retried, and the deadline holds all the same
    hub.inject(status=500, count=2, methods=("POST",), path_contains="/commit/")
    out = tmp_path / "out"
    started = time.monotonic()
    run = run_guard([*FAST, "--timeout", "40s", "--push-to", "hf://alice/slow-run", str(JOBS / "slow_trainer.py"),
                     "--output-dir", str(out), "--step-s", "0.1"], env=hub_env(hub, tmp_path), timeout_s=90)
    took_s = time.monotonic() - started
    assert run.returncode == 75, run.stderr[-3000:]
    fields = run.fields()
    assert (fields["status"], fields["reason"], fields["secured"]) == ("TIMEOUT", "deadline", "yes")
    assert took_s < 40
    assert sum(r.status == 500 for r in hub.requests) == 2 and "attempt" in run.stderr
    local = Path(fields["checkpoint"])
    remote = hub.repo_files("alice/slow-run")
    on_server = {path[len("last-checkpoint/"):]: hashlib.sha256(data).hexdigest()
                 for path, data in remote.items() if path.startswith("last-checkpoint/")}
    manifest = json.loads(remote.pop("last-checkpoint/guard_manifest.json"))  # the record, written after verifying
    assert {rel: entry["sha256"] for rel, entry in manifest["files"].items()} == sha256s(local)
    on_server.pop("guard_manifest.json")
    assert on_server == sha256s(local)
    commit = fields["pushed"].rsplit("@", 1)[1]
    assert len(commit) == 40 and commit in [c.oid for c in hub.commits("alice/slow-run")]


@pytest.mark.hub
def test_sigterm_mid_run_secures_a_checkpoint(hub: HubServer, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = start_guard([*FAST, "--push-to", "alice/interrupted", str(JOBS / "slow_trainer.py"), "--output-dir",
                        str(out), "--step-s", "0.05", "--save-steps", "20"], env=hub_env(hub, tmp_path))
    stdout, stderr = signal_when(proc, out / "checkpoint-20", signal.SIGTERM)
    last = stdout.strip().splitlines()[-1]
    assert proc.returncode == 75, stderr[-3000:]
    assert last.startswith("VERDICT: INTERRUPTED reason=signal exit=75")
    assert "signal=SIGTERM" in last and "secured=yes" in last
    assert any(p.startswith("last-checkpoint/") for p in hub.repo_files("alice/interrupted"))


def time_to_first_step(out: Path) -> float:
    """Seconds ``examples/train_loop.py`` takes, run plainly now, from its start to its first step's line."""
    import subprocess
    import sys

    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(REPO / "examples" / "train_loop.py"), "--steps", "100000",
                             "--save-every", "0", "--output-dir", str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("step=1 "):
                break
        return time.monotonic() - started
    finally:
        proc.kill()
        proc.wait()


def test_custom_loop_with_the_api_and_a_folder_destination(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    # The budget is sized to this machine's load now: a loaded 2-core machine can take 20 s and more to import torch
    # and make the loop's first step, and a deadline before that leaves nothing to secure.
    ready_s = time_to_first_step(tmp_path / "warmup")
    # The guard asks for the save at deadline - margin: that leaves the loop 1.5 x its start-up measured now, plus
    # 5 s, to reach its first step (it trains flat out, a core's worth of CPU, until the deadline).
    timeout_s, margin_s = round(max(14.0, 2.5 * ready_s + 8)), round(max(5.0, ready_s + 3))
    run = run_guard([*FAST, "--timeout", f"{timeout_s}s", "--margin", f"{margin_s}s", "--push-to", str(dest),
                     str(REPO / "examples" / "train_loop.py"), "--steps", "100000", "--save-every", "100000",
                     "--output-dir", str(tmp_path / "out")], timeout_s=timeout_s + 60)
    assert run.returncode == 75, run.stderr[-3000:]
    fields = run.fields()
    assert fields["status"] == "TIMEOUT"
    secured = dest / "last-checkpoint"
    manifest = json.loads((secured / "guard_manifest.json").read_text())
    local = Path(fields["checkpoint"])
    assert local.name == f"checkpoint-{manifest['step']}"
    assert {k: v for k, v in sha256s(secured).items() if k != "guard_manifest.json"} == sha256s(local)


@pytest.mark.hub
def test_hub_unreachable_is_an_honest_timeout_not_a_hang(hub: HubServer, tmp_path: Path) -> None:
    url = hub.url
    started = time.monotonic()
    proc = start_guard([*FAST, "--skip-check", "hub-auth=checked in other tests", "--timeout", "25s", "--margin", "8s",
                        "--push-to", "alice/unreachable", str(JOBS / "slow_trainer.py"), "--output-dir",
                        str(tmp_path / "out"), "--step-s", "0.05"], env=hub_env(hub, tmp_path))
    try:
        time.sleep(5)
        hub.set_down(True)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        kill_quietly(proc)
    assert url
    assert proc.returncode == 124, stderr[-3000:]  # nothing older secured: TIMEOUT, not push_failed
    last = stdout.strip().splitlines()[-1]
    assert last.startswith("VERDICT: TIMEOUT reason=deadline exit=124") and "secured=no" in last
    assert time.monotonic() - started < 40


def test_a_loop_that_never_saves_times_out_unsecured_with_a_hint_that_fits(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    run = run_guard(["--no-preflight", "--timeout", "10s", "--push-to", str(dest), str(JOBS / "plain_loop.py"),
                     "--steps", "1000", "--step-s", "0.2"], timeout_s=60)
    assert run.returncode == 124, run.stderr[-3000:]
    fields = run.fields()
    assert (fields["status"], fields["reason"], fields["secured"]) == ("TIMEOUT", "deadline", "no")
    assert "checkpoint_saved(path)" in fields["hint"] and "pass --push-to" not in fields["hint"]
    assert not (dest / "last-checkpoint").exists()


def test_a_partial_checkpoint_is_never_pushed(tmp_path: Path) -> None:
    out, dest = tmp_path / "out", tmp_path / "dest"
    proc = start_guard(["--grace", "6s", "--skip-check", "python=not needed", "--push-to", str(dest),
                        "--output-dir", str(out), str(JOBS / "partial_checkpoint.py"), "--output-dir", str(out)])
    stdout, stderr = signal_when(proc, out / "checkpoint-20", signal.SIGTERM, settle_s=0.5, wait_s=30)
    assert proc.returncode == 75, stderr[-3000:]
    assert "checkpoint-20" in stderr and "skipped" in stderr
    assert json.loads((dest / "last-checkpoint" / "trainer_state.json").read_text())["global_step"] == 10
    assert "checkpoint=" + str(out / "checkpoint-10") in stdout


@pytest.mark.hub
def test_success_pushes_the_final_model(hub: HubServer, tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = run_guard([*FAST, "--push-to", "hf://alice/final-model", str(JOBS / "slow_trainer.py"), "--output-dir",
                     str(out), "--step-s", "0", "--max-steps", "12", "--save-steps", "100"],
                    env=hub_env(hub, tmp_path), timeout_s=90)
    assert run.returncode == 0, run.stderr[-3000:]
    fields = run.fields()
    assert fields["status"] == "PASS" and "pushed" in fields
    remote = hub.repo_files("alice/final-model")
    assert hashlib.sha256(remote["model.safetensors"]).hexdigest() == \
        hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()


@pytest.mark.hub
def test_read_only_token_fails_preflight_before_the_job_starts(hub: HubServer, tmp_path: Path) -> None:
    run = run_guard([*FAST, "--push-to", "alice/nope", str(JOBS / "exits.py")],
                    env=hub_env(hub, tmp_path, TOKENS["read"]))
    assert run.returncode == 3, run.stderr[-3000:]
    assert run.fields()["check"] == "hub-auth"
    assert "step 1 loss" not in run.stdout
