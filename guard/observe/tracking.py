"""Reporting the run to trackio (the optional extra ``jobguard[trackio]``), off the job's path.

:class:`TrackioSink` imports ``trackio`` on its own daemon thread and makes every trackio call there, fed by a
bounded queue: ``log``, ``alert`` and ``finish`` only append to that queue and return at once; when the queue is
full the oldest entry is dropped (and counted). The first exception from trackio is logged once and turns the
sink off; nothing ever raises into the caller. ``close`` waits a bounded time.

Facts used (trackio 0.43.0, ``trackio/__init__.py``, ``trackio/run.py``, ``trackio/utils.py``;
``shared/reference/platform.md`` section 3):

- ``trackio.init(project, name=None, space_id=None, config=None, embed=True, auto_log_gpu=None,
  auto_log_cpu=None, ...) -> Run``; ``Run.log(metrics, step)``, ``Run.alert(title, text, level, step)`` with
  ``trackio.AlertLevel`` ``"info"|"warn"|"error"``; ``trackio.finish()`` finishes the thread's current run
  (the current run is a ``contextvars`` value, so all calls stay on one thread). ``auto_log_gpu``/``auto_log_cpu``
  are passed ``False``: the guard samples NVML and memory itself.
- Alerts: ``Run.alert`` prints the alert, stores it in the run (the dashboard's "Alerts & Reports" page) and,
  with ``trackio.init(webhook_url=URL, webhook_min_level=LEVEL)`` (else ``TRACKIO_WEBHOOK_URL`` and
  ``TRACKIO_WEBHOOK_MIN_LEVEL``), POSTs it from a new daemon thread (``trackio.alerts.send_webhook``, a 10 s
  ``urlopen`` timeout; a failure is logged on the ``trackio.alerts`` logger, never raised). Slack URLs
  (``hooks.slack.com``) get Block Kit ``blocks``, Discord URLs (``discord.com/api/webhooks``) an ``embeds`` entry,
  any other URL ``{"level", "title", "text", "project", "run", "step", "timestamp"}``.
- ``trackio.Markdown(text)`` logged as a metric is a report: the same page shows its text.
- Local-first: with no ``space_id`` (and no ``TRACKIO_SPACE_ID``/``TRACKIO_SERVER_URL`` in the environment, which
  trackio reads) everything goes to SQLite at ``$TRACKIO_DIR/<project>.db`` (default ``$HF_HOME/trackio``),
  no network. ``TRACKIO_DIR`` is read once, when trackio is first imported.
- trackio ``print``s to stdout (``* Trackio project initialized``, alerts, ``* Run finished``); the guard's stdout
  must end with its VERDICT line, so what the sink's thread writes to ``sys.stdout``/``sys.stderr`` is routed to
  the ``guard.observe.tracking`` debug log instead.
- A Trainer reporting to trackio (``report_to`` holds ``"trackio"``) logs into ``TrainingArguments.project``
  (default ``"huggingface"``) and ``trackio_space_id``: trackio itself has no environment variable for the
  project (see :func:`trainer_trackio_target`).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import re
import sys
import threading
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from guard.contract import RunResult, render_line

__all__ = ["VERDICT_REPORT", "TrackioSink", "trainer_trackio_target", "verdict_alert", "verdict_report"]

log = logging.getLogger("guard.tracking")

QUEUE_SIZE = 4096
VERDICT_REPORT = "jobguard/verdict"  # the key of the verdict's Markdown report on the dashboard
_STOP = ("stop", None)


def trainer_trackio_target(config: Mapping[str, Any]) -> dict[str, str | None] | None:
    """Where a Trainer's own trackio logging goes, from the ``trainer_config`` the agent sends.

    Needs ``report_to``, ``project``, ``run_name`` and ``trackio_space_id`` among the fields the agent sends
    (``protocol.TRAINER_FIELDS``). ``report_to`` ``"all"`` counts when trackio is installed.

    Returns:
        ``{"project", "run_name", "space_id"}`` for the guard's own run beside the job's (``run_name`` is the
        job's run name plus ``-guard``, or None), or None when the Trainer does not report to trackio.
    """
    report_to = config.get("report_to") or []
    if isinstance(report_to, str):
        report_to = [report_to]
    names = {str(name).lower() for name in report_to}
    if "trackio" not in names and not ("all" in names and importlib.util.find_spec("trackio") is not None):
        return None
    run_name = config.get("run_name")
    return {"project": str(config.get("project") or "huggingface"),
            "run_name": f"{run_name}-guard" if run_name else None,
            "space_id": str(config["trackio_space_id"]) if config.get("trackio_space_id") else None}


class _MaskText:
    """Adapts a ``str -> str`` masking function to what ``verdict.render_line`` takes (``mask_text``)."""

    def __init__(self, mask: Callable[[str], str]) -> None:
        self.mask_text = mask


def verdict_report(result: RunResult, mask: Callable[[str], str] | None = None) -> str:
    """The verdict as the Markdown text of the dashboard's ``jobguard/verdict`` report: the VERDICT line (each
    value masked with ``mask`` before it is quoted), then the hint. Text, not plots."""
    line = render_line(result, _MaskText(mask) if mask else None)
    text = f"**{result.status}** `{result.reason}` (exit {result.exit_code})\n\n`{line}`"
    if result.hint:
        text += f"\n\nhint: {mask(result.hint) if mask else result.hint}"
    return text


def verdict_alert(result: RunResult, mask: Callable[[str], str] | None = None) -> tuple[str, str, str]:
    """``(title, text, level)`` of the verdict's alert: ``info`` for PASS, ``error`` for FAIL, TIMEOUT and
    INTERRUPTED (secured or not: the run did not finish). The text is the VERDICT line (its ``hint=`` included),
    values masked with ``mask``."""
    level = "info" if result.status == "PASS" else "error"
    text = render_line(result, _MaskText(mask) if mask else None)
    return f"VERDICT {result.status} reason={result.reason}", text, level


# ---------------------------------------------------------------------------------------------------------------
# What the sink's thread prints goes to the log, not to the guard's stdout
# ---------------------------------------------------------------------------------------------------------------

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_routed: set[int] = set()
_routed_lock = threading.Lock()
_in_write = threading.local()  # a log handler that writes to sys.stderr itself must not loop back here


class _RoutedStream:
    """A stand-in for ``sys.stdout``/``sys.stderr``: writes from routed threads become debug log lines."""

    def __init__(self, target: Any) -> None:
        self._target = target
        self._partial: dict[int, str] = {}

    def write(self, text: str) -> int:
        ident = threading.get_ident()
        if ident not in _routed or getattr(_in_write, "active", False):
            return int(self._target.write(text) or 0)
        buffered = self._partial.pop(ident, "") + text
        *lines, rest = buffered.split("\n")
        if rest:
            self._partial[ident] = rest
        _in_write.active = True
        try:
            for line in lines:
                line = _ANSI.sub("", line).strip()
                if line:
                    log.debug("trackio: %s", line)
        finally:
            _in_write.active = False
        return len(text)

    def flush(self) -> None:
        if threading.get_ident() not in _routed:
            self._target.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)


def _route_this_thread() -> None:
    with _routed_lock:
        _routed.add(threading.get_ident())
        for name in ("stdout", "stderr"):
            stream = getattr(sys, name)
            if not isinstance(stream, _RoutedStream):
                setattr(sys, name, _RoutedStream(stream))


def _unroute_this_thread() -> None:
    with _routed_lock:
        _routed.discard(threading.get_ident())
        if not _routed:
            for name in ("stdout", "stderr"):
                stream = getattr(sys, name)
                if isinstance(stream, _RoutedStream):
                    setattr(sys, name, stream._target)


# ---------------------------------------------------------------------------------------------------------------
# The sink
# ---------------------------------------------------------------------------------------------------------------


class TrackioSink:
    """The guard's run in a trackio project; every trackio call on one daemon thread.

    The thread starts at construction: it imports ``trackio`` and calls ``trackio.init``, then works through
    the queue. A missing trackio or any exception from it is logged once (warning) and turns the sink off.

    Args:
        project: the trackio project (``--trackio PROJECT``, or the Trainer's ``project``).
        run_name: the run's name (None: trackio picks one).
        space_id: a Hugging Face Space to log to; None logs locally only (never creates a Space).
        config: the run's config (a flat dict of simple values), or None.
        queue_size: how many pending calls are kept; beyond, the oldest is dropped. Default 4096.
        mask: applied to every string sent (secret masking, ``Masker.mask_text``), or None.
        module: the ``trackio`` module or a stand-in (tests); None imports ``trackio`` on the thread.
        webhook_url: where trackio POSTs each alert (``trackio.init(webhook_url=...)``: Slack and Discord URLs get
            their own payload, any other URL trackio's JSON), or None (trackio then reads ``TRACKIO_WEBHOOK_URL``).
        webhook_min_level: the lowest level trackio sends to the webhook: ``"info"`` (default), ``"warn"`` or
            ``"error"``; every alert is stored in the run all the same.

    Attributes:
        dropped: how many calls were dropped because the queue was full.
        error: why the sink turned itself off, or None.
    """

    def __init__(self, project: str, *, run_name: str | None = None, space_id: str | None = None,
                 config: Mapping[str, Any] | None = None, queue_size: int = QUEUE_SIZE,
                 mask: Callable[[str], str] | None = None, module: Any = None, webhook_url: str | None = None,
                 webhook_min_level: str = "info") -> None:
        self.project, self.run_name, self.space_id = project, run_name, space_id
        self.webhook_url, self.webhook_min_level = webhook_url, webhook_min_level
        self.ready = threading.Event()  # trackio.init returned (or the sink turned itself off)
        self.config = dict(config) if config else None
        self.queue_size = max(1, queue_size)
        self.mask = mask or (lambda text: text)
        self.module = module
        self.dropped = 0
        self.error: str | None = None
        self.finishing = False
        self._items: deque[tuple[str, Any]] = deque()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._work, name="guard-trackio", daemon=True)
        self._thread.start()

    # -- the caller's side: never blocks, never raises ----------------------------------------------------------

    def _put(self, item: tuple[str, Any]) -> None:
        with self._cond:
            if self.error is not None or (self.finishing and item[0] != "stop"):
                return
            first_drop = False
            if len(self._items) >= self.queue_size:
                self._items.popleft()
                self.dropped += 1
                first_drop = self.dropped == 1
            self._items.append(item)
            self._cond.notify()
        if first_drop:
            log.warning("trackio is falling behind: dropping its oldest pending entries (the job is not affected)")

    def log(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Queue ``metrics`` (name -> number or short string) for ``step``."""
        try:
            clean = {str(key): self.mask(value) if isinstance(value, str) else value for key, value in metrics.items()}
        except Exception as exc:  # noqa: BLE001 - a bad call is dropped, never raised into the guard's loop
            log.debug("trackio: metrics dropped: %r", exc)
            return
        self._put(("log", (clean, step)))

    def alert(self, title: str, text: str | None = None, level: str = "warn", step: int | None = None) -> None:
        """Queue a trackio alert; ``level`` is ``"info"``, ``"warn"`` or ``"error"``."""
        try:
            item = (self.mask(str(title)), self.mask(str(text)) if text else None, level, step)
        except Exception as exc:  # noqa: BLE001 - as in log()
            log.debug("trackio: alert dropped: %r", exc)
            return
        self._put(("alert", item))

    def report(self, key: str, text: str, step: int | None = None) -> None:
        """Queue a Markdown report (``trackio.Markdown``: the dashboard's "Alerts & Reports" page shows its text)
        under ``key`` at ``step``; a plain string metric with a trackio that has no ``Markdown``."""
        try:
            item = (str(key), self.mask(str(text)), step)
        except Exception as exc:  # noqa: BLE001 - as in log()
            log.debug("trackio: report dropped: %r", exc)
            return
        self._put(("report", item))

    def finish(self, result: RunResult | None = None) -> None:
        """Queue the verdict (its text as the ``jobguard/verdict`` report at its step, and its alert: ``info`` for
        PASS, ``error`` otherwise), then the end of the run. Later ``log``/``alert`` calls are ignored."""
        if self.finishing:
            return
        if result is not None:
            self.report(VERDICT_REPORT, verdict_report(result, self.mask), step=result.step)
            self.alert(*verdict_alert(result, self.mask), step=result.step)
        self._put(("finish", None))
        self.finishing = True

    def close(self, timeout_s: float = 5.0) -> bool:
        """Finish the run (if ``finish`` was not called) and wait at most ``timeout_s`` for the thread.

        Returns:
            True when the sink's thread has ended (its work done, or the sink off: see ``error``), False when it
            is still busy after ``timeout_s`` (it is a daemon thread: it does not keep the guard alive).
        """
        self.finish()
        self._put(_STOP)
        self._thread.join(max(0.0, timeout_s))
        if self._thread.is_alive():
            log.warning("trackio did not finish within %.0fs: its last entries may be missing (the job is not "
                        "affected)", timeout_s)
            return False
        if self.dropped:
            log.info("trackio: %d entries were dropped while it fell behind", self.dropped)
        return True

    # -- the sink's thread ---------------------------------------------------------------------------------------

    def _next(self) -> tuple[str, Any]:
        with self._cond:
            while not self._items:
                self._cond.wait()
            return self._items.popleft()

    def _work(self) -> None:
        _route_this_thread()
        reason = None
        try:
            try:
                trackio = self.module if self.module is not None else importlib.import_module("trackio")
            except ImportError as exc:
                reason = f"trackio cannot be imported ({exc}); pip install 'jobguard[trackio]'"
            else:
                self._run(trackio)
        except BaseException as exc:  # noqa: BLE001 - a tracker fault must never reach the job or the guard
            reason = f"{type(exc).__name__}: {exc}"
        finally:
            _unroute_this_thread()
            self.ready.set()
        if reason is not None:
            self._fail(reason)

    def _run(self, trackio: Any) -> None:
        wanted: dict[str, Any] = {"project": self.project, "name": self.run_name, "space_id": self.space_id,
                                  "config": self.config, "embed": False, "auto_log_gpu": False,
                                  "auto_log_cpu": False}
        if self.webhook_url:
            wanted.update(webhook_url=self.webhook_url, webhook_min_level=self.webhook_min_level)
        try:
            accepted = inspect.signature(trackio.init).parameters
            kwargs = {k: v for k, v in wanted.items() if k in accepted or k == "project"}
            if self.webhook_url and "webhook_url" not in kwargs:
                log.warning("this trackio has no webhook_url (trackio 0.43 has): alerts reach the dashboard only")
        except (TypeError, ValueError):
            kwargs = {"project": self.project, "name": self.run_name}
        run = trackio.init(**kwargs)
        self.ready.set()
        where = f"Space {self.space_id}" if self.space_id else "local"
        log.info("trackio: logging to project %s, run %s (%s)", self.project, getattr(run, "name", self.run_name),
                 where)
        levels = getattr(trackio, "AlertLevel", None)
        markdown = getattr(trackio, "Markdown", None)
        finished = False
        while True:
            kind, payload = self._next()
            if kind == "log":
                metrics, step = payload
                run.log(metrics, step=step)
            elif kind == "alert":
                title, text, level, step = payload
                run.alert(title=title, text=text, level=levels(level) if levels else level, step=step)
            elif kind == "report":
                key, text, step = payload
                run.log({key: markdown(text) if markdown else text}, step=step)
            elif kind == "finish" and not finished:
                finished = True
                trackio.finish()
            elif kind == "stop":
                if not finished:
                    trackio.finish()
                return

    def _fail(self, reason: str) -> None:
        with self._cond:
            self.error = reason
            self._items.clear()
        log.warning("trackio reporting is off for this run: %s (the job is not affected)", reason)
