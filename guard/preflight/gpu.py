"""GPU checks through NVML (``nvidia-ml-py``, module ``pynvml``): read-only queries, no CUDA context, no torch.

Facts used (nvidia-ml-py 13.615.71, ``pynvml.py``; NVML API reference "Device Queries"):

- ``nvmlInit`` raises ``NVMLError`` subclasses whose ``value`` is the ``NVML_ERROR_*`` code: 12 library not found
  (no driver in this container), 9 driver not loaded, 18 ``LIB_RM_VERSION_MISMATCH`` (user-space library and
  kernel module of different versions, typically a driver upgrade without a reboot).
- NVML ignores ``CUDA_VISIBLE_DEVICES`` and numbers devices its own way; CUDA accepts indices or ``GPU-``/``MIG-``
  UUIDs (unique prefixes too) and stops at the first entry that names no device.
- ``nvmlDeviceGetTotalEccErrors(h, NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC)``: uncorrected errors
  since the last driver load; ``nvmlDeviceGetRemappedRows`` -> ``(corrected, uncorrected, isPending,
  failureOccurred)`` on Ampere and newer; ``nvmlDeviceGetRetiredPagesPendingStatus`` on older GPUs.
- ``nvmlDeviceGetCurrentClocksEventReasons`` (older name ``...ClocksThrottleReasons``) bit mask: SwPowerCap 0x4,
  HwSlowdown 0x8, SwThermalSlowdown 0x20, HwThermalSlowdown 0x40, HwPowerBrakeSlowdown 0x80.
- Process PIDs from NVML are host PIDs (no PID namespaces), so processes are counted, not matched.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from guard.preflight._common import fmt_bytes, one_line
from guard.preflight._models import CheckResult, GpuInfo, PreflightOptions, Status

__all__ = ["GpuInfo", "check_gpus", "parse_visible_devices"]

log = logging.getLogger("guard.preflight.gpu")

NAME = "gpu"

# NVML_ERROR_* codes (pynvml.py); read from the module when it defines them.
_LIBRARY_NOT_FOUND = 12
_DRIVER_NOT_LOADED = 9
_VERSION_MISMATCH = 18
_GPU_IS_LOST = 15

_THROTTLE_BITS = {
    0x4: "software power cap",
    0x8: "hardware slowdown",
    0x20: "software thermal slowdown",
    0x40: "hardware thermal slowdown",
    0x80: "hardware power brake",
}


def parse_visible_devices(text: str | None) -> list[str] | None:
    """Split ``CUDA_VISIBLE_DEVICES`` into entries; None when the variable is unset (all devices visible).

    An empty value hides every device (``[]``).
    """
    if text is None:
        return None
    return [part.strip() for part in text.split(",") if part.strip()]


def _code(nvml: Any, name: str, default: int) -> int:
    return int(getattr(nvml, name, default))


def _err_value(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def check_gpus(
    opts: PreflightOptions, *, environ: Mapping[str, str], nvml: Any = None
) -> tuple[list[CheckResult], list[GpuInfo] | None]:
    """Run the GPU checks.

    Args:
        opts: the preflight options (``require_gpus``, ``gpu_type``).
        environ: the job's environment (``CUDA_VISIBLE_DEVICES``).
        nvml: the ``pynvml`` module or a stand-in with the same functions; None imports ``pynvml``.

    Returns:
        ``(rows, gpus)``: the table rows (all named ``gpu``) and the GPUs the job will see, or None when NVML
        gave no answer (no driver, library missing, init failed).
    """
    required = opts.require_gpus or (1 if opts.gpu_type else 0)  # a GPU type asks for at least one GPU
    need = f"--require-gpus {opts.require_gpus}" if opts.require_gpus else (
        f"--gpu-type {opts.gpu_type}" if opts.gpu_type else None)
    if opts.gpu_source and need:
        need = opts.gpu_source
    if nvml is None:
        try:
            import pynvml  # lazy on purpose
        except ImportError:
            row = _no_nvml("nvidia-ml-py is not installed (module pynvml)", need, "pip install nvidia-ml-py")
            return [row], None
        nvml = pynvml
    nvml_error = getattr(nvml, "NVMLError", Exception)
    try:
        nvml.nvmlInit()
    except nvml_error as exc:
        return [_init_failure(nvml, exc, need)], None
    except OSError as exc:  # a broken library file raises from ctypes
        return [_no_nvml(f"NVML could not be loaded: {one_line(exc)}", need, None)], None
    try:
        return _inspect(nvml, opts, environ, required)
    finally:
        with contextlib.suppress(nvml_error):
            nvml.nvmlShutdown()


def _no_nvml(seen: str, need: str | None, hint: str | None) -> CheckResult:
    if need:
        return CheckResult(NAME, "fail", f"{seen}; {need}",
                           hint or "run on a GPU machine with the NVIDIA driver (container: --gpus all)")
    return CheckResult(NAME, "n/a", seen)


def _init_failure(nvml: Any, exc: BaseException, need: str | None) -> CheckResult:
    code = _err_value(exc)
    if code == _code(nvml, "NVML_ERROR_LIBRARY_NOT_FOUND", _LIBRARY_NOT_FOUND):
        return _no_nvml("no NVIDIA driver: libnvidia-ml not found", need,
                        "run on a GPU machine; in a container start it with the NVIDIA runtime (--gpus all)")
    if code == _code(nvml, "NVML_ERROR_LIB_RM_VERSION_MISMATCH", _VERSION_MISMATCH):
        return CheckResult(
            NAME, "fail" if need else "warn",
            f"NVIDIA driver/library version mismatch: the NVML library and the loaded kernel module differ ({exc})",
            "the driver was upgraded without a reboot: reboot the node or reload the nvidia kernel module",
        )
    if code == _code(nvml, "NVML_ERROR_DRIVER_NOT_LOADED", _DRIVER_NOT_LOADED):
        return CheckResult(NAME, "fail" if need else "warn",
                           "libnvidia-ml is present but the NVIDIA kernel driver is not loaded",
                           "load the driver (modprobe nvidia) or run on a machine where nvidia-smi works")
    return CheckResult(NAME, "fail" if need else "warn", f"NVML init failed: {one_line(exc)}",
                       "check that nvidia-smi works on this machine")


def _inspect(
    nvml: Any, opts: PreflightOptions, environ: Mapping[str, str], required: int
) -> tuple[list[CheckResult], list[GpuInfo] | None]:
    nvml_error = getattr(nvml, "NVMLError", Exception)
    rows: list[CheckResult] = []
    notes: list[str] = []

    def query(fn_names: Sequence[str], *args: Any) -> Any:
        """Call the first function NVML has; None when unsupported (noted), re-raise a lost GPU."""
        for fn_name in fn_names:
            fn = getattr(nvml, fn_name, None)
            if fn is None:
                continue
            try:
                return fn(*args)
            except nvml_error as exc:
                if _err_value(exc) == _code(nvml, "NVML_ERROR_GPU_IS_LOST", _GPU_IS_LOST):
                    raise
                if _err_value(exc) == _code(nvml, "NVML_ERROR_FUNCTION_NOT_FOUND", 13):
                    continue
                return None
        return None

    driver = _text(query(["nvmlSystemGetDriverVersion"]) or "unknown")
    try:
        count = int(nvml.nvmlDeviceGetCount())
    except nvml_error as exc:
        return [CheckResult(NAME, "fail" if required else "warn", f"NVML cannot count the GPUs: {one_line(exc)}",
                            "check nvidia-smi; a GPU may have fallen off the bus")], None
    devices: list[tuple[int, Any, GpuInfo]] = []
    for index in range(count):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            cc = query(["nvmlDeviceGetCudaComputeCapability"], handle)
            memory = query(["nvmlDeviceGetMemoryInfo"], handle)
            info = GpuInfo(
                index=index,
                name=_text(query(["nvmlDeviceGetName"], handle) or "unknown GPU"),
                uuid=_text(query(["nvmlDeviceGetUUID"], handle) or f"index-{index}"),
                compute_capability=(int(cc[0]), int(cc[1])) if cc else None,
                memory_total_bytes=int(memory.total) if memory is not None else None,
            )
        except nvml_error as exc:
            rows.append(CheckResult(NAME, "fail", f"GPU {index}: {one_line(exc)}",
                                    "the GPU is unusable (fell off the bus?): drain this node and reset the GPU"))
            continue
        devices.append((index, handle, info))

    visible, visibility_row = _select_visible(nvml, devices, environ.get("CUDA_VISIBLE_DEVICES"), count)
    if visibility_row:
        rows.append(visibility_row)

    if opts.require_gpus and len(visible) < opts.require_gpus:
        where = " (after CUDA_VISIBLE_DEVICES)" if environ.get("CUDA_VISIBLE_DEVICES") is not None else ""
        rows.append(CheckResult(
            NAME, "fail", f"{len(visible)} GPU{'s' if len(visible) != 1 else ''} visible{where}, "
            + (opts.gpu_source or f"--require-gpus {opts.require_gpus}"),
            "request more GPUs (Slurm --gres=gpu:N, HF Jobs a larger flavor) or lower --require-gpus"))
    if opts.gpu_type:
        wrong = [info for _, _, info in visible if opts.gpu_type.lower() not in info.name.lower()]
        if wrong or not visible:
            names = ", ".join(sorted({info.name for _, _, info in visible})) or "no GPU"
            asked = opts.gpu_source or f"--gpu-type {opts.gpu_type!r}"
            rows.append(CheckResult(NAME, "fail", f"GPU type {names}; {asked} asked",
                                    "run on a machine with that GPU type, or change --gpu-type"))

    persistence_off: list[int] = []
    for index, handle, info in visible:
        label = f"GPU {index} ({info.name})"
        try:
            rows.extend(_health(nvml, handle, label, query, notes))
            if query(["nvmlDeviceGetPersistenceMode"], handle) == 0:
                persistence_off.append(index)
        except nvml_error as exc:
            rows.append(CheckResult(NAME, "fail", f"{label}: {one_line(exc)}",
                                    "the GPU is unusable (fell off the bus?): drain this node and reset the GPU"))
    if persistence_off:
        rows.append(CheckResult(NAME, "warn", f"persistence mode off on GPU {_ranges(persistence_off)}",
                                "the first CUDA call may take seconds; an admin can run nvidia-smi -pm 1"))

    summary = _summary(driver, nvml, visible, count, notes, query)
    status: Status = "pass" if visible or not required else "fail"
    rows.insert(0, CheckResult(NAME, status, summary, None if status == "pass" else "no usable GPU"))
    return rows, [info for _, _, info in visible]


def _select_visible(
    nvml: Any, devices: list[tuple[int, Any, GpuInfo]], text: str | None, count: int
) -> tuple[list[tuple[int, Any, GpuInfo]], CheckResult | None]:
    entries = parse_visible_devices(text)
    if entries is None:
        return devices, None
    selected: list[tuple[int, Any, GpuInfo]] = []
    for entry in entries:
        match = None
        if entry.lstrip("-").isdigit():
            match = next((d for d in devices if d[0] == int(entry)), None)
        else:
            hits = [d for d in devices if d[2].uuid == entry or d[2].uuid.startswith(entry)]
            match = hits[0] if len(hits) == 1 else None
            if match is None and entry.startswith("MIG-"):
                match = _mig_parent(nvml, devices, entry)
        if match is None:
            known = f"NVML sees {count} GPU{'s' if count != 1 else ''}" + (f" (0-{count - 1})" if count else "")
            return selected, CheckResult(
                NAME, "fail", f"CUDA_VISIBLE_DEVICES={text} names {entry!r}, which is no device here; {known}",
                "fix CUDA_VISIBLE_DEVICES (CUDA ignores this entry and every one after it)")
        if match not in selected:
            selected.append(match)
    return selected, None


def _mig_parent(nvml: Any, devices: list[tuple[int, Any, GpuInfo]], uuid: str) -> tuple[int, Any, GpuInfo] | None:
    """The GPU that holds MIG device ``uuid`` (``nvmlDeviceGetDeviceHandleFromMigDeviceHandle``), or None."""
    try:
        mig = nvml.nvmlDeviceGetHandleByUUID(uuid)
        parent_uuid = _text(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)))
    except Exception:  # noqa: BLE001 - any NVML error here means "no such device"
        return None
    return next((d for d in devices if d[2].uuid == parent_uuid), None)


def _health(nvml: Any, handle: Any, label: str, query: Any, notes: list[str]) -> list[CheckResult]:
    rows: list[CheckResult] = []
    drain = "drain this node and have the GPU reset or replaced; rerun elsewhere"
    uncorrected = query(["nvmlDeviceGetTotalEccErrors"], handle,
                        _code(nvml, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1), _code(nvml, "NVML_VOLATILE_ECC", 0))
    if uncorrected is None:
        notes.append(f"{label.split(' (')[0]}: ECC counters not supported")
    elif int(uncorrected) > 0:
        rows.append(CheckResult(NAME, "fail", f"{label}: {int(uncorrected)} uncorrected volatile ECC errors", drain))
    remap = query(["nvmlDeviceGetRemappedRows"], handle)
    if remap is not None:
        _corr, _unc, pending, failure = (int(x) for x in remap)
        if failure:
            rows.append(CheckResult(NAME, "fail", f"{label}: row-remapping failure (memory cannot be repaired)", drain))
        elif pending:
            rows.append(CheckResult(NAME, "fail", f"{label}: row remap pending (needs a GPU reset)",
                                    "reset the GPU (nvidia-smi -r) or drain this node"))
    else:
        pending_pages = query(["nvmlDeviceGetRetiredPagesPendingStatus"], handle)
        if pending_pages:
            rows.append(CheckResult(NAME, "fail", f"{label}: page retirement pending (needs a GPU reset)",
                                    "reset the GPU (nvidia-smi -r) or drain this node"))
    reasons = query(["nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"], handle)
    active = [text for bit, text in _THROTTLE_BITS.items() if reasons is not None and int(reasons) & bit]
    if active:
        rows.append(CheckResult(NAME, "warn", f"{label}: throttling active: {', '.join(active)}",
                                "check cooling and power limits (nvidia-smi -q -d PERFORMANCE); "
                                "the job will run slower"))
    procs = list(query(["nvmlDeviceGetComputeRunningProcesses"], handle) or [])
    procs += list(query(["nvmlDeviceGetGraphicsRunningProcesses"], handle) or [])
    if procs:
        used = sum(int(p.usedGpuMemory) for p in procs if getattr(p, "usedGpuMemory", None))
        rows.append(CheckResult(
            NAME, "warn", f"{label}: {len(procs)} other process{'es' if len(procs) != 1 else ''} hold "
            f"{fmt_bytes(used) if used else 'an unknown amount of'} GPU memory",
            "another job may share this GPU: expect less memory (nvidia-smi shows who)"))
    mig = query(["nvmlDeviceGetMigMode"], handle)
    if mig is not None and int(mig[0]) == _code(nvml, "NVML_DEVICE_MIG_ENABLE", 1):
        rows.append(CheckResult(NAME, "pass", f"{label}: MIG mode on (the job sees MIG slices, not the whole GPU)"))
    return rows


def _summary(driver: str, nvml: Any, visible: list[tuple[int, Any, GpuInfo]], count: int,
             notes: list[str], query: Any) -> str:
    cuda = query(["nvmlSystemGetCudaDriverVersion_v2", "nvmlSystemGetCudaDriverVersion"])
    cuda_text = f", CUDA {int(cuda) // 1000}.{int(cuda) % 1000 // 10}" if cuda else ""
    if not visible:
        return f"driver {driver}{cuda_text}; no GPU visible (NVML sees {count})"
    kinds: dict[str, int] = {}
    for _, _, info in visible:
        key = f"{info.name} (cc {info.cc_text}" + (f", {fmt_bytes(info.memory_total_bytes)})"
                                                   if info.memory_total_bytes else ")")
        kinds[key] = kinds.get(key, 0) + 1
    gpus = ", ".join(f"{n} x {k}" for k, n in kinds.items())
    tail = f"; {'; '.join(notes)}" if notes else ""
    return f"driver {driver}{cuda_text}; {gpus}{tail}"


def _ranges(indices: list[int]) -> str:
    consecutive = indices == list(range(indices[0], indices[0] + len(indices)))
    return f"{indices[0]}-{indices[-1]}" if consecutive and len(indices) > 2 else ", ".join(map(str, indices))
