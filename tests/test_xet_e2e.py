"""End to end with the Hub's default transfer (Xet) left on, against storage that accepts and never answers."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest
from conftest import JOBS, kill_quietly, run_guard, start_guard

from tests.hubserver import TOKENS, HubServer

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


def test_trainer_with_a_45s_timeout_ends_before_it_when_xet_hangs(hung_xet_hub: HubServer, tmp_path: Path) -> None:
    started = time.monotonic()
    run = run_guard([*FAST, "--grace", "10s", "--timeout", "45s", "--push-to", "alice/xet-hang",
                     str(JOBS / "slow_trainer.py"), "--output-dir", str(tmp_path / "out"), "--step-s", "0.1"],
                    env=xet_env(hung_xet_hub, tmp_path), timeout_s=120)
    took_s = time.monotonic() - started
    fields = run.fields()
    assert took_s < 45, (took_s, run.stderr[-3000:])
    assert (fields["status"], fields["reason"], fields["exit"], fields.get("secured")) == \
        ("TIMEOUT", "deadline", "124", "no"), run.stderr[-3000:]
    assert run.returncode == 124
    assert any("xet-write-token" in r.path for r in hung_xet_hub.requests), "the push did not go through Xet"
    assert not any(p.startswith("last-checkpoint/") for p in hung_xet_hub.repo_files("alice/xet-hang"))


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
