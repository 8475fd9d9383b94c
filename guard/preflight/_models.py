"""The data the checks produce: one ``CheckResult`` row per finding, the options, the report."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from guard.preflight.script import ScriptFacts

Status = Literal["pass", "warn", "fail", "n/a"]

#: Every check group, in the order of the table. ``--skip-check NAME=REASON`` accepts these names.
CHECK_NAMES: tuple[str, ...] = (
    "env",
    "hub-auth",
    "hub-repos",
    "gpu",
    "storage",
    "destination",
    "data",
    "python",
    "budget",
    "trainer-config",
    "distributed",
    "tracking",
)


@dataclass(frozen=True)
class CheckResult:
    """One row of the preflight table.

    Attributes:
        name: the check group (one of ``CHECK_NAMES``); several rows may share it.
        status: ``pass``, ``warn``, ``fail`` or ``n/a``.
        seen: what was observed, one line; on ``n/a`` the reason. Never a secret value.
        hint: what to do, one line; set on ``warn`` and ``fail``.
    """

    name: str
    status: Status
    seen: str
    hint: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """``{"name", "status", "seen", "hint"}`` for the JSON report."""
        return {"name": self.name, "status": self.status, "seen": self.seen, "hint": self.hint}


@dataclass(frozen=True)
class PreflightOptions:
    """What the job asks of its machine, from the command line (see the contract's options).

    Attributes:
        script: the job's Python script (read, never run), or None for a command job.
        script_args: the script's own arguments (unused by the checks today; kept for the report).
        require_env: ``--require-env`` names.
        require_models: ``--require-model`` Hub model ids.
        require_datasets: ``--require-dataset`` Hub dataset ids.
        require_gpus: ``--require-gpus`` (None: no requirement).
        gpu_type: ``--gpu-type``: text every visible GPU's name must contain (case-insensitive).
        min_free_disk_bytes: ``--min-free-disk`` in bytes (None: an estimate, warn only).
        expected_duration_s: ``--expected-duration`` in seconds.
        timeout_s: the job's known wall-clock budget in seconds (None: unknown).
        timeout_source: where ``timeout_s`` came from, e.g. ``"--timeout"``, ``"SLURM_JOB_END_TIME"``.
        output_dir: ``--output-dir``.
        push_to: the raw ``--push-to`` text.
        skip_checks: ``--skip-check NAME=REASON`` pairs; each named check becomes ``n/a`` with the reason.
        platform: ``hf_jobs``, ``slurm``, ``kubernetes``, ``torchrun`` or ``local``.
        network_timeout_s: the limit of each network call, in seconds.
        gpu_source: where ``require_gpus``/``gpu_type`` came from when not from the flags (e.g. ``"flavor
            a10g-large (ACCELERATOR)"``), for the GPU rows; None: the flags.
        python_executable: the interpreter that will run the job (a uv script environment's), or None for this
            one; the import check runs it.
        uv_environment: where uv built the script's environment (``--uv``), or None when the job does not run
            there; the PEP 723 row then says so instead of comparing with this interpreter.
        uv_error: why uv could not build that environment (a ``fail`` row), or None.
        command: the job's command (``-- COMMAND``); a launcher command (torchrun, accelerate launch) names the
            script the ranks run, checked as the script form's.
        require_shards: ``--require-shards`` as ``(glob, min_count or None)`` pairs.
        launch_smoke: ``--launch-smoke``: ``auto``, ``on`` or ``off``.
        launch_smoke_timeout_s: ``--launch-smoke-timeout`` in seconds.
    """

    script: Path | None = None
    script_args: tuple[str, ...] = ()
    require_env: tuple[str, ...] = ()
    require_models: tuple[str, ...] = ()
    require_datasets: tuple[str, ...] = ()
    require_gpus: int | None = None
    gpu_type: str | None = None
    min_free_disk_bytes: int | None = None
    expected_duration_s: float | None = None
    timeout_s: float | None = None
    timeout_source: str | None = None
    output_dir: Path | None = None
    push_to: str | None = None
    skip_checks: Mapping[str, str] = field(default_factory=dict)
    platform: str = "local"
    network_timeout_s: float = 3.0
    gpu_source: str | None = None
    python_executable: str | None = None
    uv_environment: str | None = None
    uv_error: str | None = None
    command: tuple[str, ...] = ()
    require_shards: tuple[tuple[str, int | None], ...] = ()
    launch_smoke: str = "auto"
    launch_smoke_timeout_s: float = 120.0


@dataclass(frozen=True)
class PreflightReport:
    """Every row of one preflight run.

    Attributes:
        results: the rows, in table order (``CHECK_NAMES``).
        elapsed_s: wall-clock seconds the checks took (by the injected clock).
        facts: what the static analysis of the script found, or None without a script.
        gpus: the GPUs the job will see (by ``CUDA_VISIBLE_DEVICES``), or None when unknown (no NVML, skipped);
            pass them to ``check_trainer_config`` when the agent reports the Trainer's arguments.
    """

    results: tuple[CheckResult, ...]
    elapsed_s: float
    facts: ScriptFacts | None = None
    gpus: tuple[GpuInfo, ...] | None = None

    @property
    def failed(self) -> CheckResult | None:
        """The first ``fail`` row, or None."""
        return next((row for row in self.results if row.status == "fail"), None)

    def to_json(self) -> list[dict[str, Any]]:
        """The rows as JSON-ready dicts (``name``, ``status``, ``seen``, ``hint``), for the ``--report`` file."""
        return [row.to_dict() for row in self.results]


@dataclass(frozen=True)
class GpuInfo:
    """One GPU the job will see.

    Attributes:
        index: NVML's index of the device (not necessarily CUDA's ordinal).
        name: the product name, e.g. ``"NVIDIA H200"``.
        uuid: ``GPU-...`` UUID.
        compute_capability: ``(major, minor)``, or None when NVML could not tell.
        memory_total_bytes: total device memory in bytes, or None.
    """

    index: int
    name: str
    uuid: str
    compute_capability: tuple[int, int] | None = None
    memory_total_bytes: int | None = None

    @property
    def cc_text(self) -> str:
        """``"8.0"``, or ``"unknown"``."""
        cc = self.compute_capability
        return f"{cc[0]}.{cc[1]}" if cc else "unknown"
