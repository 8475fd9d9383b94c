"""The heartbeat, the step rate, the projection warning, GPU figures and progress lines.

Time is driven by a fake clock; NVML by a scripted stand-in that raises the real ``pynvml.NVMLError`` classes.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from guard.observe.telemetry import GpuSample, GpuSampler, Heartbeat, Progress, Snapshot, StepRate, fmt_duration
from guard.run.process import CgroupMemory, JobProcess, cgroup_memory

GIB = 1024**3
WALL0 = 1_800_000_000.0  # epoch seconds at clock 0


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def wall(self) -> float:
        return WALL0 + self.now


@dataclass
class FakeGpu:
    uuid: str
    util: int = 97
    used: int = int(61.2 * GIB)
    total: int = int(79.6 * GIB)
    temp: int = 71
    lost: bool = False
    temp_v_missing: bool = False


class FakeNvml:
    """The NVML calls the sampler makes, driven by ``FakeGpu`` records."""

    NVMLError = pynvml.NVMLError
    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU

    def __init__(self, gpus: list[FakeGpu] | None = None, *, init_error: int | None = None) -> None:
        self.gpus = gpus if gpus is not None else [FakeGpu("GPU-aaaa-0000")]
        self.init_error = init_error
        self.inits = 0
        self.shutdowns = 0

    def nvmlInit(self) -> None:
        self.inits += 1
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        return self.gpus[index]

    def nvmlDeviceGetUUID(self, gpu: FakeGpu) -> str:
        return gpu.uuid

    def _dev(self, gpu: FakeGpu) -> FakeGpu:
        if gpu.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return gpu

    def nvmlDeviceGetUtilizationRates(self, gpu: FakeGpu) -> Any:
        return SimpleNamespace(gpu=self._dev(gpu).util, memory=40)

    def nvmlDeviceGetMemoryInfo(self, gpu: FakeGpu) -> Any:
        gpu = self._dev(gpu)
        return SimpleNamespace(used=gpu.used, total=gpu.total, free=gpu.total - gpu.used)

    def nvmlDeviceGetTemperatureV(self, gpu: FakeGpu, sensor: int) -> int:
        if self._dev(gpu).temp_v_missing:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return gpu.temp

    def nvmlDeviceGetTemperature(self, gpu: FakeGpu, sensor: int) -> int:
        return self._dev(gpu).temp - 1  # tells which call answered


class Recorder:
    """A tracker stand-in: remembers what the heartbeat sends."""

    def __init__(self) -> None:
        self.logs: list[tuple[dict[str, Any], int | None]] = []
        self.alerts: list[tuple[str, str | None, str, int | None]] = []

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        self.logs.append((dict(metrics), step))

    def alert(self, title: str, text: str | None = None, level: str = "warn", step: int | None = None) -> None:
        self.alerts.append((title, text, level, step))


def make_heartbeat(clock: FakeClock, *, interval_s: float = 10.0, deadline_in_s: float | None = None,
                   margin_s: float = 0.0, nvml: Any = None, environ: dict[str, str] | None = None,
                   tracker: Any = None, min_span_s: float = 60.0) -> Heartbeat:
    deadline = None if deadline_in_s is None else WALL0 + deadline_in_s
    gpus = GpuSampler(environ=environ or {}, nvml=nvml if nvml is not None else FakeNvml())
    return Heartbeat(interval_s, clock=clock, wall=clock.wall, deadline_s=lambda: deadline,
                     margin_s=lambda: margin_s, gpus=gpus, tracker=tracker, min_span_s=min_span_s)


def run_steps(hb: Heartbeat, clock: FakeClock, first: int, last: int, step_s: float, loss: float = 2.5) -> list[str]:
    warnings = []
    for step in range(first, last + 1):
        clock.now += step_s
        text = hb.on_step(clock.now, step, loss)
        if text:
            warnings.append(text)
    return warnings


# ---------------------------------------------------------------------------------------------------------------
# Small pieces
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("seconds", "text"), [(0, "0s"), (45, "45s"), (90, "1m30s"), (1147, "19m7s"),
                                               (3720, "1h2m"), (90000, "1d1h"), (-5, "0s")])
def test_fmt_duration(seconds: float, text: str) -> None:
    assert fmt_duration(seconds) == text


def test_step_rate_over_the_window() -> None:
    rate = StepRate(window_s=100.0, spacing_s=1.0)
    assert rate.steps_per_s() is None
    rate.add(0.0, 0)
    assert rate.steps_per_s() is None  # one point: no rate yet
    for i in range(1, 51):  # 2 steps/s for 50 s
        rate.add(i * 1.0, 2 * i)
    assert rate.steps_per_s() == pytest.approx(2.0)
    for i in range(51, 251):  # then 4 steps/s for 200 s: the old speed leaves the window
        rate.add(i * 1.0, 100 + 4 * (i - 50))
    assert rate.steps_per_s() == pytest.approx(4.0)
    assert rate.span_s() == pytest.approx(100.0, abs=1.0)


def test_step_rate_merges_close_points_and_resets_on_a_step_back() -> None:
    rate = StepRate(window_s=1000.0, spacing_s=1.0)
    for i in range(1000):  # 100 steps/s: points are kept one per second, the rate uses the newest step
        rate.add(i * 0.01, i)
    assert len(rate.points) <= 11
    assert rate.steps_per_s() == pytest.approx(100.0)
    rate.add(20.0, 5)  # a restart from an earlier checkpoint
    assert rate.steps_per_s() is None
    rate.add(22.0, 9)
    assert rate.steps_per_s() == pytest.approx(2.0)


# ---------------------------------------------------------------------------------------------------------------
# The heartbeat line
# ---------------------------------------------------------------------------------------------------------------


def test_heartbeat_line_content(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    nvml = FakeNvml([FakeGpu("GPU-aaaa-0000", util=10), FakeGpu("GPU-bbbb-1111")])
    tracker = Recorder()
    hb = make_heartbeat(clock, interval_s=30.0, deadline_in_s=3600.0 + 30.0, nvml=nvml,
                        environ={"CUDA_VISIBLE_DEVICES": "GPU-bbbb"}, tracker=tracker)
    hb.set_max_steps(5000)
    assert hb.due_at() == 30.0
    snap = Snapshot(tree_rss_bytes=int(12.3 * GIB), cgroup=CgroupMemory(64 * GIB, 14 * GIB, 0))
    for step in range(1, 60):  # 2 steps/s
        clock.now += 0.5
        hb.on_step(clock.now, step, 2.5 - step / 100)
    assert hb.tick(clock.now, snap) is None  # 29.5: not due yet
    clock.now = 30.0
    hb.on_step(clock.now, 60, 1.9)
    with caplog.at_level(logging.INFO, logger="guard.telemetry"):
        line = hb.tick(clock.now, snap)
    # 4940 steps left at 2 steps/s; CUDA_VISIBLE_DEVICES selects the second GPU, which the job sees as gpu0
    assert line == ("heartbeat step=60/5000 loss=1.9 steps/s=2 left=1h eta=41m10s gpu0=97%,61.2/79.6GiB,71C "
                    "tree_rss=12.3GiB cgroup=14.0/64.0GiB")
    assert [r.getMessage() for r in caplog.records if r.name == "guard.telemetry"] == [line]
    assert hb.due_at() == 60.0
    assert hb.tick(45.0, snap) is None
    figures, step = tracker.logs[-1]
    assert step == 60
    assert figures["guard/steps_per_s"] == pytest.approx(2.0)
    assert figures["guard/gpu0_util_pct"] == 97 and figures["guard/gpu0_temp_c"] == 71
    assert figures["guard/cgroup_limit_gib"] == pytest.approx(64.0)
    assert tracker.logs[0] == ({"loss": pytest.approx(2.49)}, 1)


def test_heartbeat_before_the_first_step_and_without_deadline() -> None:
    clock = FakeClock()
    hb = make_heartbeat(clock, interval_s=5.0, nvml=FakeNvml([]))
    clock.now = 5.0
    line = hb.tick(clock.now, Snapshot(tree_rss_bytes=850 * 1024**2, cgroup=CgroupMemory(None, 3 * GIB, 0)))
    assert line == ("heartbeat step=- loss=- steps/s=- gpu=n/a(no GPU visible) tree_rss=850MiB "
                    "cgroup=3.0GiB/unlimited")
    clock.now = 10.0
    line = hb.tick(clock.now, Snapshot(cgroup=CgroupMemory(2 * GIB, 900 * 1024**2, 0)))
    assert line is not None and line.endswith(" cgroup=900MiB/2.0GiB")


def test_heartbeat_off_with_zero_interval() -> None:
    clock = FakeClock()
    hb = make_heartbeat(clock, interval_s=0)
    clock.now = 1e6
    assert hb.due_at() == float("inf")
    assert hb.tick(clock.now, Snapshot()) is None


def test_heartbeat_on_a_cpu_job(tmp_path: Any) -> None:
    """A real job (a Python process holding ~64 MB): its tree's RSS and the cgroup figures land in the line."""
    code = "import time; x = bytearray(64_000_000); x[::4096] = b'1' * len(x[::4096]); time.sleep(60)"
    job = JobProcess([sys.executable, "-c", code], {"PATH": "/usr/bin:/bin"})
    job.start()
    try:
        for _ in range(200):  # until the memory is touched
            if job.sample() >= 60_000_000:
                break
            subprocess.run(["sleep", "0.05"], check=False)
        clock = FakeClock()
        hb = make_heartbeat(clock, interval_s=1.0, nvml=FakeNvml(init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))
        clock.now = 1.0
        hb.on_step(clock.now, 1, 3.25)
        line = hb.tick(clock.now, Snapshot(tree_rss_bytes=job.sample(), cgroup=cgroup_memory()))
    finally:
        job.signal_all(9)
        job.proc.wait()
    assert line is not None
    assert line.startswith("heartbeat step=1 loss=3.25 steps/s=- gpu=n/a(no NVIDIA driver: NVML library not found)")
    rss = re.search(r"tree_rss=([0-9.]+)(MiB|GiB)", line)
    assert rss and float(rss.group(1)) * (1 if rss.group(2) == "MiB" else 1024) >= 60_000_000 // 2**20  # MiB
    if cgroup_memory() is not None and cgroup_memory().current_bytes is not None:
        assert re.search(r" cgroup=[0-9.]+(MiB|GiB)?/([0-9.]+(MiB|GiB)|unlimited)$", line)


