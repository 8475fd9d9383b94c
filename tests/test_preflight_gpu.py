"""GPU checks against a scripted stand-in for the ``pynvml`` module (the real one needs a driver).

The stand-in raises the real ``pynvml.NVMLError`` classes, so the code under test sees what NVML would raise:
library missing (12), driver/library version mismatch (18), not supported (3), GPU lost (15).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from guard.preflight import PreflightOptions, run_preflight
from guard.preflight.gpu import GpuInfo, check_gpus, parse_visible_devices

NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED


@dataclass
class FakeGpu:
    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str = "GPU-00000000-1111-2222-3333-444444444444"
    cc: tuple[int, int] = (9, 0)
    memory_total: int = 80 * 1024**3
    ecc_uncorrected: int | None = 0
    remap: tuple[int, int, int, int] | None = (0, 0, 0, 0)
    retired_pending: int | None = None
    clocks_reasons: int = 0x1  # GpuIdle
    processes: list[Any] = field(default_factory=list)
    persistence: int = 1
    mig: tuple[int, int] | None = None
    lost: bool = False


def _supported(value: Any) -> Any:
    if value is None:
        raise pynvml.NVMLError(NOT_SUPPORTED)
    return value


class FakeNvml:
    """A module-like object with the NVML functions the GPU check calls, driven by ``FakeGpu`` records."""

    NVMLError = pynvml.NVMLError
    NVML_ERROR_LIBRARY_NOT_FOUND = pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    NVML_ERROR_LIB_RM_VERSION_MISMATCH = pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH
    NVML_ERROR_DRIVER_NOT_LOADED = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    NVML_ERROR_GPU_IS_LOST = pynvml.NVML_ERROR_GPU_IS_LOST
    NVML_ERROR_FUNCTION_NOT_FOUND = pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    NVML_VOLATILE_ECC = pynvml.NVML_VOLATILE_ECC
    NVML_DEVICE_MIG_ENABLE = pynvml.NVML_DEVICE_MIG_ENABLE

    def __init__(self, gpus: list[FakeGpu] | None = None, *, init_error: int | None = None) -> None:
        self.gpus = gpus if gpus is not None else [FakeGpu()]
        self.init_error = init_error
        self.calls: list[str] = []
        self.shutdowns = 0

    def _dev(self, handle: FakeGpu) -> FakeGpu:
        if handle.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return handle

    def nvmlInit(self) -> None:
        self.calls.append("init")
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlSystemGetDriverVersion(self) -> str:
        return "550.54.15"

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        return 12040

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        return self.gpus[index]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> FakeGpu:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetName(self, h: FakeGpu) -> str:
        return self._dev(h).name

    def nvmlDeviceGetUUID(self, h: FakeGpu) -> str:
        return self._dev(h).uuid

    def nvmlDeviceGetCudaComputeCapability(self, h: FakeGpu) -> tuple[int, int]:
        return self._dev(h).cc

    def nvmlDeviceGetMemoryInfo(self, h: FakeGpu) -> Any:
        return SimpleNamespace(total=self._dev(h).memory_total, free=self._dev(h).memory_total, used=0)

    def nvmlDeviceGetTotalEccErrors(self, h: FakeGpu, error_type: int, counter_type: int) -> int:
        assert (error_type, counter_type) == (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)
        return _supported(self._dev(h).ecc_uncorrected)

    def nvmlDeviceGetRemappedRows(self, h: FakeGpu) -> tuple[int, int, int, int]:
        return _supported(self._dev(h).remap)

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h: FakeGpu) -> int:
        return _supported(self._dev(h).retired_pending)

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: FakeGpu) -> int:
        return self._dev(h).clocks_reasons

    def nvmlDeviceGetComputeRunningProcesses(self, h: FakeGpu) -> list[Any]:
        return self._dev(h).processes

    def nvmlDeviceGetGraphicsRunningProcesses(self, h: FakeGpu) -> list[Any]:
        return []

    def nvmlDeviceGetPersistenceMode(self, h: FakeGpu) -> int:
        return self._dev(h).persistence

    def nvmlDeviceGetMigMode(self, h: FakeGpu) -> tuple[int, int]:
        return _supported(self._dev(h).mig)


def _gpus(n: int, **kwargs: Any) -> list[FakeGpu]:
    return [FakeGpu(uuid=f"GPU-{i:08d}-aaaa-bbbb-cccc-dddddddddddd", **kwargs) for i in range(n)]


def run(nvml: Any, environ: dict[str, str] | None = None, **opts: Any) -> tuple[list, list[GpuInfo] | None]:
    return check_gpus(PreflightOptions(**opts), environ=environ or {}, nvml=nvml)


def statuses(rows: list) -> list[str]:
    return [row.status for row in rows]


def test_healthy_gpus_pass_with_a_summary_and_shut_nvml_down() -> None:
    nvml = FakeNvml(_gpus(2))
    rows, gpus = run(nvml, require_gpus=2, gpu_type="h100")
    assert statuses(rows) == ["pass"]
    assert "driver 550.54.15, CUDA 12.4" in rows[0].seen and "2 x NVIDIA H100" in rows[0].seen
    assert [g.compute_capability for g in gpus] == [(9, 0), (9, 0)]
    assert nvml.shutdowns == 1


def test_library_missing_is_na_with_the_reason() -> None:
    rows, gpus = run(FakeNvml(init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    assert [(r.status, r.seen) for r in rows] == [("n/a", "no NVIDIA driver: libnvidia-ml not found")]
    assert gpus is None


def test_library_missing_fails_when_gpus_are_required() -> None:
    rows, _ = run(FakeNvml(init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND), require_gpus=1)
    assert statuses(rows) == ["fail"]
    assert "libnvidia-ml not found" in rows[0].seen and "--require-gpus 1" in rows[0].seen and rows[0].hint


def test_driver_library_version_mismatch_is_named_as_such() -> None:
    rows, _ = run(FakeNvml(init_error=pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH), require_gpus=1)
    assert statuses(rows) == ["fail"]
    assert "version mismatch" in rows[0].seen
    assert "reboot" in rows[0].hint


def test_version_mismatch_without_a_gpu_requirement_warns() -> None:
    rows, _ = run(FakeNvml(init_error=pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH))
    assert statuses(rows) == ["warn"]


def test_one_gpu_where_eight_are_required_fails() -> None:
    rows, gpus = run(FakeNvml(_gpus(1)), require_gpus=8)
    fails = [r for r in rows if r.status == "fail"]
    assert len(fails) == 1 and fails[0].seen == "1 GPU visible, --require-gpus 8"
    assert len(gpus) == 1


def test_uncorrected_ecc_errors_fail_naming_the_gpu() -> None:
    gpus = _gpus(2)
    gpus[1].ecc_uncorrected = 3
    rows, _ = run(FakeNvml(gpus))
    fails = [r for r in rows if r.status == "fail"]
    assert len(fails) == 1
    assert fails[0].seen.startswith("GPU 1 (") and "3 uncorrected volatile ECC errors" in fails[0].seen
    assert "drain" in fails[0].hint


def test_pending_row_remap_fails() -> None:
    rows, _ = run(FakeNvml([FakeGpu(remap=(0, 1, 1, 0))]))
    assert [r.seen for r in rows if r.status == "fail"] == [
        "GPU 0 (NVIDIA H100 80GB HBM3): row remap pending (needs a GPU reset)"]


def test_row_remap_failure_fails() -> None:
    rows, _ = run(FakeNvml([FakeGpu(remap=(0, 9, 0, 1))]))
    assert any("row-remapping failure" in r.seen for r in rows if r.status == "fail")


def test_pending_page_retirement_on_an_older_gpu_fails() -> None:
    old = FakeGpu(name="Tesla V100-SXM2-16GB", cc=(7, 0), remap=None, retired_pending=1)
    rows, _ = run(FakeNvml([old]))
    assert any("page retirement pending" in r.seen for r in rows if r.status == "fail")


def test_unsupported_ecc_is_noted_not_failed() -> None:
    rows, _ = run(FakeNvml([FakeGpu(name="NVIDIA GeForce RTX 4090", cc=(8, 9), ecc_uncorrected=None, remap=None)]))
    assert statuses(rows) == ["pass"]
    assert "ECC counters not supported" in rows[0].seen


def test_thermal_throttling_warns() -> None:
    rows, _ = run(FakeNvml([FakeGpu(clocks_reasons=0x40 | 0x20)]))
    warn = [r for r in rows if r.status == "warn"]
    assert len(warn) == 1 and "hardware thermal slowdown" in warn[0].seen and "software thermal" in warn[0].seen


def test_other_processes_holding_memory_warn() -> None:
    procs = [SimpleNamespace(pid=4242, usedGpuMemory=3_000_000_000), SimpleNamespace(pid=4243, usedGpuMemory=None)]
    rows, _ = run(FakeNvml([FakeGpu(processes=procs)]))
    warn = [r for r in rows if r.status == "warn"]
    assert len(warn) == 1 and "2 other processes hold 3.0 GB" in warn[0].seen


def test_persistence_mode_off_warns_once_for_all_gpus() -> None:
    rows, _ = run(FakeNvml(_gpus(8, persistence=0)))
    warn = [r for r in rows if r.status == "warn"]
    assert [r.seen for r in warn] == ["persistence mode off on GPU 0-7"]


def test_mig_mode_is_reported_as_information() -> None:
    rows, _ = run(FakeNvml([FakeGpu(mig=(1, 1))]))
    assert statuses(rows) == ["pass", "pass"]
    assert "MIG mode on" in rows[1].seen


def test_gpu_type_mismatch_fails() -> None:
    rows, _ = run(FakeNvml([FakeGpu(name="NVIDIA A10G", cc=(8, 6))]), gpu_type="H100")
    fails = [r for r in rows if r.status == "fail"]
    assert len(fails) == 1 and "NVIDIA A10G" in fails[0].seen and "'H100'" in fails[0].seen


def test_cuda_visible_devices_selects_by_index_and_uuid() -> None:
    gpus = _gpus(4)
    rows, seen = run(FakeNvml(gpus), {"CUDA_VISIBLE_DEVICES": f"2,{gpus[0].uuid[:12]}"}, require_gpus=2)
    assert statuses(rows) == ["pass"]
    assert [g.index for g in seen] == [2, 0]


def test_cuda_visible_devices_naming_a_missing_device_fails() -> None:
    rows, seen = run(FakeNvml(_gpus(4)), {"CUDA_VISIBLE_DEVICES": "0,5"})
    fails = [r for r in rows if r.status == "fail"]
    assert len(fails) == 1 and "names '5'" in fails[0].seen and "NVML sees 4 GPUs (0-3)" in fails[0].seen
    assert [g.index for g in seen] == [0]


def test_empty_cuda_visible_devices_hides_every_gpu() -> None:
    rows, seen = run(FakeNvml(_gpus(2)), {"CUDA_VISIBLE_DEVICES": ""}, require_gpus=1)
    assert seen == [] and "fail" in statuses(rows)
    assert "0 GPUs visible (after CUDA_VISIBLE_DEVICES), --require-gpus 1" in [r.seen for r in rows]


def test_a_lost_gpu_fails_without_stopping_the_others() -> None:
    gpus = _gpus(2)
    gpus[1].lost = True
    rows, seen = run(FakeNvml(gpus))
    assert [g.index for g in seen] == [0]
    assert any(r.status == "fail" and r.seen.startswith("GPU 1:") and "GPU is lost" in r.seen for r in rows)


def test_parse_visible_devices() -> None:
    assert parse_visible_devices(None) is None
    assert parse_visible_devices("") == []
    assert parse_visible_devices(" 0, 1 ,GPU-ab") == ["0", "1", "GPU-ab"]


def test_run_preflight_passes_the_fake_module_and_the_gpus_to_trainer_config(tmp_path: Any) -> None:
    script = tmp_path / "train.py"
    script.write_text("from transformers import TrainingArguments\nargs = TrainingArguments('out', bf16=True)\n")
    nvml = FakeNvml([FakeGpu(name="Tesla T4", cc=(7, 5))])
    report = run_preflight(PreflightOptions(script=script, require_gpus=1, skip_checks={"python": "not needed"}),
                           environ={"HF_HOME": str(tmp_path)}, nvml=nvml)
    assert report.gpus is not None and report.gpus[0].name == "Tesla T4"
    failed = report.failed
    assert failed is not None and failed.name == "trainer-config" and "bf16" in failed.seen
    assert "cc 7.5" in failed.seen


def test_skipping_gpu_never_calls_nvml() -> None:
    nvml = FakeNvml()
    report = run_preflight(PreflightOptions(skip_checks={"gpu": "CPU job"}), environ={}, nvml=nvml)
    assert nvml.calls == []
    assert [(r.status, r.seen) for r in report.results if r.name == "gpu"] == [
        ("n/a", "skipped by --skip-check: CPU job")]


@pytest.mark.parametrize("code", [pynvml.NVML_ERROR_DRIVER_NOT_LOADED, pynvml.NVML_ERROR_UNKNOWN])
def test_other_init_failures_fail_when_required(code: int) -> None:
    rows, _ = run(FakeNvml(init_error=code), require_gpus=1)
    assert statuses(rows) == ["fail"] and rows[0].hint


def test_gpu_type_without_nvml_fails() -> None:
    rows, _ = run(FakeNvml(init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND), gpu_type="H100")
    assert statuses(rows) == ["fail"] and rows[0].seen.endswith("; --gpu-type H100")


def test_a_device_count_failure_is_a_row_not_a_crash() -> None:
    class NoCount(FakeNvml):
        def nvmlDeviceGetCount(self) -> int:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)

    rows, gpus = run(NoCount(), require_gpus=1)
    assert statuses(rows) == ["fail"] and rows[0].seen.startswith("NVML cannot count the GPUs")
    assert gpus is None
