"""Which platform the job runs on, from its environment.

Sources of the variables:
- Hugging Face Jobs: ``JOB_ID``, ``ACCELERATOR``, ``CPU_CORES``, ``MEMORY`` (hub-docs ``jobs-configuration.md``,
  "Built-in environment variables"). ``JOB_ID`` alone is ambiguous (SGE sets it too), so all of ``JOB_ID``,
  ``CPU_CORES`` and ``MEMORY`` are required.
- Slurm: ``SLURM_JOB_ID`` (``sbatch(1)``, OUTPUT ENVIRONMENT VARIABLES).
  ``ACCELERATOR`` names the flavor's hardware (e.g. ``a10g-small``, ``a100x4``; ``none`` or empty on CPU), kept
  as ``flavor``.
- Kubernetes: ``KUBERNETES_SERVICE_HOST``, set in every container of a pod by the kubelet; the pod's name is the
  container's hostname (``HOSTNAME``), or ``POD_NAME`` where the pod spec passes it (downward API).
- torchrun: ``TORCHELASTIC_RUN_ID`` (set for each worker by ``torch.distributed.elastic``), or ``LOCAL_RANK``
  with ``WORLD_SIZE``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["PlatformInfo", "detect"]


@dataclass(frozen=True)
class PlatformInfo:
    """The platform: ``name`` is ``hf_jobs``, ``slurm``, ``kubernetes``, ``torchrun`` or ``local``."""

    name: str
    details: Mapping[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        extra = " ".join(f"{k}={v}" for k, v in self.details.items() if v)
        return f"{self.name} ({extra})" if extra else self.name


def detect(environ: Mapping[str, str]) -> PlatformInfo:
    """Detect the platform (first match: HF Jobs, Slurm, Kubernetes, torchrun, local)."""
    if environ.get("JOB_ID") and environ.get("CPU_CORES") and environ.get("MEMORY"):
        return PlatformInfo("hf_jobs", {"job_id": environ["JOB_ID"], "flavor": environ.get("ACCELERATOR", ""),
                                        "cpu_cores": environ["CPU_CORES"], "memory": environ["MEMORY"]})
    if environ.get("SLURM_JOB_ID"):
        keys = ("SLURM_JOB_ID", "SLURM_JOB_PARTITION", "SLURM_RESTART_COUNT", "SLURM_PROCID", "SLURM_NODEID")
        return PlatformInfo("slurm", {k.lower().removeprefix("slurm_"): environ.get(k, "") for k in keys})
    if environ.get("KUBERNETES_SERVICE_HOST"):
        return PlatformInfo("kubernetes", {"pod": environ.get("POD_NAME") or environ.get("HOSTNAME", "")})
    if environ.get("TORCHELASTIC_RUN_ID") or (environ.get("LOCAL_RANK") and environ.get("WORLD_SIZE")):
        return PlatformInfo("torchrun", {"rank": environ.get("RANK", ""), "world_size": environ.get("WORLD_SIZE", "")})
    return PlatformInfo("local")
