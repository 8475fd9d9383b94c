"""The time budget: when the job's deadline falls, and how much of it to keep free for the last checkpoint.

Pure logic. The wall clock (epoch seconds) and the monotonic clock are passed in as numbers or callables, the
``scontrol`` runner is injected; nothing here sleeps.

Facts used here, with their sources (details in ``shared/reference/platform.md`` sections 1, 2 and 7):

- ``SLURM_JOB_START_TIME`` / ``SLURM_JOB_END_TIME``: "The UNIX timestamp for a job's start time" / "projected end
  time", set since Slurm 23.02 (``sbatch.1`` OUTPUT ENVIRONMENT VARIABLES; ``CHANGELOG/slurm-23.02.md``). Set only when
  non-zero (``src/common/env.c``). A snapshot taken at launch: it does not follow ``scontrol update TimeLimit+=``
  nor a preemption's GraceTime, hence ``guard.run.slurm.SlurmRefresher``.
- ``--time=UNLIMITED``: ``job_end_time_reset()`` sets the end to start + 365 days (``src/slurmctld/job_mgr.c``), so an
  end more than 364 days after the start means "no limit".
- Hugging Face Jobs expose no timeout inside the container (hub-docs ``jobs-configuration.md`` lists only ``JOB_ID``,
  ``ACCELERATOR``, ``CPU_CORES``, ``MEMORY``), so the user passes ``--timeout``; the container started when its PID 1
  did: ``psutil.Process(1).create_time()`` is epoch seconds from ``/proc/1/stat`` (psutil 7.2.2; in a PID namespace
  PID 1 is the entrypoint). It may raise ``psutil.AccessDenied``/``NoSuchProcess`` (``hidepid``): caught.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from guard.core.durations import format_duration_s
from guard.errors import BudgetError, UsageError

__all__ = [
    "CLOCK_SKEW_S",
    "MARGIN_LOG_MIN_S",
    "MARGIN_LOG_SHARE",
    "MIN_PUSH_COST_S",
    "Deadline",
    "MarginEstimate",
    "MarginEstimator",
    "checkpoint_due",
    "format_duration_s",
    "margin_bounds",
    "parse_started_at",
    "resolve_deadline",
]

log = logging.getLogger("guard.budget")

#: A start time up to this many seconds in the future is clock skew between hosts, not an error.
CLOCK_SKEW_S = 60.0
#: Slurm sets the end of an UNLIMITED job to start + 365 days; past start + 364 days means "no limit".
SLURM_UNLIMITED_AFTER_S = 364 * 86400.0
_MB = 1e6
#: The least a measured push is estimated to cost again: the worker's start and the plan's polls alone take part of
#: a second, and one fast sample is no promise.
MIN_PUSH_COST_S = 1.0


# ---------------------------------------------------------------------------------------------------------------
# Deadline
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Deadline:
    """When the platform will stop the job.

    Attributes:
        started_at_s: when the budget started counting, epoch seconds.
        timeout_s: the budget in seconds (``deadline_s - started_at_s``), or None without a limit.
        deadline_s: the kill time, epoch seconds, or None without a limit.
        source: where the deadline came from, for humans (``"--timeout 2h from --started-at"``,
            ``"SLURM_JOB_END_TIME"``, ``"scontrol EndTime"``).
        explicit_deadline_s: the deadline the user's own ``--timeout`` gives, kept so that a Slurm refresh can
            never move the deadline past it (None when the user gave no timeout).
        exact: the end time is known to the second (``SLURM_JOB_END_TIME``, ``scontrol``'s ``EndTime``, a timeout
            counted from ``--started-at`` or ``SLURM_JOB_START_TIME``), so the margin needs no floor for an end
            known only to the minute (see :func:`margin_bounds`). Default False.
    """

    started_at_s: float
    timeout_s: float | None
    deadline_s: float | None
    source: str
    explicit_deadline_s: float | None = None
    exact: bool = False

    def remaining_s(self, now_s: float) -> float | None:
        """Seconds left at ``now_s`` (epoch seconds); negative once passed; None without a deadline."""
        return None if self.deadline_s is None else self.deadline_s - now_s

    def refreshed(self, end_s: float | None, source: str) -> Deadline:
        """A copy moved to a new end time reported by the scheduler (e.g.
        ``guard.run.slurm.SlurmRefresher.maybe_refresh``).

        The scheduler may move the end either way (``scontrol update TimeLimit+=30`` extends it, a preemption with
        GraceTime shortens it), but never past the user's own ``--timeout``.

        Args:
            end_s: the scheduler's new end time, epoch seconds; None leaves the deadline unchanged.
            source: human text for the new source, e.g. ``"scontrol EndTime"``.
        """
        if end_s is None:
            return self
        new_s, new_source, exact = end_s, source, True  # a scheduler's end time is to the second
        if self.explicit_deadline_s is not None and self.explicit_deadline_s <= end_s:
            new_s, exact = self.explicit_deadline_s, self.exact
            new_source = f"explicit timeout ({source} is later)"
        if new_s == self.deadline_s:
            return self
        return replace(self, deadline_s=new_s, timeout_s=new_s - self.started_at_s, source=new_source, exact=exact)


def parse_started_at(text: str, *, option: str = "--started-at") -> float:
    """Read ``--started-at``: epoch seconds (``1755700000``, ``1755700000.5``) or ISO 8601.

    An ISO time without an offset (``2026-08-20T14:30:00``) is read as UTC; ``Z`` and ``+02:00`` are honoured.

    Returns:
        Epoch seconds (float).

    Raises:
        UsageError: ``text`` is neither form, or looks like milliseconds (``option`` names the option).
    """
    value = text.strip()
    hint = ("give epoch seconds (e.g. 1755700000, from `date +%s`) or ISO 8601 "
            "(e.g. 2026-08-20T14:30:00Z; without an offset the time is read as UTC)")
    if re.fullmatch(r"[0-9]+(\.[0-9]+)?", value):
        epoch_s = float(value)
        if epoch_s > 1e11:
            raise UsageError(f"{option} {text!r} looks like milliseconds, not seconds", option=option, hint=hint)
        return epoch_s
    iso = value[:-1] + "+00:00" if value[-1:] in ("Z", "z") else value
    import datetime as _dt  # here: a start-up cost of every run otherwise, for the ISO form only

    try:
        when = _dt.datetime.fromisoformat(iso)
    except ValueError:
        raise UsageError(f"{option} {text!r} is not a time", option=option, hint=hint) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=_dt.timezone.utc)
    return when.timestamp()


def _slurm_epoch(environ: Mapping[str, str], name: str) -> float | None:
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    if not re.fullmatch(r"[0-9]+", raw):
        raise BudgetError(f"{name}={raw!r} is not a UNIX timestamp",
                          hint=f"unset {name}, or pass --timeout and --started-at explicitly")
    return float(raw) or None  # Slurm only sets it when non-zero (src/common/env.c): 0 means unknown


def _check_not_future(start_s: float, now_s: float, what: str) -> None:
    if start_s > now_s + CLOCK_SKEW_S:
        raise BudgetError(
            f"{what} is {format_duration_s(start_s - now_s)} in the future",
            hint="check the start time you passed and this machine's clock (NTP); the start must not be ahead of now")


def _is_hf_jobs(platform: Any) -> bool:
    # a name, an enum (``.value``), or ``guard.run.platform.PlatformInfo`` (``.name``)
    name = platform if isinstance(platform, str) else getattr(platform, "value", getattr(platform, "name", platform))
    return str(name).lower().replace("-", "_").replace(" ", "_") in {"hf_jobs", "hfjobs", "huggingface_jobs"}


def _pid1_create_time_s() -> float | None:
    import psutil

    try:
        return float(psutil.Process(1).create_time())
    except (psutil.Error, OSError) as exc:  # AccessDenied with hidepid, NoSuchProcess
        log.info("cannot read the container start (PID 1 create time): %s", exc)
        return None


def resolve_deadline(
    *,
    timeout_s: float | None,
    timeout_source: str = "--timeout",
    started_at_s: float | None = None,
    started_at_source: str = "--started-at",
    environ: Mapping[str, str] | None = None,
    platform: Any = None,
    now_s: float,
    pid1_start_s: float | None = None,
) -> Deadline:
    """Work out the job's deadline from the flags, the scheduler and the container.

    Priority:

    1. An explicit timeout (``--timeout`` / ``GUARD_TIMEOUT``, already in seconds), counted from ``started_at_s``
       when given, else Slurm's ``SLURM_JOB_START_TIME``, else on Hugging Face Jobs the container start (PID 1
       create time), else ``now_s``. If Slurm's ``SLURM_JOB_END_TIME`` falls earlier, the earlier end wins (the
       scheduler kills at its own time whatever the flag says) and a warning is logged.
    2. Slurm's ``SLURM_JOB_END_TIME`` (an end more than 364 days after the start means ``--time=UNLIMITED``).
    3. No deadline.

    Args:
        timeout_s: the budget in seconds, or None.
        timeout_source: where it came from (``"--timeout"`` or ``"GUARD_TIMEOUT"``), for the ``source`` text.
        started_at_s: ``--started-at`` in epoch seconds (see :func:`parse_started_at`), or None.
        started_at_source: where it came from, for the ``source`` text.
        environ: the environment to read Slurm variables from; default ``os.environ``.
        platform: the platform: ``guard.run.platform.PlatformInfo``, a name such as ``"hf_jobs"``, or an enum whose
            ``.value`` is one; on HF Jobs the container start counts as the job's start.
        now_s: now, epoch seconds.
        pid1_start_s: PID 1's create time (tests inject it); default: read with psutil on HF Jobs.

    Returns:
        The :class:`Deadline`.

    Raises:
        BudgetError: a malformed ``SLURM_JOB_START_TIME``/``SLURM_JOB_END_TIME``, an end before the start, a start
            more than :data:`CLOCK_SKEW_S` in the future, or a timeout that is not a positive number.
    """
    env = os.environ if environ is None else environ
    slurm_start_s = _slurm_epoch(env, "SLURM_JOB_START_TIME")
    slurm_end_s = _slurm_epoch(env, "SLURM_JOB_END_TIME")
    if started_at_s is not None:
        _check_not_future(started_at_s, now_s, started_at_source)
    if slurm_start_s is not None:
        _check_not_future(slurm_start_s, now_s, "SLURM_JOB_START_TIME")
        if slurm_end_s is not None and slurm_end_s < slurm_start_s:
            raise BudgetError("SLURM_JOB_END_TIME is before SLURM_JOB_START_TIME",
                              hint="unset both, or pass --timeout and --started-at explicitly")
    slurm_deadline_s = None
    if slurm_end_s is not None:
        if slurm_end_s - (slurm_start_s if slurm_start_s is not None else now_s) > SLURM_UNLIMITED_AFTER_S:
            log.info("SLURM_JOB_END_TIME is a year away: the job has no time limit (--time=UNLIMITED)")
        else:
            slurm_deadline_s = slurm_end_s

    if timeout_s is not None:
        if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
            raise BudgetError(f"{timeout_source} must be a positive duration, got {timeout_s!r}",
                              hint="pass a duration such as 7200, 90m, 2h or 1-00:00:00")
        start_s, start_text = _start_for_timeout(
            timeout_s, started_at_s, started_at_source, slurm_start_s, platform, now_s, pid1_start_s)
        explicit_s = start_s + timeout_s
        exact = started_at_s is not None or start_text == "SLURM_JOB_START_TIME"  # a known start, not the guard's
        deadline = Deadline(start_s, float(timeout_s), explicit_s,
                            f"{timeout_source} {format_duration_s(timeout_s)} from {start_text}", explicit_s, exact)
        if slurm_deadline_s is not None and slurm_deadline_s < explicit_s:
            log.warning("Slurm ends the job %s before %s: using SLURM_JOB_END_TIME",
                        format_duration_s(explicit_s - slurm_deadline_s), deadline.source)
            deadline = replace(deadline, deadline_s=slurm_deadline_s, timeout_s=slurm_deadline_s - start_s,
                               source=f"SLURM_JOB_END_TIME (before {deadline.source})", exact=True)
        return deadline
    if slurm_deadline_s is not None:
        start_s = next(s for s in (slurm_start_s, started_at_s, now_s) if s is not None)
        return Deadline(start_s, slurm_deadline_s - start_s, slurm_deadline_s, "SLURM_JOB_END_TIME", exact=True)
    start_s = next(s for s in (started_at_s, slurm_start_s, now_s) if s is not None)
    return Deadline(start_s, None, None, "none (no --timeout, no Slurm end time)")


def _start_for_timeout(timeout_s: float, started_at_s: float | None, started_at_source: str,
                       slurm_start_s: float | None, platform: Any, now_s: float,
                       pid1_start_s: float | None) -> tuple[float, str]:
    if started_at_s is not None:
        return started_at_s, started_at_source
    if slurm_start_s is not None:
        return slurm_start_s, "SLURM_JOB_START_TIME"
    if _is_hf_jobs(platform):
        pid1_s = _pid1_create_time_s() if pid1_start_s is None else pid1_start_s
        if pid1_s is not None and pid1_s > now_s + CLOCK_SKEW_S:
            log.warning("PID 1 started in the future (clock skew?): counting the timeout from the guard's start")
        elif pid1_s is not None and now_s - pid1_s >= timeout_s:
            # The whole budget already spent: PID 1 is most likely not this container's entrypoint (no PID
            # namespace, e.g. --pid=host), and stopping the job at once would be the worse mistake.
            log.warning("PID 1 started %s ago, more than the whole budget: it is not the container's start; "
                        "counting the timeout from the guard's start (pass --started-at to be exact)",
                        format_duration_s(now_s - pid1_s))
        elif pid1_s is not None:
            return min(pid1_s, now_s), "container start (PID 1)"
    return now_s, "guard start"


# ---------------------------------------------------------------------------------------------------------------
# Margin
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MarginEstimate:
    """One margin and what it is made of (seconds, bytes, bytes per second)."""

    margin_s: float
    step_s: float
    save_s: float
    push_s: float
    size_bytes: float
    push_bytes_per_s: float
    safety_factor: float
    fixed: bool = False
    floored: bool = False
    overhead_s: float = 0.0
    capped_s: float | None = None  # the cap (half a short budget) when it applied
    size_source: str = ""  # where ``size_bytes`` came from (MarginEstimator.size_source)

    def describe(self) -> str:
        """One line for the log: ``"margin now 98s ((save 5.0s + push 50.0s of 1000 MB at 20.0 MB/s) x1.5 + 15s)"``."""
        if self.fixed:
            return f"margin now {self.margin_s:.0f}s (fixed by --margin)"
        step = f"step {self.step_s:.1f}s + " if self.step_s > 0 else ""
        limit = (f", capped at half the budget ({self.capped_s:.0f}s)" if self.capped_s is not None
                 else ", the floor" if self.floored else "")
        source = f" ({self.size_source})" if self.size_source else ""
        return (f"margin now {self.margin_s:.0f}s (({step}save {self.save_s:.1f}s + push {self.push_s:.1f}s of "
                f"{self.size_bytes / _MB:.0f} MB{source} at {self.push_bytes_per_s / _MB:.1f} MB/s) "
                f"x{self.safety_factor:g} + {self.overhead_s:.0f}s{limit})")


#: The margin is logged again when it moved by more than this many seconds and this share of the last one logged
#: (a 60 s nanoGPT run logged it 17 times at 5 %).
MARGIN_LOG_MIN_S = 2.0
MARGIN_LOG_SHARE = 0.10


class MarginEstimator:
    """How long before the deadline the guard must ask the job for its last checkpoint.

    ``margin_s = (step + save + size / push throughput) * safety_factor + overhead_s``, at least ``floor_s``, or
    ``fixed_margin_s`` when ``--margin`` is given. ``step`` is the longest recent step (the job saves at its next
    step end), ``save`` the longest recent save scaled to the expected size.

    Defaults before any measurement are deliberately low-side guesses, replaced by the first measurement:

    - push 20 MB/s: uploads from cloud GPU hosts to the Hub commonly reach 50-200 MB/s, shared academic uplinks
      10-30 MB/s; 20 MB/s sits at the low end of both.
    - save at 200 MB/s: ``torch.save`` of a state dict to local NVMe runs near 1 GB/s, to NFS/Lustre from one client
      a few hundred MB/s; 200 MB/s is the slow end.
    - size 1 GB (``default_size_bytes``) until a save, ``observe_size`` (an existing checkpoint) or
      ``size_hint_bytes`` says otherwise.
    - overhead 15 s: Hub commit round trips (preupload, commit, verify with ``get_paths_info``) of a few seconds each.
    - floor 60 s: a deadline counted from the guard's own start is only known to about a minute (Slurm's time
      resolution is one minute, ``sbatch.1 --time``; clocks of different hosts differ). An exact end time needs
      none (:func:`margin_bounds`).

    Measurements are kept robustly: the save time is the *largest* of the last ``history`` saves (scaled up to the
    expected size); the push throughput is the *slowest* of the last ``history`` pushes, lowered further while a
    push runs longer than that rate allows (``observe_push_progress``: a push that slows down mid-way counts before
    it ends).

    Args:
        fixed_margin_s: ``--margin`` in seconds; None (``auto``) to estimate.
        safety_factor: multiplier on the measured times (default 1.5, at least 1).
        floor_s: the smallest margin (default 60).
        overhead_s: seconds added for the push's fixed costs (default 15).
        default_push_bytes_per_s: push throughput before a measurement (default 20e6).
        default_save_s: save time before a measurement; None (default) scales the size at
            ``default_save_bytes_per_s`` (200e6).
        size_hint_bytes: checkpoint size expected before the first save (a config hint), or None.
        default_size_bytes: the size when nothing else is known (default 1e9).
        history: how many recent saves and steps to remember (default 5).
        log_changes: log the margin whenever it changes (default True; off when the job has no deadline).
        max_margin_s: the largest automatic margin (default None: no cap). For a short budget the defaults above
            (a 1 GB checkpoint at 20 MB/s) would ask for the checkpoint at once; the guard caps the margin at half
            the budget and scales the floor down to a quarter of it, whatever the budget's source
            (:func:`margin_bounds`).

    Raises:
        BudgetError: a negative or non-finite setting, or ``safety_factor < 1``.
    """

    def __init__(self, *, fixed_margin_s: float | None = None, safety_factor: float = 1.5, floor_s: float = 60.0,
                 overhead_s: float = 15.0, default_push_bytes_per_s: float = 20e6, default_save_s: float | None = None,
                 default_save_bytes_per_s: float = 200e6, size_hint_bytes: float | None = None,
                 default_size_bytes: float = 1e9, history: int = 5, log_changes: bool = True,
                 max_margin_s: float | None = None) -> None:
        for name, value in (("fixed_margin_s", fixed_margin_s), ("floor_s", floor_s), ("overhead_s", overhead_s),
                            ("default_save_s", default_save_s), ("size_hint_bytes", size_hint_bytes)):
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise BudgetError(f"{name} must be a non-negative number, got {value!r}")
        for name, value in (("default_push_bytes_per_s", default_push_bytes_per_s),
                            ("default_save_bytes_per_s", default_save_bytes_per_s),
                            ("default_size_bytes", default_size_bytes)):
            if not (math.isfinite(value) and value > 0):
                raise BudgetError(f"{name} must be a positive number, got {value!r}")
        if not (math.isfinite(safety_factor) and safety_factor >= 1):
            raise BudgetError(f"safety_factor must be at least 1, got {safety_factor!r}")
        self.fixed_margin_s = fixed_margin_s
        self.safety_factor = safety_factor
        self.floor_s = floor_s
        self.overhead_s = overhead_s
        self.default_push_bytes_per_s = default_push_bytes_per_s
        self.default_save_s = default_save_s
        self.default_save_bytes_per_s = default_save_bytes_per_s
        self.size_hint_bytes = size_hint_bytes
        self.default_size_bytes = default_size_bytes
        self._saves: deque[tuple[float, float]] = deque(maxlen=history)
        self._steps: deque[float] = deque(maxlen=max(history, 1))
        self._push_rates: deque[float] = deque(maxlen=max(history, 1))  # bytes/s of recent finished pushes
        self._push_costs: deque[tuple[float, float]] = deque(maxlen=max(history, 1))  # (whole push s, bytes)
        self._running_bound: float | None = None  # bytes/s at most, from a push still running (or killed)
        self._seen_size_bytes: float | None = None
        self._logged_margin_s: float | None = None
        self.log_changes = log_changes
        self.max_margin_s = max_margin_s

    # -- observations ------------------------------------------------------------------------------------------

    def observe_save(self, duration_s: float, size_bytes: float) -> None:
        """Record a finished save: its duration in seconds and the checkpoint's size in bytes."""
        if _ok(duration_s) and _ok(size_bytes) and size_bytes > 0:
            self._saves.append((float(duration_s), float(size_bytes)))
            self._seen_size_bytes = float(size_bytes)
            self._maybe_log()

    def observe_push(self, size_bytes: float, duration_s: float) -> None:
        """Record a finished push (upload and verification) of ``size_bytes`` that took ``duration_s``; it replaces
        the bound of a running push (``observe_push_progress``)."""
        if not (_ok(size_bytes) and _ok(duration_s) and size_bytes > 0):
            return
        self._push_rates.append(size_bytes / max(duration_s, 1e-3))
        self._running_bound = None
        self._maybe_log()

    def observe_push_cost(self, size_bytes: float, duration_s: float) -> None:
        """Record what a finished push of ``size_bytes`` cost as securing sees it: ``duration_s`` seconds from its
        start to its verified end (the worker's start, the upload, the commits, the verification: the fixed costs
        ``overhead_s`` guesses are in it). :meth:`secure_estimate_s` uses it instead of the guess."""
        if _ok(size_bytes) and _ok(duration_s) and size_bytes > 0:
            self._push_costs.append((float(duration_s), float(size_bytes)))

    def observe_push_progress(self, size_bytes: float, elapsed_s: float) -> None:
        """Record a push of ``size_bytes`` still running after ``elapsed_s`` (or killed then): the throughput is at
        most ``size_bytes / elapsed_s``, so a slowdown counts before the push ends (only ever lowers the estimate,
        until the next finished push). Call it now and then (e.g. every loop tick) while a push runs."""
        if _ok(size_bytes) and _ok(elapsed_s) and size_bytes > 0 and elapsed_s > 0:
            bound = size_bytes / elapsed_s
            if bound < self.push_bytes_per_s:
                self._running_bound = bound
                self._maybe_log()

    def discard_push_progress(self) -> None:
        """A push ended with an error (not killed for time): its running time was no transfer rate (retries
        against an unreachable Hub, a refused token), so the bound ``observe_push_progress`` took from it is
        dropped. Only finished pushes and slow transfers still running set the rate."""
        if self._running_bound is not None:
            self._running_bound = None
            self._maybe_log()

    def observe_step(self, duration_s: float) -> None:
        """Record a training step's duration in seconds (the job answers a checkpoint request at a step end)."""
        if _ok(duration_s):
            self._steps.append(float(duration_s))
            self._maybe_log()

    def expect_size(self, size_bytes: float) -> bool:
        """A checkpoint size told before any save (the Trainer's or the agent's estimate of the weights and
        optimizer state): the size the margin assumes until a checkpoint is seen; an earlier hint stands. Returns
        whether it was taken."""
        if self.size_hint_bytes or not _ok(size_bytes) or size_bytes <= 0:
            return False
        self.size_hint_bytes = float(size_bytes)
        self._maybe_log()
        return True

    def observe_size(self, size_bytes: float) -> None:
        """Record a checkpoint size seen without a timed save (e.g. one already on disk when the guard starts)."""
        if _ok(size_bytes) and size_bytes > 0:
            self._seen_size_bytes = float(size_bytes)
            self._maybe_log()

    # -- estimates ---------------------------------------------------------------------------------------------

    @property
    def expected_size_bytes(self) -> float:
        """The next checkpoint's size: the last one seen, else ``size_hint_bytes``, else ``default_size_bytes``."""
        for size in (self._seen_size_bytes, self.size_hint_bytes):
            if size:
                return size
        return self.default_size_bytes

    @property
    def size_source(self) -> str:
        """Where ``expected_size_bytes`` comes from, for the margin's log line."""
        if self._seen_size_bytes:
            return "the last save" if self._saves else "the newest checkpoint seen on disk"
        if self.size_hint_bytes:
            return "the model's weights and optimizer state"
        return "a guess: no checkpoint seen yet"

    @property
    def push_bytes_per_s(self) -> float:
        """The push throughput in bytes per second: the slowest recent push (else the default), lowered by a push
        that runs longer than that rate allows."""
        rate = min(self._push_rates) if self._push_rates else self.default_push_bytes_per_s
        return min(rate, self._running_bound) if self._running_bound is not None else rate

    def save_estimate_s(self, size_bytes: float | None = None) -> float:
        """Seconds a save of ``size_bytes`` (default: expected size) should take, without the safety factor."""
        size = self.expected_size_bytes if size_bytes is None else size_bytes
        if self._saves:
            return max(duration * max(1.0, size / seen) for duration, seen in self._saves)
        if self.default_save_s is not None:
            return self.default_save_s
        return size / self.default_save_bytes_per_s

    def push_estimate_s(self, size_bytes: float | None = None) -> float:
        """Seconds a push of ``size_bytes`` (default: expected size) should take, without safety or overhead."""
        size = self.expected_size_bytes if size_bytes is None else size_bytes
        return size / self.push_bytes_per_s

    def secure_estimate_s(self, size_bytes: float | None = None) -> float:
        """Seconds a push of a checkpoint of ``size_bytes`` (default: the expected size) already on disk costs, as
        the securing plan compares it with the time left (the supersede rule, the reserve of a fallback push).

        Before any measured push: the guess ``size / push throughput x safety_factor + overhead_s``. Once a push
        was measured (:meth:`observe_push_cost`): what pushes really cost, ``max over recent pushes of
        duration x max(1, size / their size) x safety_factor`` (the fixed costs are in the measured durations,
        so ``overhead_s`` is not added again: with it a folder push of 2 s was counted 18 s and a newer checkpoint
        with 17 s left was not secured), lowered to no less than ``MIN_PUSH_COST_S`` (1 s) and never above the
        guess with the measured throughput; a push running slower than that throughput (``observe_push_progress``)
        raises it. Securing still ends before the kill whatever this says: every push is killed at ``secure_by``.
        """
        size = self.expected_size_bytes if size_bytes is None else size_bytes
        guess_s = self.push_estimate_s(size) * self.safety_factor + self.overhead_s
        if not self._push_costs:
            return guess_s
        measured_s = max(duration * max(1.0, size / seen) for duration, seen in self._push_costs)
        if self._running_bound is not None:
            measured_s = max(measured_s, size / self._running_bound)
        return min(max(measured_s * self.safety_factor, MIN_PUSH_COST_S), guess_s)

    def estimate(self) -> MarginEstimate:
        """The current margin with its parts (see :class:`MarginEstimate`)."""
        size = self.expected_size_bytes
        step_s = max(self._steps, default=0.0)
        save_s, push_s = self.save_estimate_s(size), self.push_estimate_s(size)
        if self.fixed_margin_s is not None:
            return MarginEstimate(self.fixed_margin_s, step_s, save_s, push_s, size, self.push_bytes_per_s,
                                  self.safety_factor, fixed=True, size_source=self.size_source)
        raw_s = (step_s + save_s + push_s) * self.safety_factor + self.overhead_s
        margin_s = max(raw_s, self.floor_s)
        capped = False
        if self.max_margin_s is not None and margin_s > self.max_margin_s:
            margin_s, capped = self.max_margin_s, True
        return MarginEstimate(margin_s, step_s, save_s, push_s, size, self.push_bytes_per_s,
                              self.safety_factor, floored=raw_s < self.floor_s, overhead_s=self.overhead_s,
                              capped_s=self.max_margin_s if capped else None, size_source=self.size_source)

    def margin_s(self) -> float:
        """Seconds to keep free before the deadline for the final step, save and push."""
        margin = self.estimate()
        if self._logged_margin_s is None and self.log_changes:
            self._log(margin)
        return margin.margin_s

    def _maybe_log(self) -> None:
        if not self.log_changes:
            return
        margin = self.estimate()
        last = self._logged_margin_s
        if last is None or abs(margin.margin_s - last) > max(MARGIN_LOG_MIN_S, MARGIN_LOG_SHARE * last):
            self._log(margin)

    def _log(self, margin: MarginEstimate) -> None:
        self._logged_margin_s = margin.margin_s
        log.info("%s", margin.describe())


