"""End to end with the Hub's default transfer (Xet) left on: against the local Hub's own Xet storage
(tests/xetcas.py: pushes, verification and resume go through hf_xet), against storage that accepts and never answers
(``silent_xet_storage``: the time bounds), and against a Hub without Xet (the hint names HF_HUB_DISABLE_XET=1)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from conftest import JOBS, GuardRun, kill_quietly, load_factor, run_guard, start_guard, wait_own_cpu_s

from tests.hubserver import TOKENS, HubServer, client_constants

pytestmark = [pytest.mark.slow, pytest.mark.hub]

FAST = ["--skip-check", "python=imports are checked by the other tests"]


@pytest.fixture
def hung_xet_hub():
    with HubServer() as server:
        server.silent_xet_storage()
        yield server


def xet_env(hub: HubServer, tmp_path: Path) -> dict[str, str]:
    return hub.env(token=TOKENS["write"], hf_home=tmp_path / "hf")  # Xet on: the client's default


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


def secure_a_checkpoint(hub: HubServer, repo_id: str, tmp_path: Path, step: int = 20, *,
                        xet: bool = False) -> dict[str, bytes]:
    """A checkpoint secured the guard's way (commit ``guard: checkpoint step N``), pushed over LFS (``xet=False``:
    the silent storage takes nothing) or through the local Hub's Xet storage; returns its files' bytes by name."""
    from huggingface_hub import HfApi

    from guard.secure.securer import Securer

    folder = tmp_path / "seed" / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(os.urandom(2_000_000))
    # opaque bytes that do not start as a pickle (0x80): the format check would read them as one cut short
    (folder / "optimizer.pt").write_bytes(b"\0" + os.urandom(700_000))
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    with client_constants(xet=xet):
        api = HfApi(endpoint=hub.url, token=TOKENS["write"])
        Securer(repo_id, api=api).push_checkpoint(folder, step=step, deadline=time.monotonic() + 60)
    return {p.name: p.read_bytes() for p in folder.iterdir()}


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


# -- the local Hub's own Xet storage (tests/xetcas.py) -------------------------------------------------------------


@pytest.fixture
def xet_hub():
    with HubServer() as server:
        yield server


def test_a_run_secured_through_xet_passes_its_verification(xet_hub: HubServer, tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = run_guard([*FAST, "--grace", "10s", "--push-to", "hf://alice/xet-final", str(JOBS / "slow_trainer.py"),
                     "--output-dir", str(out), "--step-s", "0", "--max-steps", "12", "--save-steps", "5"],
                    env=xet_env(xet_hub, tmp_path), timeout_s=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.fields()["status"] == "PASS" and "pushed" in run.fields(), run.verdict
    # the bytes went through Xet (xorbs and shards), never a plain LFS upload
    assert any("/cas/v1/xorbs/" in r.path and r.status == 200 for r in xet_hub.requests)
    assert not [r for r in xet_hub.requests if r.method == "PUT"]
    remote = xet_hub.repo_files("alice/xet-final")
    assert remote["model.safetensors"] == (out / "model.safetensors").read_bytes()
    # the guard's verification compared the sha256 hf_xet computed with the one get_paths_info returns
    checkpoint = {p: d for p, d in remote.items() if p.startswith("last-checkpoint/")}
    manifest = json.loads(checkpoint.pop("last-checkpoint/guard_manifest.json"))
    assert {f"last-checkpoint/{rel}": entry["sha256"] for rel, entry in manifest["files"].items()} == \
        {path: hashlib.sha256(data).hexdigest() for path, data in checkpoint.items()}


def test_a_hub_without_xet_fails_the_push_with_a_hint_naming_HF_HUB_DISABLE_XET(xet_hub: HubServer,
                                                                                tmp_path: Path) -> None:
    xet_hub.xet = False  # its xet-write-token route answers 404 (huggingface_hub #4507)
    args = [*FAST, "--grace", "10s", "--background-push", "off", "--push-to", "hf://alice/no-xet",
            str(JOBS / "slow_trainer.py"), "--step-s", "0", "--max-steps", "6", "--save-steps", "100"]
    run = run_guard([*args, "--output-dir", str(tmp_path / "out")], env=xet_env(xet_hub, tmp_path), timeout_s=120)
    fields = run.fields()
    assert (fields["status"], fields["reason"]) == ("FAIL", "push_failed"), run.stdout[-2000:] + run.stderr[-3000:]
    assert "HF_HUB_DISABLE_XET=1" in fields["hint"], fields
    assert any("xet-write-token" in r.path and r.status == 404 for r in xet_hub.requests)
    # the remedy the hint names: the same run with HF_HUB_DISABLE_XET=1 uploads over plain LFS and passes
    env = xet_hub.env(token=TOKENS["write"], hf_home=tmp_path / "hf", xet=False)
    again = run_guard([*args, "--output-dir", str(tmp_path / "out2")], env=env, timeout_s=120)
    assert again.returncode == 0 and again.fields()["status"] == "PASS", again.stderr[-3000:]
    assert any(r.method == "PUT" and r.path.startswith("/_lfs/") for r in xet_hub.requests)


def test_the_resume_fetch_downloads_through_xet_and_places_the_secured_bytes(xet_hub: HubServer,
                                                                             tmp_path: Path) -> None:
    """The guard's resume fetch (its worker process, the client's default download with Xet on): every LFS file of
    the secured checkpoint is rebuilt from the Xet storage's reconstruction, none is fetched over plain HTTP, and
    the bytes placed in the output folder are the secured ones, well within the run's deadline."""
    seeded = secure_a_checkpoint(xet_hub, "alice/xet-fetch", tmp_path, xet=True)
    lfs = {"model.safetensors", "optimizer.pt"}
    file_ids = {name: xet_hub.cas.file_id_for(hashlib.sha256(seeded[name]).hexdigest()) for name in lfs}
    assert None not in file_ids.values(), file_ids  # both were uploaded through Xet
    before = len(xet_hub.requests)
    run, verdict_s, _ = run_timed(["--timeout", "60s", "--resume", "on", "--push-to", "alice/xet-fetch",
                                   "--output-dir", str(tmp_path / "out"), str(JOBS / "plain_loop.py"), "--steps", "5"],
                                  env=xet_env(xet_hub, tmp_path))
    fields = run.fields()
    assert (fields["status"], run.returncode) == ("PASS", 0), run.stdout[-2000:] + run.stderr[-3000:]
    assert fields["resumed_from"].startswith(str(tmp_path / "out" / "checkpoint-20")), run.verdict
    assert verdict_s < 60, verdict_s
    seen = xet_hub.requests[before:]
    assert any("/xet-read-token/" in r.path and r.status == 200 for r in seen)
    for name, file_id in file_ids.items():
        assert any(r.path.startswith(f"/cas/v2/reconstructions/{file_id}") and r.status == 200 for r in seen), name
        assert not any(r.method == "GET" and r.path.endswith(f"/last-checkpoint/{name}") for r in seen), name
    assert any("/cas/xorb-data/" in r.path and r.status in (200, 206) for r in seen)
    placed = tmp_path / "out" / "checkpoint-20"
    assert {p.name: p.read_bytes() for p in placed.iterdir()} == seeded


