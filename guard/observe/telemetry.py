"""What a long run is doing, in the log: the heartbeat, the projection against the deadline, progress lines.

The supervisor's loop drives a :class:`Heartbeat` with its own clock: ``on_step`` for every training step (cheap,
no I/O), ``tick`` when ``due_at`` has come. Every ``--heartbeat`` seconds ``tick`` logs one line::

    [guard] heartbeat step=1200/5000 loss=2.31 steps/s=3.4 left=1h02m eta=19m07s gpu0=97%,61.2/79.6GiB,71C
    tree_rss=12.3GiB cgroup=14.0/64.0GiB

(host memory under 1 GiB in MiB: ``tree_rss=850MiB cgroup=900MiB/unlimited``)

(one line in the log). When the step rate and ``max_steps`` say the run cannot reach its last step before the
guard secures a checkpoint (``deadline - margin``), one warning says so, as soon as the rate is measured.

GPU figures come from NVML (``nvidia-ml-py``, module ``pynvml``; ``shared/reference/platform.md`` section 4):
``nvmlDeviceGetUtilizationRates(h).gpu`` (percent of the last sample period the GPU was busy),
``nvmlDeviceGetMemoryInfo(h).used/.total`` (bytes), ``nvmlDeviceGetTemperatureV(h, NVML_TEMPERATURE_GPU)``
(degrees C; older drivers: ``nvmlDeviceGetTemperature``), for the devices ``CUDA_VISIBLE_DEVICES`` selects
(NVML ignores that variable: entries are mapped by index or ``GPU-``/``MIG-`` UUID, and CUDA stops at the first
entry that names no device). Host memory is the job tree's RSS (``process.JobProcess.sample``) and its cgroup's
usage and limit (``process.cgroup_memory``), not the host's.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from guard.core.cgroup import CgroupMemory
from guard.core.durations import format_duration_s

if TYPE_CHECKING:
    from guard.contract import RunResult
    from guard.core.helpers import Helpers, Pending
    from guard.core.masking import Masker
    from guard.observe.alerts import Alerts

__all__ = ["GpuSample", "GpuSampler", "Heartbeat", "Progress", "Snapshot", "StepRate", "Tracker", "fmt_duration"]

log = logging.getLogger("guard.telemetry")

GIB = 1024**3
CHECK_EVERY_S = 1.0  # the projection is checked on a step at most this often
_LIBRARY_NOT_FOUND, _DRIVER_NOT_LOADED, _VERSION_MISMATCH, _GPU_IS_LOST = 12, 9, 18, 15  # NVML_ERROR_* (pynvml)


def fmt_duration(seconds: float) -> str:
    """A duration for telemetry lines, in ``run.config.format_duration_s``'s form at a coarser grain: whole
    minutes from an hour up (``3720`` -> ``"1h2m"``), whole seconds below (``1147`` -> ``"19m7s"``)."""
    total = round(max(0.0, seconds))
    return format_duration_s(total - total % 60 if total >= 3600 else total)


def _gib(size_bytes: float) -> str:
    return f"{size_bytes / GIB:.1f}"


def _mem(size_bytes: float) -> str:
    """Host memory for the line: ``"12.3GiB"``, or ``"850MiB"`` under 1 GiB."""
    return f"{_gib(size_bytes)}GiB" if size_bytes >= GIB else f"{size_bytes / 1024**2:.0f}MiB"


# ---------------------------------------------------------------------------------------------------------------
# Step rate
# ---------------------------------------------------------------------------------------------------------------


class StepRate:
    """Training steps per second over a sliding window of ``(time, step)`` points.

    Args:
        window_s: how far back the rate looks (seconds); older points are dropped, so warm-up and a changed
            speed fade out. Default 300.
        spacing_s: points closer than this are merged into one (bounds memory at high step rates). Default 1.
    """

    def __init__(self, window_s: float = 300.0, spacing_s: float = 1.0) -> None:
        self.window_s = window_s
        self.spacing_s = spacing_s
        self.points: deque[tuple[float, int]] = deque()
        self.latest: tuple[float, int] | None = None

    def add(self, now: float, step: int) -> None:
        """Record that ``step`` was reached at ``now`` (monotonic seconds). A step going back resets the window."""
        if self.latest is not None and step < self.latest[1]:
            self.points.clear()
        self.latest = (now, step)
        if not self.points or now - self.points[-1][0] >= self.spacing_s:
            self.points.append((now, step))
        while len(self.points) > 2 and self.points[1][0] <= now - self.window_s:
            self.points.popleft()

    def span_s(self) -> float:
        """Seconds the window covers (0 with fewer than two points)."""
        if not self.points or self.latest is None:
            return 0.0
        return self.latest[0] - self.points[0][0]

    def steps_per_s(self) -> float | None:
        """Steps per second over the window; None until two points lie apart in time."""
        span = self.span_s()
        if span <= 0 or self.latest is None:
            return None
        return (self.latest[1] - self.points[0][1]) / span


# ---------------------------------------------------------------------------------------------------------------
# GPUs through NVML
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuSample:
    """One GPU at one heartbeat; a figure NVML could not give is None.

    Attributes:
        label: ``gpu0``, ``gpu1`` ... in the order the job sees them (CUDA ordinals).
        utilization_pct: ``nvmlDeviceGetUtilizationRates(h).gpu``, 0-100.
        memory_used_bytes, memory_total_bytes: ``nvmlDeviceGetMemoryInfo(h)``.
        temperature_c: GPU core temperature in degrees Celsius.
        error: why the device gave no figures at all (``"lost"`` for ``NVML_ERROR_GPU_IS_LOST``), else None.
    """

    label: str
    utilization_pct: int | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    temperature_c: int | None = None
    error: str | None = None

    def text(self) -> str:
        """``"97%,61.2/79.6GiB,71C"`` (``?`` for a missing figure)."""
        if self.error:
            return self.error
        util = f"{self.utilization_pct}%" if self.utilization_pct is not None else "?%"
        used = _gib(self.memory_used_bytes) if self.memory_used_bytes is not None else "?"
        total = _gib(self.memory_total_bytes) if self.memory_total_bytes is not None else "?"
        temp = f"{self.temperature_c}C" if self.temperature_c is not None else "?C"
        return f"{util},{used}/{total}GiB,{temp}"


class GpuSampler:
    """Reads the job's GPUs through NVML. NVML is opened once, at the first ``sample``; if it cannot be opened,
    ``reason`` says why and it is never retried.

    Args:
        environ: the job's environment (``CUDA_VISIBLE_DEVICES``); default ``os.environ``.
        nvml: the ``pynvml`` module or a stand-in with the same functions; None imports ``pynvml``.
    """

    def __init__(self, *, environ: Mapping[str, str] | None = None, nvml: Any = None) -> None:
        self.environ = environ if environ is not None else os.environ
        self.nvml = nvml
        self.reason: str | None = None
        self.devices: list[tuple[str, Any]] | None = None
        self._opened = False

    def _open(self) -> None:
        self.devices = []
        if self.nvml is None:
            try:
                import pynvml
            except ImportError:
                self.reason = "nvidia-ml-py not installed"
                return
            self.nvml = pynvml
        nvml = self.nvml
        error = getattr(nvml, "NVMLError", Exception)
        try:
            nvml.nvmlInit()
        except error as exc:
            code = getattr(exc, "value", -1)
            self.reason = {_LIBRARY_NOT_FOUND: "no NVIDIA driver: NVML library not found",
                           _DRIVER_NOT_LOADED: "NVIDIA driver not loaded",
                           _VERSION_MISMATCH: "NVIDIA driver/library version mismatch"}.get(code, f"NVML: {exc}")
            return
        except OSError as exc:
            self.reason = f"NVML could not be loaded: {exc}"
            return
        self._opened = True
        try:
            count = int(nvml.nvmlDeviceGetCount())
            self.devices = self._select(count)
        except error as exc:
            self.reason = f"NVML: {exc}"
            self.devices = []
            return
        if not self.devices and self.reason is None:
            self.reason = "no GPU visible" + (" (CUDA_VISIBLE_DEVICES)" if "CUDA_VISIBLE_DEVICES" in self.environ
                                              else "")

    def _select(self, count: int) -> list[tuple[str, Any]]:
        nvml = self.nvml
        text = self.environ.get("CUDA_VISIBLE_DEVICES")
        if text is None:
            return [(f"gpu{i}", nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(count)]
        handles: list[tuple[str, Any]] = []
        for entry in (part.strip() for part in text.split(",") if part.strip()):
            handle = None
            if entry.isdigit():
                handle = nvml.nvmlDeviceGetHandleByIndex(int(entry)) if int(entry) < count else None
            else:
                for i in range(count):
                    candidate = nvml.nvmlDeviceGetHandleByIndex(i)
                    uuid = nvml.nvmlDeviceGetUUID(candidate)
                    uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
                    if uuid.startswith(entry):
                        handle = candidate
                        break
                if handle is None and entry.startswith("MIG-"):
                    try:
                        handle = nvml.nvmlDeviceGetHandleByUUID(entry)
                    except Exception:  # noqa: BLE001 - any NVML error: no such device
                        handle = None
            if handle is None:
                break  # CUDA ignores this entry and every one after it
            handles.append((f"gpu{len(handles)}", handle))
        return handles

    def sample(self) -> list[GpuSample] | None:
        """One sample per visible GPU; None when NVML gives nothing (see ``reason``)."""
        if self.devices is None:
            self._open()
        if not self.devices:
            return None
        return [self._one(label, handle) for label, handle in self.devices]

    def _one(self, label: str, handle: Any) -> GpuSample:
        nvml = self.nvml
        error = getattr(nvml, "NVMLError", Exception)

        def query(name: str, *args: Any) -> Any:
            func = getattr(nvml, name, None)
            if func is None:
                return None
            try:
                return func(handle, *args)
            except error as exc:
                if getattr(exc, "value", None) == _GPU_IS_LOST:
                    raise
                return None

        try:
            util = query("nvmlDeviceGetUtilizationRates")
            memory = query("nvmlDeviceGetMemoryInfo")
            sensor = int(getattr(nvml, "NVML_TEMPERATURE_GPU", 0))
            temp = query("nvmlDeviceGetTemperatureV", sensor)
            if temp is None:
                temp = query("nvmlDeviceGetTemperature", sensor)
        except error:
            return GpuSample(label, error="lost")
        return GpuSample(
            label,
            utilization_pct=int(util.gpu) if util is not None else None,
            memory_used_bytes=int(memory.used) if memory is not None else None,
            memory_total_bytes=int(memory.total) if memory is not None else None,
            temperature_c=int(temp) if temp is not None else None,
        )

    def close(self) -> None:
        """Shut NVML down if this sampler opened it."""
        if self._opened:
            self._opened = False
            try:
                self.nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001 - shutting down; nothing to do about it
                pass


# ---------------------------------------------------------------------------------------------------------------
# The heartbeat
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Snapshot:
    """Memory figures the supervisor has at a heartbeat.

    Attributes:
        tree_rss_bytes: resident memory of the job's process tree (``JobProcess.last_rss_bytes``), or None.
        cgroup: the job's cgroup memory (``process.cgroup_memory()``), or None outside a cgroup.
    """

    tree_rss_bytes: int | None = None
    cgroup: CgroupMemory | None = None


#: How long a heartbeat waits for the GPU figures read on the helper thread before it is written without them (s).
GPU_WAIT_S = 2.0


class Tracker(Protocol):
    """Where the heartbeat's figures also go (``guard.observe.tracking.TrackioSink``)."""

    def log(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Record ``metrics`` at ``step``."""

    def alert(self, title: str, text: str | None = None, level: str = "warn", step: int | None = None) -> None:
        """Raise an alert."""

    def finish(self, result: RunResult | None = None) -> None:
        """Record the verdict."""

    def close(self, timeout_s: float = 5.0) -> bool:
        """Flush within ``timeout_s``; True when everything was written."""


class Heartbeat:
    """One ``[guard] heartbeat`` line every ``interval_s``, and the projection against the deadline.

    Args:
        interval_s: seconds between heartbeats (``--heartbeat``); 0 or less turns heartbeats off (the projection
            warning still works).
        clock: monotonic seconds (the supervisor's clock). wall: epoch seconds.
        deadline_s: returns the deadline, epoch seconds, or None without a limit (a callable: Slurm may move it).
        margin_s: returns the seconds the guard keeps before the deadline to save and push (default 0).
        gpus: a :class:`GpuSampler`; None makes one for ``os.environ``.
        tracker: where figures also go (a ``tracking.TrackioSink`` or anything with ``log(metrics, step)`` and
            ``alert(title, text, level, step)``), or None.
        window_s: the step-rate window (seconds). min_span_s: the rate counts for the projection once its window
            covers this long (so the first slow steps do not cry wolf); default 60.
        helpers: a ``guard.core.helpers.Helpers`` that reads the GPUs (NVML) on its worker thread, so that
            ``tick`` never waits for NVML: when a beat is due it starts the read and returns None; the line comes
            once the read finished (``due_at`` says when to look again), or after ``GPU_WAIT_S`` without GPU
            figures. None (default): NVML is read inside ``tick``.
        alerts: the run's alerts (``guard.observe.alerts.Alerts``), or None; the supervisor reaches them through
            :meth:`on_outcome` and :meth:`observe`.

    Figures for the tracker at each beat: ``guard/steps_per_s``, ``guard/step_time_s``, ``guard/left_s`` and
    ``guard/margin_s`` (with a deadline), ``guard/eta_s``, ``guard/secured_step``, per GPU ``guard/gpuN_util_pct``,
    ``_mem_used_gib``, ``_temp_c`` (NVML; without it one ``jobguard/gpu`` report says why: n/a),
    ``guard/tree_rss_gib``, ``guard/cgroup_gib``, ``guard/cgroup_limit_gib``; the loss at each step (``loss``).
    """

    def __init__(self, interval_s: float, *, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, deadline_s: Callable[[], float | None] = lambda: None,
                 margin_s: Callable[[], float] = lambda: 0.0, gpus: GpuSampler | None = None,
                 tracker: Tracker | None = None, window_s: float = 300.0, min_span_s: float = 60.0,
                 helpers: Helpers | None = None, alerts: Alerts | None = None) -> None:
        self.helpers = helpers
        self.alerts = alerts
        self._gpu_na_said = False
        self._gpu_read: Pending[list[GpuSample] | None] | None = None  # gpus.sample() on the helper thread
        self._gpu_read_since = 0.0
        self.interval_s = interval_s
        self.clock, self.wall = clock, wall
        self.deadline_s, self.margin_s = deadline_s, margin_s
        self.gpus = gpus if gpus is not None else GpuSampler()
        self.tracker = tracker
        self.rate = StepRate(window_s)
        self.min_span_s = min_span_s
        self.max_steps: int | None = None
        self.step: int | None = None
        self.loss: float | None = None
        self.warned = False
        self.next_check = -math.inf
        self.next_beat = clock() + interval_s if interval_s > 0 else math.inf
        self.last_figures: dict[str, float] = {}
        self.saves = 0
        self.newest_save: str | None = None

    def on_save(self, path: str) -> None:
        """The job finished saving a checkpoint (counted in the next heartbeat as ``saves=N(newest NAME)``)."""
        self.saves += 1
        self.newest_save = os.path.basename(os.path.normpath(path)) or path

    def set_max_steps(self, max_steps: Any) -> None:
        """The run's last step (the Trainer's ``state.max_steps``); ignored unless a positive integer."""
        if isinstance(max_steps, int) and not isinstance(max_steps, bool) and max_steps > 0:
            self.max_steps = max_steps

    def due_at(self) -> float:
        """When ``tick`` next has work (monotonic seconds; ``inf`` with heartbeats off)."""
        if self._gpu_read is not None:
            return self._gpu_read_since if self._gpu_read.done() else self._gpu_read_since + GPU_WAIT_S
        return self.next_beat

    def on_step(self, now: float, step: int | None, loss: float | None) -> str | None:
        """A training step (from the primary rank). Cheap: no I/O unless the projection warning fires.

        Returns:
            The projection warning when it fires (once per run), else None.
        """
        if step is not None:
            self.step = int(step)
            self.rate.add(now, self.step)
        self.loss = loss
        if self.tracker is not None and loss is not None and self.step is not None:
            self.tracker.log({"loss": loss}, step=self.step)
        if self.alerts is not None and step is not None:
            self.alerts.on_rate(now, int(step))
        return self._check_projection(now)

    def on_outcome(self, outcome: Any, progress: Any, world_size: int = 1) -> None:
        """The guard decided (``state.Outcome``): its alert (see ``alerts.Alerts.on_outcome``)."""
        if self.alerts is not None:
            self.alerts.on_outcome(outcome, progress, world_size)

    def observe(self, now: float, progress: Any, plan: Any = None) -> None:
        """After a step or a timer turn: the watchdog's warnings (``state.Progress``) and the securing plan
        (``secure.plan.Plan``, or None) become alerts; the newest secured step feeds the heartbeat."""
        if self.alerts is None:
            return
        self.alerts.on_progress(now, progress)
        if plan is not None:
            self.alerts.on_securing(plan, self.step)

    def projection(self, now: float) -> dict[str, float] | None:
        """``{"steps_per_s", "eta_s", "left_s", "stop_in_s", "reach_step"}`` (the last three only with a
        deadline); None while the rate is unknown, zero, or ``max_steps``/``step`` unknown."""
        rate = self.rate.steps_per_s()
        if not rate or rate <= 0 or self.max_steps is None or self.step is None:
            return None
        result = {"steps_per_s": rate, "eta_s": max(0, self.max_steps - self.step) / rate}
        deadline = self.deadline_s()
        if deadline is not None:
            left = deadline - self.wall()
            stop_in = left - self.margin_s()
            result.update(left_s=left, stop_in_s=stop_in, reach_step=self.step + rate * max(0.0, stop_in))
        return result

    def _check_projection(self, now: float) -> str | None:
        if self.warned or now < self.next_check or self.rate.span_s() < self.min_span_s:
            return None
        self.next_check = now + CHECK_EVERY_S
        proj = self.projection(now)
        if proj is None or "stop_in_s" not in proj or proj["eta_s"] <= proj["stop_in_s"]:
            return None
        self.warned = True
        secure_at = time.strftime("%H:%M:%S", time.localtime(self.wall() + max(0.0, proj["stop_in_s"])))
        text = (f"at {proj['steps_per_s']:.3g} steps/s the run reaches step {int(proj['reach_step'])} of "
                f"{self.max_steps} by the deadline: it will not finish (it needs {fmt_duration(proj['eta_s'])}, "
                f"{fmt_duration(proj['stop_in_s'])} are left before the guard secures a checkpoint at {secure_at}, "
                f"margin {fmt_duration(self.margin_s())})")
        log.warning("%s", text)
        if self.alerts is not None:
            self.alerts.warning("projection", "the run will not finish before the deadline", text, step=self.step)
        elif self.tracker is not None:
            self.tracker.alert("run will not finish before the deadline", text, "warn", step=self.step)
        return text

    def tick(self, now: float, snap: Snapshot) -> str | None:
        """When due, build, log and return the heartbeat line (without the ``[guard] `` prefix); else None."""
        if now < self.next_beat:
            return None
        samples, slow = None, False
        if self.helpers is not None:  # NVML off the loop
            if self._gpu_read is None:
                self._gpu_read, self._gpu_read_since = self.helpers.submit(self.gpus.sample), now
                return None
            if not self._gpu_read.done() and now < self._gpu_read_since + GPU_WAIT_S:
                return None
            slow = not self._gpu_read.done()
            samples, self._gpu_read = self._gpu_read.result(), None
        else:
            samples = self.gpus.sample()
        self.next_beat = now + self.interval_s
        figures: dict[str, float] = {}
        parts = ["heartbeat"]
        step = "-" if self.step is None else str(self.step)
        parts.append(f"step={step}" + (f"/{self.max_steps}" if self.max_steps is not None else ""))
        parts.append(f"loss={self.loss:.4g}" if self.loss is not None else "loss=-")
        rate = self.rate.steps_per_s()
        parts.append(f"steps/s={rate:.3g}" if rate is not None else "steps/s=-")
        if rate is not None:
            figures["guard/steps_per_s"] = rate
            if rate > 0:
                figures["guard/step_time_s"] = 1.0 / rate
        deadline = self.deadline_s()
        if deadline is not None:
            left = deadline - self.wall()
            parts.append(f"left={fmt_duration(left)}")
            figures["guard/left_s"] = left
            figures["guard/margin_s"] = self.margin_s()
        proj = self.projection(now)
        if proj is not None:
            parts.append(f"eta={fmt_duration(proj['eta_s'])}")
            figures["guard/eta_s"] = proj["eta_s"]
        if self.saves:
            parts.append(f"saves={self.saves}({self.newest_save})")
        secured = self.alerts.secured_step if self.alerts is not None else None
        if secured is not None:
            parts.append(f"secured=step{secured}")
            figures["guard/secured_step"] = secured
        if samples is None:
            why = f"no answer within {GPU_WAIT_S:g}s" if slow else self.gpus.reason
            parts.append(f"gpu=n/a({why})")
            report = getattr(self.tracker, "report", None)
            if report is not None and not self._gpu_na_said:
                self._gpu_na_said = True
                report("jobguard/gpu", f"GPU memory and utilisation: n/a ({why})", step=self.step)
        for gpu in samples or []:
            parts.append(f"{gpu.label}={gpu.text()}")
            for key, value in (("util_pct", gpu.utilization_pct), ("temp_c", gpu.temperature_c),
                               ("mem_used_gib", None if gpu.memory_used_bytes is None
                                else gpu.memory_used_bytes / GIB)):
                if value is not None:
                    figures[f"guard/{gpu.label}_{key}"] = value
        if snap.tree_rss_bytes is not None:
            parts.append(f"tree_rss={_mem(snap.tree_rss_bytes)}")
            figures["guard/tree_rss_gib"] = snap.tree_rss_bytes / GIB
        cgroup = snap.cgroup
        if cgroup is not None and cgroup.current_bytes is not None:
            used = _mem(cgroup.current_bytes)
            if cgroup.limit_bytes is None:
                parts.append(f"cgroup={used}/unlimited")
            elif cgroup.current_bytes >= GIB and cgroup.limit_bytes >= GIB:
                parts.append(f"cgroup={_gib(cgroup.current_bytes)}/{_mem(cgroup.limit_bytes)}")
            else:
                parts.append(f"cgroup={used}/{_mem(cgroup.limit_bytes)}")
            figures["guard/cgroup_gib"] = cgroup.current_bytes / GIB
            if cgroup.limit_bytes is not None:
                figures["guard/cgroup_limit_gib"] = cgroup.limit_bytes / GIB
        line = " ".join(parts)
        log.info("%s", line)
        self.last_figures = figures
        if self.tracker is not None and figures and self.step is not None:
            self.tracker.log(figures, step=self.step)
        self._check_projection(now)
        return line

    def close(self) -> None:
        """Release NVML."""
        self.gpus.close()


# ---------------------------------------------------------------------------------------------------------------
# Progress of long guard work
# ---------------------------------------------------------------------------------------------------------------


class Progress:
    """Progress lines for long guard work (a push, a network check), at most one every ``every_s``.

    ``[guard] pushing checkpoint-500: 1.2/4.8 GB (25%), 85.0 MB/s, ~42s left``; while no bytes are counted,
    ``[guard] pushing checkpoint-500 (4.8 GB): still running (20s)``; the closing line (``done``) gives the size
    and the mean rate. Safe to call from a worker thread.

    Args:
        what: what is going on, for humans.
        total_bytes: the size of the work in bytes, or None when unknown.
        clock: monotonic seconds. every_s: the least time between two lines (default 10).
        logger: where the lines go (default ``guard.observe.telemetry``).
    """

    def __init__(self, what: str, total_bytes: int | None = None, *, clock: Callable[[], float] = time.monotonic,
                 every_s: float = 10.0, logger: logging.Logger | None = None) -> None:
        self.what, self.total_bytes = what, total_bytes
        self.clock, self.every_s = clock, every_s
        self.log = logger or log
        self.started = clock()
        self.next_line = self.started + every_s
        self.done_bytes = 0

    def _text(self, now: float) -> str:
        elapsed = max(now - self.started, 1e-9)
        if not self.done_bytes:  # nothing counted (yet): say that it is still going
            size = f" ({self.total_bytes / 1e9:.1f} GB)" if self.total_bytes else ""
            return f"{self.what}{size}: still running ({fmt_duration(elapsed)})"
        rate = self.done_bytes / elapsed
        text = f"{self.what}: {self.done_bytes / 1e9:.1f}"
        if self.total_bytes:
            share = 100.0 * self.done_bytes / self.total_bytes
            text += f"/{self.total_bytes / 1e9:.1f} GB ({share:.0f}%), {rate / 1e6:.1f} MB/s"
            if rate > 0 and self.done_bytes < self.total_bytes:
                text += f", ~{fmt_duration((self.total_bytes - self.done_bytes) / rate)} left"
        else:
            text += f" GB, {rate / 1e6:.1f} MB/s"
        return text

    def update(self, done_bytes: int | None = None) -> str | None:
        """Record progress (bytes done so far, or None for "still working"); logs and returns a line when due."""
        if done_bytes is not None:
            self.done_bytes = done_bytes
        now = self.clock()
        if now < self.next_line:
            return None
        self.next_line = now + self.every_s
        text = self._text(now)
        self.log.info("%s", text)
        return text

    def done(self, done_bytes: int | None = None) -> str:
        """The closing line: ``"pushing checkpoint-500: 4.8 GB in 57s (84.2 MB/s)"``."""
        if done_bytes is not None:
            self.done_bytes = done_bytes
        elapsed = max(self.clock() - self.started, 1e-9)
        if self.done_bytes:
            text = (f"{self.what}: {self.done_bytes / 1e9:.1f} GB in {fmt_duration(elapsed)} "
                    f"({self.done_bytes / elapsed / 1e6:.1f} MB/s)")
        else:
            text = f"{self.what}: done in {fmt_duration(elapsed)}"
        self.log.info("%s", text)
        return text


def follow_trainer(heartbeat: Heartbeat, config: Mapping[str, Any], masker: Masker) -> None:
    """When the Trainer's arguments arrive: its ``max_steps`` for the projection, and its own trackio project
    (``report_to`` trackio) as the tracker when ``--trackio`` gave none."""
    from guard.observe.tracking import TrackioSink, trainer_trackio_target

    heartbeat.set_max_steps(config.get("max_steps"))
    target = trainer_trackio_target(config)
    if heartbeat.tracker is None and target is not None:
        log.info("the job reports to trackio project %s: the guard logs its figures and verdict there too",
                 target["project"])
        heartbeat.tracker = TrackioSink(str(target["project"]), run_name=target["run_name"] or "jobguard",
                                        space_id=target["space_id"], mask=masker.mask_text)


def close_with_verdict(heartbeat: Heartbeat, result: RunResult, deadline_s: float | None,
                       wall: Callable[[], float] = time.time) -> None:
    """End the heartbeat; put the verdict into the tracker, within the time left before a kill.

    A local trackio write takes milliseconds; the wait is at most 5 s, 1 s after a termination signal (the
    platform's SIGKILL follows within ``--grace``), and never past 2 s before the deadline.
    """
    heartbeat.close()
    tracker = heartbeat.tracker
    if tracker is None:
        if heartbeat.alerts is not None:
            heartbeat.alerts.close()
        return
    limit_s = 5.0
    if result.status == "INTERRUPTED":
        limit_s = 1.0
    elif result.status == "TIMEOUT" and deadline_s:
        limit_s = max(0.1, min(limit_s, deadline_s - wall() - 2.0))
    tracker.finish(result)
    if not tracker.close(timeout_s=limit_s):
        log.warning("trackio did not finish within %.0fs; the verdict may be missing there", limit_s)
    if heartbeat.alerts is not None:  # the verdict's POST (and others in flight): alerts.WEBHOOK_WAIT_S
        heartbeat.alerts.close()
