"""Tests for ``guard.run.platform.detect`` from environment dicts."""

from __future__ import annotations

import pytest

from guard.run.platform import PlatformInfo, detect

HF_JOBS = {"JOB_ID": "6712ab", "ACCELERATOR": "a10g-small", "CPU_CORES": "4", "MEMORY": "15Gi"}
SLURM = {"SLURM_JOB_ID": "4242", "SLURM_JOB_PARTITION": "gpu", "SLURM_RESTART_COUNT": "1", "SLURM_PROCID": "0",
         "SLURM_NODEID": "0"}
K8S = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "HOSTNAME": "trainer-pod-0"}
TORCHRUN = {"TORCHELASTIC_RUN_ID": "none", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}


def test_local_by_default() -> None:
    info = detect({})
    assert info == PlatformInfo("local")
    assert info.describe() == "local"


def test_hf_jobs() -> None:
    info = detect(HF_JOBS)
    assert info.name == "hf_jobs"
    assert info.details == {"job_id": "6712ab", "flavor": "a10g-small", "cpu_cores": "4", "memory": "15Gi"}
    assert info.describe() == "hf_jobs (job_id=6712ab flavor=a10g-small cpu_cores=4 memory=15Gi)"


@pytest.mark.parametrize("missing", ["JOB_ID", "CPU_CORES", "MEMORY"])
def test_hf_jobs_needs_all_three_variables(missing: str) -> None:
    environ = {k: v for k, v in HF_JOBS.items() if k != missing}
    assert detect(environ).name == "local"


def test_a_bare_job_id_is_not_hf_jobs() -> None:
    assert detect({"JOB_ID": "123"}).name == "local"  # SGE sets JOB_ID too


def test_slurm() -> None:
    info = detect(SLURM)
    assert info.name == "slurm"
    assert info.details == {"job_id": "4242", "job_partition": "gpu", "restart_count": "1", "procid": "0",
                            "nodeid": "0"}
    assert "job_id=4242" in info.describe()


def test_slurm_with_only_the_job_id() -> None:
    info = detect({"SLURM_JOB_ID": "7"})
    assert info.name == "slurm"
    assert info.describe() == "slurm (job_id=7)"  # empty details are left out


def test_kubernetes() -> None:
    info = detect(K8S)
    assert (info.name, info.details) == ("kubernetes", {"pod": "trainer-pod-0"})


@pytest.mark.parametrize("environ", [TORCHRUN, {"LOCAL_RANK": "0", "WORLD_SIZE": "8", "RANK": "0"}])
def test_torchrun(environ: dict[str, str]) -> None:
    info = detect(environ)
    assert info.name == "torchrun"
    assert info.details["world_size"] == environ["WORLD_SIZE"]


def test_local_rank_alone_is_local() -> None:
    assert detect({"LOCAL_RANK": "0"}).name == "local"


def test_empty_values_do_not_count() -> None:
    assert detect({"SLURM_JOB_ID": "", "KUBERNETES_SERVICE_HOST": "", "TORCHELASTIC_RUN_ID": ""}).name == "local"


@pytest.mark.parametrize(
    ("layers", "expected"),
    [
        ((HF_JOBS, SLURM, K8S, TORCHRUN), "hf_jobs"),
        ((SLURM, K8S, TORCHRUN), "slurm"),
        ((K8S, TORCHRUN), "kubernetes"),
    ],
)
def test_first_match_wins(layers: tuple[dict[str, str], ...], expected: str) -> None:
    environ: dict[str, str] = {}
    for layer in layers:
        environ.update(layer)
    assert detect(environ).name == expected