# ---------------------------------------------------------------------------------------------------------------
# The projection
# ---------------------------------------------------------------------------------------------------------------


def test_projection_arithmetic() -> None:
    clock = FakeClock()
    hb = make_heartbeat(clock, deadline_in_s=1000.0, margin_s=100.0)
    hb.set_max_steps(1000)
    run_steps(hb, clock, 1, 100, 0.5)  # 2 steps/s, step 100 at t=50
    proj = hb.projection(clock.now)
    assert proj is not None
    assert proj["steps_per_s"] == pytest.approx(2.0)
    assert proj["eta_s"] == pytest.approx(450.0)  # 900 steps left
    assert proj["left_s"] == pytest.approx(950.0)
    assert proj["stop_in_s"] == pytest.approx(850.0)  # the guard secures at deadline - margin
    assert proj["reach_step"] == pytest.approx(100 + 2 * 850)


def test_projection_unknown_without_max_steps() -> None:
    clock = FakeClock()
    hb = make_heartbeat(clock, deadline_in_s=1000.0)
    run_steps(hb, clock, 1, 100, 0.5)
    assert hb.projection(clock.now) is None
    hb.set_max_steps(0)  # the Trainer's "unknown"
    hb.set_max_steps(True)
    assert hb.max_steps is None


def test_projection_warns_once_that_the_run_will_not_finish(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    tracker = Recorder()
    hb = make_heartbeat(clock, deadline_in_s=3600.0, margin_s=300.0, tracker=tracker, min_span_s=60.0)
    hb.set_max_steps(20000)  # at 2 steps/s that is ~2h47m: far beyond the hour left
    with caplog.at_level(logging.WARNING, logger="guard.telemetry"):
        early = run_steps(hb, clock, 1, 100, 0.5)  # 50 s of steps: the rate does not count yet
        assert early == []
        warnings = run_steps(hb, clock, 101, 2000, 0.5)
    assert len(warnings) == 1
    text = warnings[0]
    # the warning fires on the first step once the window spans 60 s: step 121 at t=60.5, so 3239.5 s remain
    # before the guard secures (deadline 3600 - margin 300 - 60.5) and the run reaches step 121 + 2 * 3239.5
    assert text.startswith("at 2 steps/s the run reaches step 6600 of 20000 by the deadline: it will not finish")
    assert "margin 5m" in text
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [text]
    assert len(tracker.alerts) == 1 and tracker.alerts[0][2] == "warn" and tracker.alerts[0][3] == 121
    clock.now += 30.0
    line = hb.tick(clock.now, Snapshot())
    assert line is not None and len(tracker.alerts) == 1  # a heartbeat does not repeat it


def test_projection_quiet_when_the_run_finishes_in_time() -> None:
    clock = FakeClock()
    hb = make_heartbeat(clock, deadline_in_s=3600.0, margin_s=300.0)
    hb.set_max_steps(5000)  # 2500 s at 2 steps/s: done before 3300 s
    assert run_steps(hb, clock, 1, 4000, 0.5) == []
    assert hb.warned is False


def test_projection_quiet_without_deadline() -> None:
    clock = FakeClock()
    hb = make_heartbeat(clock)
    hb.set_max_steps(10**9)
    assert run_steps(hb, clock, 1, 500, 0.5) == []


# ---------------------------------------------------------------------------------------------------------------
# GPUs
# ---------------------------------------------------------------------------------------------------------------


def test_no_nvml_reason_is_computed_once() -> None:
    nvml = FakeNvml(init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    sampler = GpuSampler(environ={}, nvml=nvml)
    assert sampler.sample() is None
    assert sampler.sample() is None
    assert nvml.inits == 1
    assert sampler.reason == "NVIDIA driver not loaded"
    sampler.close()
    assert nvml.shutdowns == 0  # never opened


def test_visible_devices_by_index_uuid_and_the_first_bad_entry() -> None:
    gpus = [FakeGpu("GPU-aaaa", util=1), FakeGpu("GPU-bbbb", util=2), FakeGpu("GPU-cccc", util=3)]
    by_index = GpuSampler(environ={"CUDA_VISIBLE_DEVICES": "2,0"}, nvml=FakeNvml(gpus))
    assert [(s.label, s.utilization_pct) for s in by_index.sample() or []] == [("gpu0", 3), ("gpu1", 1)]
    stops = GpuSampler(environ={"CUDA_VISIBLE_DEVICES": "GPU-bbbb,7,0"}, nvml=FakeNvml(gpus))
    assert [(s.label, s.utilization_pct) for s in stops.sample() or []] == [("gpu0", 2)]  # CUDA stops at 7
    hidden = GpuSampler(environ={"CUDA_VISIBLE_DEVICES": ""}, nvml=FakeNvml(gpus))
    assert hidden.sample() is None
    assert hidden.reason == "no GPU visible (CUDA_VISIBLE_DEVICES)"
    hidden.close()
    assert hidden.nvml.shutdowns == 1  # NVML was opened, so it is shut down


def test_lost_gpu_and_old_driver_temperature() -> None:
    gpus = [FakeGpu("GPU-aaaa", temp_v_missing=True), FakeGpu("GPU-bbbb", lost=True)]
    samples = GpuSampler(environ={}, nvml=FakeNvml(gpus)).sample()
    assert samples == [GpuSample("gpu0", 97, int(61.2 * GIB), int(79.6 * GIB), 70), GpuSample("gpu1", error="lost")]
    assert [s.text() for s in samples] == ["97%,61.2/79.6GiB,70C", "lost"]
    assert GpuSample("gpu2", utilization_pct=5).text() == "5%,?/?GiB,?C"


def test_real_nvml_gives_samples_or_a_reason() -> None:
    """The real ``pynvml`` here: on a machine without a driver the reason names it; with GPUs every figure comes."""
    sampler = GpuSampler(environ={})
    try:
        samples = sampler.sample()
    finally:
        sampler.close()
    if samples is None:
        assert sampler.reason
    else:
        assert [s.label for s in samples] == [f"gpu{i}" for i in range(len(samples))]
        assert all(s.memory_total_bytes and s.temperature_c is not None for s in samples)


# ---------------------------------------------------------------------------------------------------------------
# Progress
# ---------------------------------------------------------------------------------------------------------------


def test_progress_lines_are_rate_limited_and_carry_bytes_and_rate(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    progress = Progress("pushing checkpoint-500", total_bytes=4_800_000_000, clock=clock, every_s=10.0)
    with caplog.at_level(logging.INFO, logger="guard.telemetry"):
        clock.now = 5.0
        assert progress.update(400_000_000) is None
        clock.now = 12.0
        line = progress.update(1_200_000_000)
        clock.now = 15.0
        assert progress.update(1_500_000_000) is None
        clock.now = 48.0
        end = progress.done(4_800_000_000)
    assert line == "pushing checkpoint-500: 1.2/4.8 GB (25%), 100.0 MB/s, ~36s left"
    assert end == "pushing checkpoint-500: 4.8 GB in 48s (100.0 MB/s)"
    assert [r.getMessage() for r in caplog.records] == [line, end]


def test_progress_without_sizes() -> None:
    clock = FakeClock()
    progress = Progress("preflight hub checks", clock=clock, every_s=10.0)
    clock.now = 20.0
    assert progress.update() == "preflight hub checks: still running (20s)"
    clock.now = 21.0
    assert progress.done() == "preflight hub checks: done in 21s"


def test_progress_of_a_push_without_byte_counts() -> None:
    """A push that reports no bytes while it runs: "still running" with its size, then size and mean rate."""
    clock = FakeClock()
    progress = Progress("securing checkpoint-500", total_bytes=2_000_000_000, clock=clock, every_s=10.0)
    clock.now = 10.0
    assert progress.update() == "securing checkpoint-500 (2.0 GB): still running (10s)"
    clock.now = 40.0
    assert progress.done(2_000_000_000) == "securing checkpoint-500: 2.0 GB in 40s (50.0 MB/s)"


def test_heartbeat_figures_a_person_reads_and_the_alerts_it_carries() -> None:
    from types import SimpleNamespace

    from guard.observe.alerts import Alerts

    class Reporting(Recorder):
        def __init__(self) -> None:
            super().__init__()
            self.reports: list[tuple[str, str, int | None]] = []

        def report(self, key: str, text: str, step: int | None = None) -> None:
            self.reports.append((key, text, step))

    clock = FakeClock()
    tracker = Reporting()
    hb = make_heartbeat(clock, interval_s=10.0, deadline_in_s=3600.0, margin_s=120.0, nvml=FakeNvml([]),
                        tracker=tracker)
    hb.alerts = Alerts(lambda: hb.tracker)
    run_steps(hb, clock, 1, 20, 0.5)
    secured = SimpleNamespace(kind="background", step=15, path="/out/checkpoint-15", running=False, ok=True,
                              killed=False, pushed="hf://a/b@r1", destination="hf://a/b", error=None, hint=None)
    snapshot = SimpleNamespace(trigger=None, state=SimpleNamespace(name="WATCHING"), history=(secured,),
                               secured=secured, has_pusher=True, non_finite_from_step=None,
                               suspect_from_step=None)  # Plan.report()
    plan = SimpleNamespace(report=lambda: snapshot)
    hb.observe(clock.now, SimpleNamespace(exploded=None, rose=None), plan)
    clock.now = 10.0
    line = hb.tick(clock.now, Snapshot(tree_rss_bytes=GIB))
    assert line is not None and " secured=step15 " in line
    figures, step = tracker.logs[-1]
    assert step == 20 and figures["guard/step_time_s"] == pytest.approx(0.5)
    assert figures["guard/margin_s"] == 120.0 and figures["guard/secured_step"] == 15
    assert figures["guard/left_s"] == pytest.approx(3590.0)
    clock.now = 20.0
    hb.tick(clock.now, Snapshot())
    assert tracker.reports == [("jobguard/gpu", "GPU memory and utilisation: n/a (no GPU visible)", 20)]  # once
    assert [(title, level) for title, _, level, _ in tracker.alerts] == [("checkpoint secured: step 15", "info")]