def test_a_resume_fetch_stalled_in_the_xet_storage_ends_before_the_deadline(xet_hub: HubServer,
                                                                            tmp_path: Path) -> None:
    secure_a_checkpoint(xet_hub, "alice/xet-stall", tmp_path, xet=True)
    xet_hub.inject(latency_s=600, path_contains="/cas/xorb-data/")  # the storage stops sending the file's bytes
    run, verdict_s, exited_s = run_timed(["--timeout", "30s", "--resume", "on", "--push-to", "alice/xet-stall",
                                          "--output-dir", str(tmp_path / "out"), str(JOBS / "plain_loop.py"),
                                          "--steps", "5"], env=xet_env(xet_hub, tmp_path))
    assert any("/cas/v2/reconstructions/" in r.path and r.status == 200 for r in xet_hub.requests), \
        "the download did not reach the Xet storage: " + run.stderr[-3000:]
    assert verdict_s < 30 and exited_s < 30 + 3, (verdict_s, exited_s, run.stderr[-3000:])
    fields = run.fields()
    assert (fields["status"], fields["check"], run.returncode) == ("FAIL", "resume", 3), run.stderr[-3000:]
    assert "did not finish" in run.stderr and "step 5 done" not in run.stdout
    assert not list((tmp_path / "out").glob("checkpoint-*"))


def test_without_a_deadline_a_stalled_xet_fetch_ends_at_the_stated_default(
        xet_hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """No --timeout: the resume's peek and fetch are bounded by ``stages.FETCH_LIMIT_S`` (900 s; shortened here),
    said in the log, and a Xet download stalled in the storage is killed then (hf_xet alone retried a stalled
    download for up to 15 minutes, xet-core #869)."""
    from guard.run import stages
    from guard.secure import budget, resume
    from guard.secure.securer import Securer

    secure_a_checkpoint(xet_hub, "alice/xet-nodeadline", tmp_path, xet=True)
    for name, value in xet_env(xet_hub, tmp_path / "fetch").items():
        monkeypatch.setenv(name, value)  # for the worker process
    xet_hub.inject(latency_s=600, path_contains="/cas/xorb-data/")
    limit_s = 15.0 * min(load_factor(), 3.0)
    monkeypatch.setattr(stages, "FETCH_LIMIT_S", limit_s)
    started = time.monotonic()
    with caplog.at_level("INFO", logger="guard.stages"):
        deadline = stages._fetch_deadline(budget.Deadline(time.time(), None, None, "none"))
    assert f"may take up to {limit_s:.0f}s" in caplog.text
    with pytest.raises(resume.FetchTimedOut):
        resume.choose(tmp_path / "out", Securer("alice/xet-nodeadline", token=TOKENS["write"]), deadline=deadline,
                      abort=lambda: False)
    assert time.monotonic() - started < limit_s + 5
    assert any("/cas/v2/reconstructions/" in r.path for r in xet_hub.requests)  # stalled in Xet's data phase
    assert not list((tmp_path / "out").glob("checkpoint-*"))
