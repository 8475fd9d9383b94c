"""Alerts: the events that change what a person should do, each sent once, to the run's trackio alerts (the
dashboard's "Alerts & Reports" page) and, with ``--alert-webhook URL``, through trackio to Slack, Discord or any
URL that takes JSON.

========================================  =====  =============================================================
event                                     level  from
========================================  =====  =============================================================
non-finite loss (after the sanity pass)   error  the watchdog's ``non_finite_loss`` decision
sanity pass failed (a non-finite loss)    error  the same, before ``--sanity-steps`` finite losses
stall, naming the stalled rank            error  the watchdog's ``stalled`` decision
sustained loss rise                       warn   ``Progress.loss_rise`` (the watchdog), or :meth:`Alerts.warning`
finite loss explosion                     warn   ``Progress.exploded`` (the watchdog)
throughput drop                           warn   :class:`ThroughputWatch`
securing started (deadline, signal)       info   the securing plan's ``trigger``
checkpoint secured (step, destination)    info   each verified push in the plan's ``history``
push failing repeatedly, or rate-limited  warn   failed pushes in the plan's ``history``
the VERDICT                               info   PASS; ``error`` otherwise (``tracking.verdict_alert``)
========================================  =====  =============================================================

Each alert's text ends with ``step=N rank=R`` (those known) and the hint. The throughput drop: after two
windows of steps, the step rate over the last ``--alert-throughput-window`` (default 300 s) is below
``--alert-throughput-drop`` (default 0.5) times the median of the run's own rates (each measured over a tenth of
the window).

Nothing here waits: :meth:`Alerts.send` appends to the tracker's queue (``tracking.TrackioSink``: one thread makes
every trackio call), trackio POSTs each alert from its own daemon thread with a 10 s timeout, and at the end
:func:`wait_for_webhooks` gives the POSTs still in flight at most 0.3 s before the VERDICT and, silently, at most
2 s more after it (``guard.run.cli``: nothing is written after the VERDICT). A failing webhook is
logged once (masked, without its URL) and counted (:class:`WebhookWatch`).

Facts used (trackio 0.43.0, ``trackio/run.py`` ``Run.alert`` and ``trackio/alerts.py`` ``send_webhook``): each
POST runs on a ``threading.Thread(target=send_webhook, daemon=True)`` (so its name ends in ``(send_webhook)``,
Python 3.10+), and a failure is ``logger.warning(f"Failed to send webhook to {url}: {e}")`` on the
``trackio.alerts`` logger.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from guard.core.durations import step_text

__all__ = ["AFTER_VERDICT_WAIT_S", "LEVELS", "AlertTracker", "Alerts", "ThroughputWatch", "WebhookWatch", "compose",
           "require_trackio", "wait_for_webhooks"]

log = logging.getLogger("guard.alerts")

LEVELS = ("info", "warn", "error")
WEBHOOK_WAIT_S = 0.3  # at the end: the most the VERDICT waits for alert POSTs still in flight
AFTER_VERDICT_WAIT_S = 2.0  # then, after the VERDICT, the most the guard's exit waits for them (silently)
_RATE_LIMITED = re.compile(r"\b429\b|rate.?limit|too many requests", re.IGNORECASE)
_ATTEMPTS = re.compile(r"\(attempts: (.*)\)")
_SUSPECT = re.compile(r"marked suspect|saved after the first non-finite loss")  # a refusal, not the network


class AlertTracker(Protocol):
    """What alerts go to: ``tracking.TrackioSink`` (or a stand-in)."""

    def alert(self, title: str, text: str | None = None, level: str = "warn", step: int | None = None) -> None:
        """Queue an alert; never blocks."""


def require_trackio(url: str | None, source: str) -> None:
    """A webhook needs trackio in the guard's own environment.

    Raises:
        PreflightError: ``url`` is set (from ``source``: ``--alert-webhook`` or ``GUARD_ALERT_WEBHOOK``) and
            ``trackio`` cannot be found (check ``tracking``, hint: the ``jobguard[trackio]`` extra).
    """
    if not url:
        return
    try:
        spec = importlib.util.find_spec("trackio")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        from guard.errors import PreflightError

        raise PreflightError(f"{source} needs trackio, which is not installed where the guard runs",
                             check="tracking", hint="pip install 'jobguard[trackio]' (or drop the webhook option)")


def compose(text: str | None, *, step: int | None, rank: int | None, hint: str | None = None) -> str:
    """An alert's text: ``text``, then ``step=N rank=R`` (each only when known), then ``hint: ...``."""
    parts = [text] if text else []
    where = " ".join(f"{key}={value}" for key, value in (("step", step), ("rank", rank)) if value is not None)
    if where:
        parts.append(where)
    if hint:
        parts.append(f"hint: {hint}")
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------------------------
# Throughput
# ---------------------------------------------------------------------------------------------------------------


