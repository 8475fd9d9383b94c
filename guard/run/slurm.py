"""Slurm's view of the job's end time, refreshed from ``scontrol show job`` (bounded calls).

``SLURM_JOB_END_TIME`` is a snapshot taken at launch (``src/common/env.c``): it does not follow
``scontrol update TimeLimit+=`` nor a preemption's GraceTime. ``scontrol show job -o ID`` prints ``StartTime=``,
``EndTime=`` through ``slurm_make_time_str``: ``Unknown`` for 0 or INFINITE, ``None`` for NO_VAL, else ``strftime``
in local time with ``%FT%T`` unless ``SLURM_TIME_FORMAT`` holds a ``%`` format (``src/common/parse_time.c``); the
refresher passes ``SLURM_TIME_FORMAT=%s`` so it prints epoch seconds, and still reads the ISO form. ``TimeLimit=``
is ``UNLIMITED``, ``Partition_Limit`` (NO_VAL) or ``[D-]HH:MM:SS`` (``mins2time_str``; ``src/api/job_info.c``).
The controller can be slow when busy, so every call has a timeout and failures never raise.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import re
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from guard.core.children import CHILDREN
from guard.secure.budget import SLURM_UNLIMITED_AFTER_S, format_duration_s

__all__ = ["SlurmJobTimes", "SlurmRefresher", "parse_scontrol_job", "parse_slurm_duration_s"]

log = logging.getLogger("guard.slurm")

def parse_slurm_duration_s(text: str) -> float:
    """Read a Slurm duration: ``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``, ``D-H:M:S`` (``time_str2secs`` in
    ``src/common/parse_time.c``). Raises ValueError otherwise."""
    match = re.fullmatch(r"(?:(\d+)-(\d+)(?::(\d+)(?::(\d+))?)?|(\d+)(?::(\d+)(?::(\d+))?)?)", text.strip())
    if not match:
        raise ValueError(f"not a Slurm duration: {text!r}")
    d, dh, dm, ds, a, b, c = (int(g) if g else 0 for g in match.groups())
    if match.group(1) is not None:
        return float(d * 86400 + dh * 3600 + dm * 60 + ds)
    if match.group(7) is not None:  # H:M:S
        return float(a * 3600 + b * 60 + c)
    return float(a * 60 + b)  # M or M:S


def _parse_slurm_time_s(text: str) -> float | None:
    if text in ("", "Unknown", "None", "NONE", "N/A"):
        return None
    if re.fullmatch(r"\d+", text):
        return float(text) or None
    return _dt.datetime.fromisoformat(text).timestamp()  # naive = local time, as slurm_make_time_str prints it


@dataclass(frozen=True)
class SlurmJobTimes:
    """The times ``scontrol show job -o`` reports for one job (epoch seconds / seconds; None when unknown)."""

    start_time_s: float | None
    end_time_s: float | None
    time_limit_s: float | None
    unlimited: bool = False

    @property
    def deadline_s(self) -> float | None:
        """The end time (``EndTime``, else ``StartTime + TimeLimit``), or None when unlimited or unknown."""
        if self.unlimited:
            return None
        end_s = self.end_time_s
        if end_s is None and self.start_time_s is not None and self.time_limit_s is not None:
            end_s = self.start_time_s + self.time_limit_s
        if end_s is not None and self.start_time_s is not None and end_s - self.start_time_s > SLURM_UNLIMITED_AFTER_S:
            return None
        return end_s


def parse_scontrol_job(text: str, *, job_id: str | None = None) -> SlurmJobTimes:
    """Parse ``scontrol show job -o JOB_ID`` output (one ``Key=Value ...`` line per job).

    Args:
        text: the command's stdout.
        job_id: prefer the line of this job (a heterogeneous job prints one line per component).

    Raises:
        ValueError: no line carries ``EndTime=``, ``StartTime=`` or ``TimeLimit=``, or a value is malformed.
    """
    lines = [line for line in text.splitlines() if "EndTime=" in line or "TimeLimit=" in line]
    if job_id is not None:
        lines = [ln for ln in lines if re.search(rf"(?:^|\s)JobId={re.escape(job_id)}(?:\s|$)", ln)] or lines
    if not lines:
        raise ValueError("no EndTime= or TimeLimit= in the scontrol output")
    fields = dict(re.findall(r"(?:^|\s)(StartTime|EndTime|TimeLimit)=(\S*)", lines[0]))
    limit = fields.get("TimeLimit", "")
    unlimited = limit.upper() in ("UNLIMITED", "INFINITE")
    limit_s = None if unlimited or limit in ("", "Partition_Limit", "NONE", "N/A") else parse_slurm_duration_s(limit)
    return SlurmJobTimes(_parse_slurm_time_s(fields.get("StartTime", "")),
                         _parse_slurm_time_s(fields.get("EndTime", "")), limit_s, unlimited)


class SlurmRefresher:
    """Re-reads the job's end time from ``scontrol`` now and then (it moves with ``scontrol update`` and
    preemption; ``SLURM_JOB_END_TIME`` does not).

    Calls to ``scontrol`` talk to slurmctld and can hang when it is busy (platform.md 1.2), so each call has a short
    timeout and runs at most once per ``interval_s``. Nothing here raises: failures are counted in ``failures``
    and logged once; a missing ``scontrol`` disables the refresher with one log line.

    Args:
        job_id: ``SLURM_JOB_ID``.
        runner: ``subprocess.run``-like callable (default ``CHILDREN.run``: the call is the helper thread's own
            child, never reaped as an orphan; injected in tests).
        interval_s: least seconds between two calls (default 300).
        call_timeout_s: timeout of one call in seconds (default 5).
        clock: monotonic clock in seconds, used when ``maybe_refresh`` gets no ``now_s``.
        environ: the environment for the call (default ``os.environ``); ``SLURM_TIME_FORMAT=%s`` is added.
        helpers: a ``guard.core.helpers.Helpers`` to run the call on its worker thread (the supervisor's loop never
            waits for ``scontrol``): ``maybe_refresh`` then starts a call when one is due and returns the end time
            of a call that has finished since; None (default) calls ``scontrol`` right away.
    """

    def __init__(self, job_id: str, *, runner: Callable[..., Any] = CHILDREN.run, interval_s: float = 300.0,
                 call_timeout_s: float = 5.0, clock: Callable[[], float] | None = None,
                 environ: Mapping[str, str] | None = None, helpers: Any = None) -> None:
        self.job_id = str(job_id)
        self.helpers = helpers
        self._pending: Any = None
        self.interval_s = interval_s
        self.call_timeout_s = call_timeout_s
        self.calls = 0
        self.failures = 0
        self.disabled = False
        self.last_times: SlurmJobTimes | None = None
        self.last_source = "scontrol EndTime"
        self._runner = runner
        self._clock = clock or time.monotonic
        self._environ = os.environ if environ is None else environ
        self._last_attempt_s: float | None = None
        self._last_deadline_s: float | None = None
        self._failure_logged = False

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None, **kwargs: Any) -> SlurmRefresher | None:
        """A refresher for ``SLURM_JOB_ID`` from ``environ``, or None outside a Slurm job."""
        env = os.environ if environ is None else environ
        job_id = env.get("SLURM_JOB_ID", "").strip()
        return cls(job_id, environ=env, **kwargs) if job_id else None

    def maybe_refresh(self, now_s: float | None = None) -> float | None:
        """Ask ``scontrol`` for the end time if ``interval_s`` has passed since the last call (the first call runs).

        Args:
            now_s: monotonic now in seconds; default ``clock()``.

        Returns:
            The job's end time in epoch seconds after a successful call; None when not due, disabled, failed, or
            when the job has no limit.
        """
        finished = None
        if self._pending is not None and self._pending.done():
            finished, self._pending = self._pending.result(), None
        if self.disabled or self._pending is not None:
            return finished
        now = self._clock() if now_s is None else now_s
        if self._last_attempt_s is not None and now - self._last_attempt_s < self.interval_s:
            return finished
        self._last_attempt_s = now
        if self.helpers is not None:
            self._pending = self.helpers.submit(self._safe_refresh)
            return finished
        return self._safe_refresh()

    def _safe_refresh(self) -> float | None:
        try:
            return self._refresh()
        except Exception as exc:  # noqa: BLE001 - never let a refresh take the supervisor down
            return self._fail(f"unexpected {type(exc).__name__}: {exc}")

    def _refresh(self) -> float | None:
        self.calls += 1
        env = dict(self._environ)
        env["SLURM_TIME_FORMAT"] = "%s"  # epoch seconds, whatever the user's locale or format (parse_time.c)
        argv = ["scontrol", "show", "job", "-o", self.job_id]
        try:
            proc = self._runner(argv, capture_output=True, text=True, timeout=self.call_timeout_s, env=env,
                                check=False)
        except FileNotFoundError:
            self.disabled = True
            log.info("scontrol is not on PATH: the Slurm end time is not refreshed (SLURM_JOB_END_TIME only)")
            return None
        except subprocess.TimeoutExpired:
            return self._fail(f"no answer within {self.call_timeout_s:g}s")
        if proc.returncode != 0:
            first = (proc.stderr or "").strip().splitlines()[:1]
            return self._fail(f"exit {proc.returncode}" + (f": {first[0]}" if first else ""))
        try:
            times = parse_scontrol_job(proc.stdout or "", job_id=self.job_id)
        except ValueError as exc:
            return self._fail(f"unreadable output ({exc})")
        self.last_times = times
        self.last_source = "scontrol EndTime" if times.end_time_s is not None else "scontrol StartTime+TimeLimit"
        deadline_s = times.deadline_s
        if deadline_s != self._last_deadline_s:
            log.info("Slurm end time now %s (%s)", "none" if deadline_s is None else
                     _dt.datetime.fromtimestamp(deadline_s, _dt.timezone.utc).isoformat(), self.last_source)
            self._last_deadline_s = deadline_s
        return deadline_s

    def _fail(self, why: str) -> float | None:
        self.failures += 1
        if not self._failure_logged:
            self._failure_logged = True
            log.warning("scontrol show job %s failed (%s): keeping the current deadline; retrying every %s",
                        self.job_id, why, format_duration_s(self.interval_s))
        else:
            log.debug("scontrol show job %s failed again (%s), %d failures", self.job_id, why, self.failures)
        return None

