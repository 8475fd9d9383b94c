"""End to end: heartbeat lines and the trackio project of a supervised run."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from conftest import JOBS, run_guard

pytestmark = [pytest.mark.slow]


def test_heartbeat_lines_during_a_run() -> None:
    run = run_guard(["--no-preflight", "--heartbeat", "1s", "--timeout", "1h", str(JOBS / "plain_loop.py"),
                     "--steps", "40", "--step-s", "0.1"])
    assert run.returncode == 0, run.stderr[-2000:]
    beats = [line for line in run.stderr.splitlines() if line.startswith("[guard] heartbeat ")]
    assert len(beats) >= 2
    last = beats[-1]
    for key in ("step=", "loss=", "steps/s=", "left=", "tree_rss=", "gpu"):
        assert key in last, last


def test_trackio_gets_the_losses_and_the_verdict_with_an_alert(tmp_path: Path) -> None:
    pytest.importorskip("trackio")
    store = tmp_path / "trackio"
    store.mkdir()
    run = run_guard(["--no-preflight", "--heartbeat", "1s", "--trackio", "guarded", str(JOBS / "plain_loop.py"),
                     "--steps", "30", "--step-s", "0.1", "--nan-at", "25"], env={"TRACKIO_DIR": str(store)})
    assert run.returncode == 4, run.stderr[-2000:]
    assert run.verdict.startswith("VERDICT: FAIL reason=non_finite_loss")
    with sqlite3.connect(store / "guarded.db") as db:
        alerts = db.execute("select title, text, level from alerts").fetchall()
        rows = db.execute("select metrics from metrics").fetchall()
    metrics = " ".join(m.decode() if isinstance(m, bytes) else m for (m,) in rows)
    assert any("non_finite_loss" in title and level == "error" for title, _, level in alerts), alerts
    assert '"loss"' in metrics and '"jobguard/verdict"' in metrics and "verdict/exit_code" not in metrics