class ThroughputWatch:
    """The step rate against the run's own median.

    Steps are cut into buckets of ``window_s / 10``; each closed bucket's rate (steps per second) joins the run's
    history. When a bucket closes and the history holds at least two windows, the rate over the last ``window_s``
    is compared with ``fraction`` times the history's median.

    Args:
        fraction: the drop threshold, 0 < fraction < 1; 0 turns the watch off.
        window_s: the window (seconds, > 0).
    """

    BUCKETS_PER_WINDOW = 10
    HISTORY = 10_000  # bucket rates kept (at 30 s a bucket: over 3 days)

    def __init__(self, fraction: float, window_s: float) -> None:
        self.fraction, self.window_s = fraction, max(window_s, 1e-3)
        self.bucket_s = self.window_s / self.BUCKETS_PER_WINDOW
        self.rates: deque[float] = deque(maxlen=self.HISTORY)
        self.points: deque[tuple[float, int]] = deque()
        self._bucket: tuple[float, int] | None = None

    def add(self, now: float, step: int) -> dict[str, float] | None:
        """A training step at ``now`` (monotonic seconds). Returns ``{"rate", "median", "window_s"}`` (steps per
        second) when the window's rate is below the threshold, else None."""
        if self.fraction <= 0:
            return None
        self.points.append((now, step))
        while len(self.points) > 1 and self.points[1][0] <= now - self.window_s:
            self.points.popleft()
        if self._bucket is None:
            self._bucket = (now, step)
            return None
        start, first = self._bucket
        if now - start < self.bucket_s:
            return None
        self.rates.append((step - first) / (now - start))
        self._bucket = (now, step)
        if len(self.rates) < 2 * self.BUCKETS_PER_WINDOW:
            return None
        anchor_t, anchor_step = self.points[0]
        if now - anchor_t < self.window_s:
            return None
        rate = (step - anchor_step) / (now - anchor_t)
        import statistics  # at the first comparison, not at start-up (with fractions and decimal, 5 ms)

        median = statistics.median(self.rates)
        if median > 0 and rate < self.fraction * median:
            return {"rate": rate, "median": median, "window_s": now - anchor_t}
        return None


# ---------------------------------------------------------------------------------------------------------------
# The webhook's failures and the POSTs in flight
# ---------------------------------------------------------------------------------------------------------------


class WebhookWatch(logging.Handler):
    """Counts trackio's failed webhook POSTs and logs the first one, masked and without the URL.

    Installed on the ``trackio.alerts`` logger with ``propagate`` off, so that trackio's own warning (which quotes
    the URL, a credential for Slack and Discord) never reaches the guard's output.

    Args:
        url: the webhook URL (cut out of the logged reason).
        mask: the guard's masker (``Masker.mask_text``).
    """

    def __init__(self, url: str, mask: Callable[[str], str] = lambda text: text) -> None:
        super().__init__(logging.WARNING)
        self.url, self.mask = url, mask
        self.failures = 0
        self.quiet = False  # after the VERDICT: count, never log
        self._lock_count = threading.Lock()
        self._logger = logging.getLogger("trackio.alerts")
        self._propagate = self._logger.propagate

    def install(self) -> WebhookWatch:
        self._logger.addHandler(self)
        self._logger.propagate = False
        return self

    def uninstall(self) -> None:
        self._logger.removeHandler(self)
        self._logger.propagate = self._propagate

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record from a library
            return
        if "webhook" not in message.lower():
            return
        with self._lock_count:
            self.failures += 1
            first = self.failures == 1
        if first and not self.quiet:
            reason = message.split(f"{self.url}: ", 1)[-1] if self.url in message else message
            log.warning("the alert webhook did not take an alert: %s (later failures are only counted; the job "
                        "is not affected)", self.mask(reason.replace(self.url, "<webhook>")))


def wait_for_webhooks(timeout_s: float = WEBHOOK_WAIT_S) -> int:
    """Wait at most ``timeout_s`` for trackio's webhook POSTs still in flight; returns how many are left (daemon
    threads: they end with the guard)."""
    end = time.monotonic() + max(0.0, timeout_s)
    left = [t for t in threading.enumerate() if t.name.endswith("(send_webhook)") and t.is_alive()]
    for thread in left:
        thread.join(max(0.0, end - time.monotonic()))
    return sum(t.is_alive() for t in left)


# ---------------------------------------------------------------------------------------------------------------
# The alerts
# ---------------------------------------------------------------------------------------------------------------