def _ok(value: float) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value >= 0


# ---------------------------------------------------------------------------------------------------------------
# Plan: when to ask, how long to wait
# ---------------------------------------------------------------------------------------------------------------


def margin_bounds(deadline: Deadline, *, floor_s: float = 60.0) -> tuple[float, float | None]:
    """The automatic margin's floor and cap for a deadline, in seconds: ``(floor_s, max_margin_s)``.

    The same for every source of the budget (``--timeout``, ``SLURM_JOB_END_TIME``, ``scontrol``): without a
    budget, ``(floor_s, None)``; with one, the margin is capped at half of it, and the floor is a quarter of it at
    most. An exact end time (``Deadline.exact``) needs no floor (0): the floor stands for an end known only to about
    a minute, and what remains is the measured step, save and push times with the safety factor and overhead.

    Args:
        deadline: the job's deadline (:func:`resolve_deadline`, or one moved by ``Deadline.refreshed``).
        floor_s: the floor for an end not known exactly (default 60).
    """
    if deadline.timeout_s is None:
        return floor_s, None
    budget_s = max(deadline.timeout_s, 0.0)
    return (0.0 if deadline.exact else min(floor_s, 0.25 * budget_s)), 0.5 * budget_s


def checkpoint_due(now_s: float, deadline: Deadline, margin_s: float) -> bool:
    """True once ``now_s`` (epoch seconds) is within ``margin_s`` of the deadline; never without a deadline."""
    return deadline.deadline_s is not None and now_s >= deadline.deadline_s - margin_s
