"""Unit tests of the alert policy (``guard.observe.alerts``): which events alert, at what level, once each."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from guard.core.state import Outcome, Progress
from guard.errors import UsageError
from guard.observe.alerts import Alerts, ThroughputWatch, WebhookWatch, compose
from guard.run.config import alert_webhook_url, resolve, webhook_secrets


class Recorder:
    def __init__(self) -> None:
        self.alerts: list[tuple[str, str | None, str, int | None]] = []

    def alert(self, title: str, text: str | None = None, level: str = "warn", step: int | None = None) -> None:
        self.alerts.append((title, text, level, step))


def make() -> tuple[Alerts, Recorder]:
    recorder = Recorder()
    return Alerts(lambda: recorder, throughput=ThroughputWatch(0.5, 100.0)), recorder


def test_compose() -> None:
    assert compose("loss nan", step=8, rank=1, hint="lower the lr") == "loss nan\nstep=8 rank=1\nhint: lower the lr"
    assert compose(None, step=None, rank=None) == ""
    assert compose("x", step=3, rank=None) == "x\nstep=3"


def test_non_finite_after_and_during_the_sanity_pass() -> None:
    alerts, rec = make()
    nan = Outcome("FAIL", "non_finite_loss", 4, hint="lower the learning rate", extra={"rank": 1})
    alerts.on_outcome(nan, Progress(step=12, loss=float("nan"), sanity_done=True), world_size=2)
    alerts.on_outcome(nan, Progress(step=12, loss=float("nan"), sanity_done=True), world_size=2)  # once
    [(title, text, level, step)] = rec.alerts
    assert (title, level, step) == ("non-finite loss nan at step 12", "error", 12)
    assert text is not None and "step=12 rank=1" in text and "hint: lower the learning rate" in text

    alerts, rec = make()
    alerts.on_outcome(Outcome("FAIL", "non_finite_loss", 4), Progress(step=2, loss=float("inf")), world_size=1)
    [(title, text, level, _)] = rec.alerts
    assert title == "sanity pass failed: non-finite loss inf at step 2" and level == "error"
    assert text is not None and "rank=0" in text  # one process: rank 0


def test_a_stall_names_the_rank_and_other_outcomes_are_left_to_the_verdict() -> None:
    alerts, rec = make()
    alerts.on_outcome(Outcome("FAIL", "stalled", 5, hint="py-spy dump", extra={"rank": 3}), Progress(step=40), 4)
    alerts.on_outcome(Outcome("TIMEOUT", "deadline", 75), Progress(step=41), 4)
    alerts.on_outcome(Outcome("PASS", "dry_run", 0), Progress(step=41), 4)
    assert [(t, lvl) for t, _, lvl, _ in rec.alerts] == [("rank 3 stalled after step 40", "error")]
    unknown, rec = make()
    unknown.on_outcome(Outcome("FAIL", "stalled", 5), Progress(step=None), world_size=2)
    assert rec.alerts[0][0] == "the job stalled before its first step"


def test_explosion_and_loss_rise_warn_once() -> None:
    alerts, rec = make()
    progress = Progress(step=30, loss=900.0)
    alerts.on_progress(1.0, progress)
    assert rec.alerts == []
    progress.exploded = {"step": 30, "loss": 900.0, "early": 2.0}
    alerts.on_progress(2.0, progress)
    alerts.on_progress(3.0, progress)
    progress.rose = {"since": 41, "step": 60, "loss": 70.0, "early": 2.0, "factor": 10.0,
                     "checkpoint": "/out/checkpoint-40", "checkpoint_step": 40}  # as the watchdog's rise check sets it
    alerts.on_progress(4.0, progress)
    alerts.on_progress(5.0, progress)
    assert [(t, lvl, s) for t, _, lvl, s in rec.alerts] == [("the loss exploded at step 30", "warn", 30),
                                                            ("the loss keeps rising (step 60)", "warn", 60)]
    assert "the last checkpoint before it: /out/checkpoint-40 (step 40)" in rec.alerts[1][1]
    assert alerts.warning("loss_rise", "again") is False  # the same kind through the hook: already said


def test_throughput_watch_fires_below_the_fraction_of_its_median() -> None:
    watch = ThroughputWatch(0.5, 100.0)  # buckets of 10 s
    step, now = 0, 0.0
    for _ in range(300):  # 300 s at 10 steps/s
        now += 1.0
        step += 10
        assert watch.add(now, step) is None
    drop = None
    for _ in range(150):  # then 3 steps/s
        now += 1.0
        step += 3
        drop = drop or watch.add(now, step)
    assert drop is not None and drop["rate"] < 5.0 and drop["median"] == pytest.approx(10.0)
    assert drop["window_s"] >= 100.0


def test_throughput_watch_quiet_when_steady_slow_at_first_or_off() -> None:
    watch, off = ThroughputWatch(0.5, 100.0), ThroughputWatch(0.0, 100.0)
    now = 0.0
    for step in range(1, 1000):
        now += 0.5 if step < 100 else 0.1  # slow warm-up, then faster: never below half the median
        assert watch.add(now, step) is None
        assert off.add(now, step) is None


def test_the_alert_of_a_throughput_drop(caplog: pytest.LogCaptureFixture) -> None:
    alerts, rec = make()
    now, step = 0.0, 0
    with caplog.at_level(logging.WARNING, logger="guard.alerts"):
        for i in range(500):
            now += 1.0
            step += 10 if i < 250 else 2
            alerts.on_rate(now, step)
    [(title, text, level, _)] = rec.alerts
    assert title.startswith("throughput dropped to ") and level == "warn"
    assert text is not None and "under 0.5x the run's median 10 steps/s" in text
    # in the guard's own log too, once, at WARNING (issue 36: it was at DEBUG only)
    [record] = [r for r in caplog.records if "throughput dropped" in r.getMessage()]
    assert record.levelno == logging.WARNING and "TORCH_LOGS=recompiles" in record.getMessage()


def push(kind: str, step: int | None, ok: bool, *, error: str | None = None, killed: bool = False,
         pushed: str | None = "hf://acme/run@abc123", running: bool = False, rewritten: bool = False
         ) -> SimpleNamespace:
    """A push as ``Plan.report()`` shows it (``secure.plan.PushView``)."""
    return SimpleNamespace(kind=kind, step=step, path=f"/out/checkpoint-{step}" if step is not None else None,
                           running=running, ok=ok and not running, killed=killed,
                           pushed=pushed if ok and not running else None, destination="hf://acme/run",
                           error=error, hint=None, rewritten=rewritten)


def test_pushes_refused_because_the_job_saved_over_them_are_not_failing_pushes() -> None:
    # a loop that saves ckpt.pt in place: each push the next save overtook is refused, and the newer one secured
    alerts, rec = make()
    plan: Any = FakePlan(trigger=None, state=SimpleNamespace(name="WATCHING"), history=[], secured=None)
    for step in (10, 20, 30):
        plan.history.append(push("background", step, False, rewritten=True,
                                 error=f"cannot secure checkpoint step {step}: out/ckpt.pt was rewritten"))
        alerts.on_securing(plan, step + 1)
    assert rec.alerts == []
    plan.history.append(push("background", 40, False, error="HTTP 500 from the Hub"))
    plan.history.append(push("background", 50, False, error="HTTP 503 from the Hub"))
    alerts.on_securing(plan, 51)
    assert [t for t, _, _, _ in rec.alerts] == ["pushes keep failing"]  # two real failures in a row still warn


class FakePlan(SimpleNamespace):
    """What ``Alerts.on_securing`` reads: ``report()`` (here the fake itself; a destination unless
    ``has_pusher=False``)."""

    has_pusher = True
    non_finite_from_step: int | None = None
    suspect_from_step: int | None = None

    def report(self) -> FakePlan:
        return self


def test_a_revoked_push_is_not_secured_and_a_refused_suspect_push_is_no_network_failure() -> None:
    """Issue 33: alerts called a later-revoked push "secured" and refused suspect pushes network failures."""
    alerts, rec = make()
    plan: Any = FakePlan(trigger=None, state=SimpleNamespace(name="WATCHING"), history=[], secured=None)
    plan.history.append(push("background", 100, True))
    alerts.on_securing(plan, 101)
    plan.non_finite_from_step = 107
    plan.history.append(push("background", 108, True))  # pushed before the window's NaN was read: not secured
    plan.history.append(push("background", 110, False, error="cannot secure checkpoint step 110: /out/ckpt.pt is "
                             "marked suspect (saved after the first non-finite loss): never pushed"))
    plan.history.append(push("background", 120, False, error="HTTP 503 from the Hub"))
    alerts.on_securing(plan, 121)
    assert [t for t, _, _, _ in rec.alerts] == ["checkpoint secured: step 100"]  # one 503 alone: no warning
    plan.non_finite_from_step = 90  # a witness read late: the step-100 push no longer counts
    alerts.on_securing(plan, 122)
    assert [(t, lvl) for t, _, lvl, _ in rec.alerts][1:] == [
        ("checkpoint of step 100 no longer counts as secured", "warn")]


def test_the_push_of_the_save_whose_weights_gave_the_nan_is_revoked() -> None:
    # a NaN loss at step 101 came from the weights saved at step 100: the plan's suspects start at step 100
    alerts, rec = make()
    plan: Any = FakePlan(trigger=None, state=SimpleNamespace(name="WATCHING"), history=[], secured=None)
    plan.history.append(push("background", 100, True))
    alerts.on_securing(plan, 101)
    plan.non_finite_from_step, plan.suspect_from_step = 101, 100
    alerts.on_securing(plan, 102)
    assert [(t, (b or "").split("\n")[0]) for t, b, _, _ in rec.alerts][1:] == [
        ("checkpoint of step 100 no longer counts as secured",
         "it was saved at or after step 100 (the first non-finite loss: step 101)")], rec.alerts


def test_a_record_the_store_could_not_move_back_is_not_a_failing_push() -> None:
    """A taint reached the recorded step 100: the store keeps no older copy to move back to (its restore fails,
    the good checkpoint is pushed again instead). That is no network failure: with the one real 503 after it, no
    "pushes keep failing" warning."""
    alerts, rec = make()
    plan: Any = FakePlan(trigger=None, state=SimpleNamespace(name="WATCHING"), history=[], secured=None)
    plan.history.append(push("restore", 90, False, error="restoring checkpoint step 90: keeps no copy aside"))
    plan.history.append(push("background", 90, False, error="HTTP 503 from the Hub"))
    alerts.on_securing(plan, 101)
    assert rec.alerts == []


def test_securing_started_secured_checkpoints_and_failing_pushes() -> None:
    alerts, rec = make()
    plan: Any = FakePlan(trigger=None, state=SimpleNamespace(name="WATCHING"), history=[], secured=None)
    alerts.on_securing(plan, 10)
    assert rec.alerts == []
    plan.history.append(push("background", 100, True))
    plan.history.append(push("background", 200, True, running=True))  # still running: not reported yet
    plan.secured = plan.history[0]
    alerts.on_securing(plan, 150)
    assert rec.alerts[-1][:3] == ("checkpoint secured: step 100",
                                  "checkpoint-100 at hf://acme/run@abc123\nstep=100", "info")
    assert alerts.secured_step == 100
    plan.history[1] = push("background", 200, False, error="HTTP 500 from the Hub")
    plan.history.append(push("background", 300, False, error="HTTP 503 from the Hub"))
    plan.trigger, plan.state = "deadline", SimpleNamespace(name="SECURING")
    alerts.on_securing(plan, 320)
    alerts.on_securing(plan, 321)
    titles = [(t, lvl) for t, _, lvl, _ in rec.alerts]
    assert titles[1:] == [("securing started: the deadline is near", "info"), ("pushes keep failing", "warn")]
    plan.history.append(push("securing", 320, False, error="429 Too Many Requests (attempts: 429; 429)"))
    plan.history.append(push("securing", 320, False, killed=True, error="killed"))
    plan.history.append(push("final", None, True, pushed="hf://acme/run@def456"))
    alerts.on_securing(plan, 330)
    assert [(t, lvl) for t, _, lvl, _ in rec.alerts][3:] == [("pushes are rate-limited by the destination", "warn"),
                                                              ("final model secured", "info")]


def test_no_destination_no_securing_alert() -> None:
    alerts, rec = make()
    plan = FakePlan(trigger="deadline", state=SimpleNamespace(name="AWAITING_SAVE"), secured=None,
                    history=[], has_pusher=False)
    alerts.on_securing(plan, 5)
    assert rec.alerts == []


def test_a_failing_push_with_retries_inside_counts_as_repeated() -> None:
    alerts, rec = make()
    plan = FakePlan(trigger="signal", state=SimpleNamespace(name="AWAITING_SAVE"), secured=None,
                    history=[push("securing", 5, False, error="push failed (attempts: timeout; timeout)")])
    alerts.on_securing(plan, 5)
    assert [t for t, _, _, _ in rec.alerts] == ["securing started: a termination signal arrived",
                                                "pushes keep failing"]


def test_the_webhook_watch_logs_once_counts_all_and_hides_the_url(caplog: pytest.LogCaptureFixture) -> None:
    url = "https://hooks.slack.com/services/T000/B000/XXXXSECRET"
    watch = WebhookWatch(url, mask=lambda text: text.replace("XXXXSECRET", "***")).install()
    trackio_log = logging.getLogger("trackio.alerts")
    try:
        assert trackio_log.propagate is False
        with caplog.at_level(logging.WARNING, logger="guard.alerts"):
            for _ in range(3):
                trackio_log.warning(f"Failed to send webhook to {url}: <urlopen error timed out>")
        assert watch.failures == 3
        said = [r.getMessage() for r in caplog.records if r.name == "guard.alerts"]
        assert said == ["the alert webhook did not take an alert: <urlopen error timed out> (later failures are "
                        "only counted; the job is not affected)"]
        assert all("XXXXSECRET" not in r.getMessage() for r in caplog.records if r.name == "guard.alerts")
    finally:
        watch.uninstall()
    assert trackio_log.propagate is True and watch not in trackio_log.handlers


def test_the_alert_options() -> None:
    values, sources = resolve({"alert_level": "WARN"}, {"GUARD_ALERT_WEBHOOK": "https://example.org/h",
                                                        "GUARD_ALERT_THROUGHPUT_DROP": "0.3"})
    assert values["alert_level"] == "warn" and values["alert_webhook"] == "https://example.org/h"
    assert sources["alert_webhook"] == "env" and values["alert_throughput_drop"] == 0.3
    assert values["alert_throughput_window"] == 300.0
    defaults, _ = resolve({}, {})
    assert defaults["alert_level"] == "info" and defaults["alert_throughput_drop"] == 0.5
    assert alert_webhook_url(defaults["alert_webhook"], {"TRACKIO_WEBHOOK_URL": "https://t.example/x"}) == (
        "https://t.example/x", "TRACKIO_WEBHOOK_URL")
    assert alert_webhook_url(values["alert_webhook"], {"TRACKIO_WEBHOOK_URL": "https://t.example/x"})[1] == \
        "--alert-webhook"
    assert alert_webhook_url(defaults["alert_webhook"], {}) == (None, "")
    with pytest.raises(UsageError, match="accepted: info, warn, error"):
        resolve({"alert_level": "loud"}, {})
    with pytest.raises(UsageError, match="fraction"):
        resolve({"alert_throughput_drop": "1.5"}, {})
    assert webhook_secrets(["--alert-webhook", "https://a/1", "--alert-webhook=https://b/2", "x.py"],
                           {"TRACKIO_WEBHOOK_URL": "https://c/3"}) == ["https://a/1", "https://b/2", "https://c/3"]
