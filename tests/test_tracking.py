"""The trackio sink: one worker thread, a bounded queue, faults contained; and the real trackio end to end."""

from __future__ import annotations

import enum
import importlib.util
import json
import logging
import os
import sqlite3
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

from guard.contract import RunResult
from guard.observe.tracking import TrackioSink, _RoutedStream, trainer_trackio_target, verdict_alert, verdict_report

ROOT = Path(__file__).resolve().parent.parent


class AlertLevel(str, enum.Enum):
    INFO = "info"
    WARN = "warn"
    ERROR = "error"


class FakeRun:
    def __init__(self, module: FakeTrackio, name: str | None) -> None:
        self.module, self.name = module, name or "generated-name"

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        self.module.record("log", dict(metrics), step)
        if self.module.fail_on_log is not None and step == self.module.fail_on_log:
            raise RuntimeError("database is locked")

    def alert(self, title: str, text: str | None = None, level: AlertLevel = AlertLevel.WARN,
              step: int | None = None) -> None:
        self.module.record("alert", title, text, level, step)


class Markdown:
    def __init__(self, text: str) -> None:
        self.text = text


class FakeTrackio:
    """The part of the ``trackio`` module the sink uses, recording each call and the thread it came from."""

    AlertLevel = AlertLevel
    Markdown = Markdown

    def __init__(self, *, init_error: Exception | None = None, fail_on_log: int | None = None,
                 gate: threading.Event | None = None) -> None:
        self.init_error, self.fail_on_log, self.gate = init_error, fail_on_log, gate
        self.calls: list[tuple[Any, ...]] = []
        self.threads: set[int] = set()
        self.init_kwargs: dict[str, Any] = {}
        self.done = threading.Event()

    def record(self, *call: Any) -> None:
        self.calls.append(call)
        self.threads.add(threading.get_ident())

    def init(self, project: str, name: str | None = None, space_id: str | None = None, config: Any = None,
             embed: bool = True, auto_log_gpu: bool | None = None, auto_log_cpu: bool | None = None) -> FakeRun:
        self.init_kwargs = {"project": project, "name": name, "space_id": space_id, "config": config,
                            "embed": embed, "auto_log_gpu": auto_log_gpu, "auto_log_cpu": auto_log_cpu}
        self.record("init", project)
        print(f"* Trackio project initialized: {project}")  # what trackio prints to stdout
        if self.gate is not None:
            self.gate.wait()
        if self.init_error is not None:
            raise self.init_error
        return FakeRun(self, name)

    def finish(self) -> None:
        self.record("finish")
        print("* Run finished. Uploading logs to Trackio (please wait...)")
        self.done.set()


def failed_result() -> RunResult:
    return RunResult("FAIL", "non_finite_loss", 4, 12.34, step=3, loss=float("nan"),
                     hint="lower the learning rate", extra={"rank": 0})


# ---------------------------------------------------------------------------------------------------------------
# Pure helpers
# ---------------------------------------------------------------------------------------------------------------


def test_verdict_report_and_alert_levels() -> None:
    report = verdict_report(failed_result())
    assert report.startswith("**FAIL** `non_finite_loss` (exit 4)")
    assert "`VERDICT: FAIL reason=non_finite_loss exit=4 elapsed=12.3 step=3" in report
    assert report.endswith("hint: lower the learning rate")
    title, text, level = verdict_alert(failed_result())
    assert (title, level) == ("VERDICT FAIL reason=non_finite_loss", "error")
    assert text.startswith("VERDICT: FAIL reason=non_finite_loss exit=4 elapsed=12.3 step=3")
    assert text.endswith("hint='lower the learning rate'") and "\n" not in text
    secured = RunResult("TIMEOUT", "deadline", 75, 100.0, extra={"secured": "yes"})
    unsecured = RunResult("INTERRUPTED", "signal", 143, 5.0, extra={"signal": "SIGTERM"})
    assert verdict_alert(secured)[2] == "error"  # the run did not finish: secured or not
    assert verdict_alert(unsecured)[2] == "error"
    assert verdict_alert(RunResult("PASS", "ok", 0, 1.0))[:3:2] == ("VERDICT PASS reason=ok", "info")


