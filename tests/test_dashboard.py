"""The dashboard in a real browser: a guarded run, ``trackio show`` on 127.0.0.1, headless Chromium.

The run: ``saving_loop.py`` under ``--timeout 30s`` with background pushes to a local folder and ``--trackio``,
so that the page has the loss, the heartbeat figures, the securing alerts and a TIMEOUT verdict. Chromium is
Debian's ``chromium`` package (``tests/browser/setup.sh`` installs it); without it the test is skipped, except
under ``CI=true``, where it fails. ``JOBGUARD_WRITE_DOCS=1`` also writes the screenshots the README shows
(``docs/dashboard.png``, ``docs/dashboard-alerts.png``).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import JOBS, REPO, run_guard

pytestmark = [pytest.mark.slow]
pytest.importorskip("trackio")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None and os.environ.get("CI", "").lower() != "true":
    pytest.skip("chromium is not installed (tests/browser/setup.sh installs Debian's package)",
                allow_module_level=True)

PROJECT = "guarded-dashboard"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def chromium(url: str, *, screenshot: Path | None = None, budget_ms: int = 15000) -> str:
    """Load ``url`` in headless Chromium with a fresh profile; the DOM after ``budget_ms`` of virtual time, or
    (with ``screenshot``) write a 1400x1000 PNG there."""
    assert CHROMIUM is not None, "CI=true: chromium must be installed (tests/browser/setup.sh)"
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        args = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                f"--user-data-dir={profile}", f"--virtual-time-budget={budget_ms}", "--window-size=1400,1000"]
        args += [f"--screenshot={screenshot}"] if screenshot is not None else ["--dump-dom"]
        done = subprocess.run([*args, url], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.fixture
def dashboard(tmp_path: Path) -> Iterator[tuple[str, Path, str]]:
    """A guarded run in PROJECT, and ``trackio show`` serving it; yields (base URL, TRACKIO_DIR, run name)."""
    store = tmp_path / "trackio"
    store.mkdir()
    run = run_guard(["--no-preflight", "--heartbeat", "2s", "--timeout", "30s", "--push-interval", "0s",
                     "--push-to", "./dest", "--trackio", PROJECT, str(JOBS / "saving_loop.py"),
                     "--output-dir", "./out", "--step-s", "0.1", "--save-every", "50"],
                    env={"TRACKIO_DIR": str(store)}, cwd=tmp_path, timeout_s=120)
    assert run.verdict.startswith("VERDICT: TIMEOUT reason=deadline exit=75"), run.stderr[-3000:]
    with sqlite3.connect(store / f"{PROJECT}.db") as db:
        [(name,)] = db.execute("select distinct run_name from metrics").fetchall()
    port = free_port()
    env = {**os.environ, "TRACKIO_DIR": str(store), "GRADIO_SERVER_PORT": str(port), "HF_HUB_OFFLINE": "1"}
    env.pop("DISPLAY", None)
    trackio_cli = Path(sys.executable).with_name("trackio")
    show = subprocess.Popen([str(trackio_cli), "show", "--project", PROJECT, "--host", "127.0.0.1"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(base + "/", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            assert show.poll() is None and time.monotonic() < end, "trackio show did not start"
            time.sleep(0.3)
        yield base, store, name
    finally:
        os.killpg(show.pid, signal.SIGTERM)
        try:
            show.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(show.pid, signal.SIGKILL)


def test_the_run_its_loss_and_its_alerts_on_the_dashboard(dashboard: tuple[str, Path, str],
                                                          tmp_path: Path) -> None:
    base, _store, name = dashboard
    metrics_dom = chromium(f"{base}/?project={PROJECT}")
    assert name in metrics_dom  # the run, in the sidebar and the legends
    assert ">loss<" in metrics_dom and "<svg" in metrics_dom  # the loss plot, drawn
    for figure in ("steps_per_s", "step_time_s", "left_s", "margin_s", "secured_step", "tree_rss_gib"):
        assert f">{figure}<" in metrics_dom, figure
    assert ">exit_code<" not in metrics_dom  # the verdict is text, not a plot
    reports_dom = chromium(f"{base}/reports?project={PROJECT}")
    for title in ("securing started: the deadline is near", "checkpoint secured: step 50",
                  "VERDICT TIMEOUT reason=deadline"):
        assert title in reports_dom, title
    assert "VERDICT: TIMEOUT reason=deadline exit=75" in reports_dom  # the verdict report's text
    shots = {"dashboard.png": f"{base}/?project={PROJECT}", "dashboard-alerts.png": f"{base}/reports?project={PROJECT}"}
    for file, url in shots.items():
        shot = tmp_path / file
        chromium(url, screenshot=shot)
        data = shot.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000, len(data)
        if os.environ.get("JOBGUARD_WRITE_DOCS") == "1":
            (REPO / "docs").mkdir(exist_ok=True)
            shutil.copyfile(shot, REPO / "docs" / file)