class Alerts:
    """Turns the guard's events into alerts, each once (see the module docstring for the table).

    Args:
        tracker: returns where alerts go now (the heartbeat's tracker: it may appear later, when the Trainer's
            trackio project is learnt), or None.
        throughput: the throughput-drop watch, or None (off).
        webhook: the webhook's failure counter, or None without a webhook.

    Attributes:
        sent: ``(level, title)`` of every alert sent, in order (the verdict's is the tracker's own).
        secured_step: the newest secured checkpoint's step, or None.
    """

    def __init__(self, tracker: Callable[[], AlertTracker | None], *, throughput: ThroughputWatch | None = None,
                 webhook: WebhookWatch | None = None) -> None:
        self.tracker = tracker
        self.throughput = throughput
        self.webhook = webhook
        self.sent: list[tuple[str, str]] = []
        self.secured_step: int | None = None
        self._keys: set[str] = set()
        self._next_record = 0
        self._failed_in_a_row = 0
        self._alerted: set[int] = set()  # steps alerted as secured

    # -- sending -----------------------------------------------------------------------------------------------

    def send(self, key: str, level: str, title: str, text: str | None = None, *, step: int | None = None,
             rank: int | None = None, hint: str | None = None) -> bool:
        """Send one alert unless ``key`` was sent before; True when sent. Never blocks, never raises."""
        if key in self._keys:
            return False
        self._keys.add(key)
        self.sent.append((level, title))
        log.debug("alert (%s): %s", level, title)
        tracker = self.tracker()
        if tracker is not None:
            try:
                tracker.alert(title, compose(text, step=step, rank=rank, hint=hint), level, step=step)
            except Exception as exc:  # noqa: BLE001 - an alert must never reach the guard's loop
                log.debug("alert dropped: %r", exc)
        return True

    def warning(self, kind: str, title: str, text: str | None = None, *, step: int | None = None,
                rank: int | None = None, hint: str | None = None) -> bool:
        """The hook for a detection that warns without ending the run (a sustained loss rise, ...): one ``warn``
        alert per ``kind``."""
        return self.send(f"warn:{kind}", "warn", title, text, step=step, rank=rank, hint=hint)

    # -- the guard's events ------------------------------------------------------------------------------------

    def on_outcome(self, outcome: Any, progress: Any, world_size: int = 1) -> None:
        """The guard's decision (``state.Outcome``) with the run's ``state.Progress``: the non-finite loss, the
        failed sanity pass and the stall are ``error`` alerts; the rest is said by the securing and the VERDICT
        alerts."""
        rank = outcome.extra.get("rank")
        if rank is None and world_size <= 1:
            rank = 0  # one process: rank 0
        step = progress.step
        if outcome.reason == "non_finite_loss":
            loss = progress.loss
            what = f"non-finite loss {loss} at step {step}" if loss is not None else f"non-finite loss at step {step}"
            if not progress.sanity_done:
                self.send("sanity", "error", f"sanity pass failed: {what}",
                          f"the first --sanity-steps losses must be finite; {what}", step=step, rank=rank,
                          hint=outcome.hint)
            else:
                self.send("non_finite", "error", what, "the guard stops the job", step=step, rank=rank,
                          hint=outcome.hint)
        elif outcome.reason == "stalled":
            who = f"rank {rank}" if rank is not None else "the job"
            when = f"after step {step}" if step is not None else "before its first step"
            self.send("stalled", "error", f"{who} stalled {when}",
                      "no training step within --stall-timeout", step=step, rank=rank, hint=outcome.hint)

    def on_progress(self, now: float, progress: Any) -> None:
        """After a counted step: the finite explosion and the sustained loss rise the watchdog noted."""
        exploded = progress.exploded
        if exploded is not None:
            self.warning("explosion", f"the loss exploded at step {exploded.get('step')}",
                         f"loss {exploded.get('loss'):.6g}, its early level {exploded.get('early'):.4g}",
                         step=exploded.get("step"), rank=exploded.get("rank"),
                         hint="lower the learning rate, add warmup or clip gradients")
        rise = progress.rose  # core.state.Progress.rose: set once by the watchdog's sustained-rise check
        if rise is not None:
            back = (f"; the last checkpoint before it: {rise['checkpoint']} (step {rise['checkpoint_step']})"
                    if rise.get("checkpoint") else "; no checkpoint was saved before it")
            self.warning("loss_rise", f"the loss keeps rising (step {rise.get('step')})",
                         f"above {rise.get('factor'):g}x its early level {rise.get('early'):.4g} since step "
                         f"{rise.get('since')}, now {rise.get('loss'):.6g}{back}", step=rise.get("step"),
                         hint="lower the learning rate or check the data order, and resume from the checkpoint "
                              "before the rise")

    def on_rate(self, now: float, step: int) -> None:
        """A training step for the throughput watch."""
        if self.throughput is None:
            return
        drop = self.throughput.add(now, step)
        if drop is not None:
            title = f"throughput dropped to {drop['rate']:.3g} steps/s"
            text = (f"over the last {drop['window_s']:.0f}s, under {self.throughput.fraction:g}x the run's median "
                    f"{drop['median']:.3g} steps/s")
            hint = ("look for a slow data loader, a throttled GPU, a full disk, another job on the node, or "
                    "torch.compile recompiling (TORCH_LOGS=recompiles)")
            if self.warning("throughput", title, text, step=step, hint=hint):
                # in the guard's own log too, not only in trackio or a webhook (vllm #27178: a step 5-8x slower after
                # dynamo's recompile limit went unseen)
                log.warning("%s at step %d (%s): %s", title, step, text, hint)

    def on_securing(self, plan: Any, step: int | None) -> None:
        """Poll the securing plan's snapshot (``secure.plan.Plan.report()``): securing started for the deadline or a
        signal (with a destination: ``has_pusher``), each checkpoint secured, and failing or rate-limited pushes."""
        report = plan.report()
        trigger = report.trigger
        started = getattr(report.state, "name", "WATCHING") != "WATCHING"
        if trigger in ("deadline", "signal") and started and report.has_pusher:
            why = "the deadline is near" if trigger == "deadline" else "a termination signal arrived"
            self.send(f"securing:{trigger}", "info", f"securing started: {why}",
                      "the guard secures the newest checkpoint before the job is stopped", step=step)
        history = report.history
        bad = report.non_finite_from_step
        bad_from = report.suspect_from_step if report.suspect_from_step is not None else bad
        while self._next_record < len(history) and not history[self._next_record].running:
            view = history[self._next_record]
            self._next_record += 1
            self._on_push(view, bad_from)
        if bad_from is not None:
            for at in sorted(s for s in self._alerted if s >= bad_from):
                self.send(f"revoked:{at}", "warn", f"checkpoint of step {at} no longer counts as secured",
                          f"it was saved at or after step {bad_from} (the first non-finite loss: step {bad})", step=at,
                          hint="resume from the checkpoint the VERDICT names")
        secured = report.secured
        if secured is not None and secured.step is not None:
            self.secured_step = int(secured.step)

    def _on_push(self, view: Any, bad_from: int | None = None) -> None:
        """One push that is over (``secure.plan.PushView``); ``bad_from``: the first non-finite step heard of (a
        push of a save at or after it is neither secured nor a failure of the destination)."""
        at = view.step
        suspect = bad_from is not None and at is not None and at >= bad_from
        if view.ok:
            self._failed_in_a_row = 0
            where = view.pushed or view.destination
            if view.kind == "final":
                self.send(f"final:{where}", "info", "final model secured", f"at {where}")
            elif not suspect:
                name = os.path.basename(os.path.normpath(str(view.path))) if view.path else "checkpoint"
                if self.send(f"secured:{at}:{where}", "info", f"checkpoint secured: {step_text(at)}",
                             f"{name} at {where}", step=at) and at is not None:
                    self._alerted.add(int(at))
            return
        if view.killed or view.kind == "resumed" or view.rewritten:  # a newer save of the job's replaced it
            return
        if view.kind == "restore":  # the store could not move its record back: the good checkpoint is pushed again
            return
        if suspect or _SUSPECT.search(str(view.error or "")):  # refused: saved after the non-finite loss
            return
        self._failed_in_a_row += 1
        error = str(view.error or "")
        attempts = _ATTEMPTS.search(error)
        tries = len(attempts.group(1).split("; ")) if attempts else 1
        if _RATE_LIMITED.search(error):
            self.send("push:rate_limited", "warn", "pushes are rate-limited by the destination", error, step=at,
                      hint="raise --push-interval (the Hub limits commits per hour)")
        elif self._failed_in_a_row >= 2 or tries >= 2:
            self.send("push:failing", "warn", "pushes keep failing", error, step=at,
                      hint=view.hint or "check the network, the token and the destination")

    def close(self, timeout_s: float = WEBHOOK_WAIT_S) -> None:
        """At the end (after the tracker took the verdict): wait at most ``timeout_s`` for POSTs in flight and
        report the webhook's failures; from then on its watch counts silently (the guard's exit may still wait
        :data:`AFTER_VERDICT_WAIT_S` for them, after the VERDICT, when nothing more is written)."""
        if self.webhook is None:
            return
        left = wait_for_webhooks(timeout_s)
        if left:
            log.warning("%d alert POST(s) still unanswered after %.1fs: the VERDICT does not wait for them (the "
                        "guard's exit waits up to %.0fs more)", left, timeout_s, AFTER_VERDICT_WAIT_S)
        if self.webhook.failures:
            log.warning("the alert webhook failed %d time(s) in this run", self.webhook.failures)
        self.webhook.quiet = True