def test_trainer_trackio_target() -> None:
    assert trainer_trackio_target({"report_to": ["wandb"], "project": "p"}) is None
    assert trainer_trackio_target({"report_to": []}) is None
    assert trainer_trackio_target({"report_to": ["trackio"], "project": "llm", "run_name": "sft-1",
                                   "trackio_space_id": None}) == {
        "project": "llm", "run_name": "sft-1-guard", "space_id": None}
    assert trainer_trackio_target({"report_to": "trackio", "trackio_space_id": "acme/dash"}) == {
        "project": "huggingface", "run_name": None, "space_id": "acme/dash"}  # TrainingArguments' default project
    installed = importlib.util.find_spec("trackio") is not None
    assert (trainer_trackio_target({"report_to": ["all"]}) is not None) == installed


# ---------------------------------------------------------------------------------------------------------------
# The sink with a scripted trackio
# ---------------------------------------------------------------------------------------------------------------


def test_calls_run_in_order_on_one_worker_thread(capsys: pytest.CaptureFixture[str],
                                                 caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeTrackio()
    with caplog.at_level(logging.DEBUG, logger="guard.tracking"):
        sink = TrackioSink("proj", run_name="run-guard", module=fake, mask=lambda t: t.replace("hf_secret", "***"),
                           config={"command": "train.py"})
        sink.log({"loss": 2.5}, step=1)
        sink.log({"loss": 2.25, "note": "token hf_secret"}, step=2)
        sink.alert("slow", "it will not finish", "warn", step=2)
        print("the guard's own stdout still works")
        sink.finish(failed_result())
        sink.log({"loss": 1.0}, step=9)  # after finish: ignored
        assert sink.close(timeout_s=10) is True
    assert fake.init_kwargs == {"project": "proj", "name": "run-guard", "space_id": None,
                                "config": {"command": "train.py"}, "embed": False, "auto_log_gpu": False,
                                "auto_log_cpu": False}
    kinds = [call[0] for call in fake.calls]
    assert kinds == ["init", "log", "log", "alert", "log", "alert", "finish"]
    assert fake.calls[2] == ("log", {"loss": 2.25, "note": "token ***"}, 2)
    assert fake.calls[3] == ("alert", "slow", "it will not finish", AlertLevel.WARN, 2)
    report = fake.calls[4][1]["jobguard/verdict"]  # the verdict as text (a Markdown report), not as plots
    assert list(fake.calls[4][1]) == ["jobguard/verdict"] and fake.calls[4][2] == 3
    assert isinstance(report, Markdown) and report.text.startswith("**FAIL** `non_finite_loss` (exit 4)")
    assert fake.calls[5][3] is AlertLevel.ERROR
    assert fake.threads and threading.get_ident() not in fake.threads and len(fake.threads) == 1
    out = capsys.readouterr().out
    assert "the guard's own stdout still works" in out
    assert "Trackio" not in out  # trackio's prints went to the log, not to the guard's stdout
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert "trackio: * Trackio project initialized: proj" in debug
    assert not isinstance(sys.stdout, _RoutedStream) and not isinstance(sys.stderr, _RoutedStream)


def test_the_verdict_alert_is_masked_before_quoting() -> None:
    secret = "s3cr3t'value-123"  # a quote in the secret: masking after shlex.quote would miss it
    fake = FakeTrackio()
    sink = TrackioSink("proj", module=fake, mask=lambda t: t.replace(secret, "***"))
    sink.finish(RunResult("FAIL", "crash", 1, 2.0, hint=f"token {secret} rejected"))
    assert sink.close(timeout_s=10) is True
    [alert] = [c for c in fake.calls if c[0] == "alert"]
    assert "s3cr3t" not in alert[2] and "hint='token *** rejected'" in alert[2]


class WebhookTrackio(FakeTrackio):
    def init(self, project: str, name: str | None = None, space_id: str | None = None,  # type: ignore[override]
             config: Any = None, embed: bool = True, auto_log_gpu: bool | None = None,
             auto_log_cpu: bool | None = None, webhook_url: str | None = None,
             webhook_min_level: str | None = None) -> FakeRun:
        run = super().init(project, name, space_id, config, embed, auto_log_gpu, auto_log_cpu)
        self.init_kwargs.update(webhook_url=webhook_url, webhook_min_level=webhook_min_level)
        return run


def test_the_webhook_goes_to_trackio_init(caplog: pytest.LogCaptureFixture) -> None:
    fake = WebhookTrackio()
    sink = TrackioSink("jobguard", module=fake, webhook_url="http://127.0.0.1:9/h", webhook_min_level="warn")
    assert sink.close(timeout_s=10) is True
    assert fake.init_kwargs["webhook_url"] == "http://127.0.0.1:9/h"
    assert fake.init_kwargs["webhook_min_level"] == "warn"
    old = FakeTrackio()  # a trackio without webhooks: said once, the dashboard still gets the alerts
    with caplog.at_level(logging.WARNING, logger="guard.tracking"):
        sink = TrackioSink("jobguard", module=old, webhook_url="http://127.0.0.1:9/h")
        sink.alert("x", "y", "error", step=1)
        assert sink.close(timeout_s=10) is True
    assert "webhook_url" not in old.init_kwargs and [c[0] for c in old.calls] == ["init", "alert", "finish"]
    assert any("alerts reach the dashboard only" in r.getMessage() for r in caplog.records)


def test_a_trackio_that_raises_turns_the_sink_off(caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeTrackio(fail_on_log=2)
    with caplog.at_level(logging.WARNING, logger="guard.tracking"):
        sink = TrackioSink("proj", module=fake)
        for step in range(1, 6):
            sink.log({"loss": 1.0}, step=step)
        assert sink.close(timeout_s=10) is True
        sink.log({"loss": 1.0}, step=7)  # off: a no-op, no exception
        sink.alert("x")
    assert sink.error == "RuntimeError: database is locked"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["trackio reporting is off for this run: RuntimeError: database is locked "
                        "(the job is not affected)"]
    assert [c[2] for c in fake.calls if c[0] == "log"] == [1, 2]


def test_init_failure_and_missing_trackio(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeTrackio(init_error=ValueError("Invalid project name"))
    sink = TrackioSink("bad/name", module=fake)
    sink.log({"loss": 1.0}, step=1)
    assert sink.close(timeout_s=10) is True
    assert sink.error == "ValueError: Invalid project name"
    assert [c[0] for c in fake.calls] == ["init"]

    monkeypatch.setitem(sys.modules, "trackio", None)  # as if jobguard[trackio] were not installed
    missing = TrackioSink("proj")
    missing.log({"loss": 1.0}, step=1)
    assert missing.close(timeout_s=10) is True
    assert missing.error is not None
    assert missing.error.startswith("trackio cannot be imported") and "jobguard[trackio]" in missing.error


def test_a_stuck_trackio_never_blocks_the_caller() -> None:
    gate = threading.Event()
    fake = FakeTrackio(gate=gate)  # trackio.init hangs (a Space that does not answer)
    sink = TrackioSink("proj", module=fake, queue_size=100)
    caller_done = threading.Event()

    def caller() -> None:
        for step in range(1000):
            sink.log({"loss": 1.0}, step=step)
        caller_done.set()

    thread = threading.Thread(target=caller)
    thread.start()
    thread.join(30)  # a generous bound: the calls only append to a bounded queue
    assert caller_done.is_set()
    assert sink.dropped == 900
    assert sink.close(timeout_s=0.2) is False  # still stuck: close gives up, the guard goes on
    assert sink.dropped == 902  # finish and stop displaced the two oldest entries
    gate.set()  # trackio answers at last: the newest entries are written
    assert fake.done.wait(30)
    sink._thread.join(30)
    steps = [c[2] for c in fake.calls if c[0] == "log"]
    assert steps == list(range(902, 1000))


# ---------------------------------------------------------------------------------------------------------------
# The real trackio, in its own process (TRACKIO_DIR is read once, when trackio is imported)
# ---------------------------------------------------------------------------------------------------------------

E2E = textwrap.dedent("""
    import json, logging, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="[guard] %(message)s")
    from guard.observe.tracking import TrackioSink
    from guard.contract import RunResult

    sink = TrackioSink("guard-e2e", run_name="sft-guard", mask=lambda t: t.replace("s3cr3tvalue", "***"))
    for step in (1, 2, 3):
        sink.log({"loss": 3.0 - step / 10}, step=step)
    sink.log({"guard/steps_per_s": 2.5, "guard/gpu0_util_pct": 97, "guard/tree_rss_gib": 1.5}, step=3)
    sink.finish(RunResult("TIMEOUT", "deadline", 124, 61.0, step=3, loss=2.7, extra={"secured": "no"},
                          hint="raise --margin (token s3cr3tvalue)"))
    ok = sink.close(timeout_s=60)

    from trackio.sqlite_storage import SQLiteStorage
    logs = SQLiteStorage.get_logs("guard-e2e", "sft-guard")
    alerts = SQLiteStorage.get_alerts("guard-e2e", run_name="sft-guard")
    print(json.dumps({"ok": ok, "error": sink.error, "logs": logs, "alerts": alerts}, default=str))
""")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("trackio") is None, reason="trackio not installed (jobguard[trackio])")
def test_real_trackio_end_to_end(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACKIO_")}
    env.update(TRACKIO_DIR=str(tmp_path / "trackio"), HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1",
               HF_HUB_DISABLE_TELEMETRY="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", E2E], env=env, capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, done.stdout  # nothing but the script's own line on stdout: trackio's prints are routed
    data = json.loads(lines[0])
    assert data["ok"] is True and data["error"] is None
    losses = {row["step"]: row["loss"] for row in data["logs"] if "loss" in row}
    assert losses == {1: pytest.approx(2.9), 2: pytest.approx(2.8), 3: pytest.approx(2.7)}
    beat = next(row for row in data["logs"] if "guard/steps_per_s" in row)
    assert beat["step"] == 3 and beat["guard/gpu0_util_pct"] == 97
    verdict = next(row for row in data["logs"] if "jobguard/verdict" in row)
    assert verdict["step"] == 3 and not any(key.startswith("verdict/") for key in verdict)  # no plots
    assert verdict["jobguard/verdict"]["_type"] == "trackio.markdown"
    assert "VERDICT: TIMEOUT reason=deadline exit=124" in verdict["jobguard/verdict"]["_value"]
    [alert] = data["alerts"]
    assert alert["title"] == "VERDICT TIMEOUT reason=deadline" and alert["level"] == "error"
    assert "s3cr3tvalue" not in alert["text"] and "***" in alert["text"]
    # the same rows, read straight from the project's SQLite file where TRACKIO_DIR says
    db = tmp_path / "trackio" / "guard-e2e.db"
    with sqlite3.connect(db) as conn:
        runs = {row[0] for row in conn.execute("SELECT run_name FROM metrics")}
        n_alerts = conn.execute("SELECT COUNT(*) FROM alerts WHERE level = 'error'").fetchone()[0]
    assert runs == {"sft-guard"} and n_alerts == 1
    assert "trackio: logging to project guard-e2e, run sft-guard (local)" in done.stderr
