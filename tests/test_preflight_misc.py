"""env, budget, distributed and tracking checks."""

from __future__ import annotations

import socket
import threading
from pathlib import Path
from typing import Any

import pytest

from guard.preflight import PreflightOptions
from guard.preflight._job import HubTarget, JobView
from guard.preflight.env import check_env
from guard.preflight.gpu import GpuInfo
from guard.preflight.misc import check_budget, check_distributed, check_tracking

SECRET = "hf_" + "Q" * 34
GPUS4 = [GpuInfo(i, "NVIDIA A100", f"GPU-{i}", (8, 0)) for i in range(4)]


def job(**kwargs: Any) -> JobView:
    return JobView(**kwargs)


# -- env ---------------------------------------------------------------------------------------------------------


def test_nothing_needed_is_na_with_reason(tmp_path: Path) -> None:
    rows = check_env(PreflightOptions(), job(), environ={"HF_HOME": str(tmp_path)})
    assert [(r.status, r.seen) for r in rows] == [
        ("n/a", "no variable needed (no --require-env, no Hub push, no wandb/mlflow)")]


def test_required_names_set_empty_and_missing() -> None:
    opts = PreflightOptions(require_env=("DATA_KEY", "EMPTY_ONE", "ABSENT_ONE"))
    rows = check_env(opts, job(), environ={"DATA_KEY": "s3cr3t-value-123", "EMPTY_ONE": " "})
    assert [(r.status, r.seen) for r in rows] == [
        ("pass", "set: DATA_KEY (--require-env)"),
        ("fail", "EMPTY_ONE set but empty (--require-env)"),
        ("fail", "ABSENT_ONE not set (--require-env)"),
    ]
    assert all("s3cr3t" not in (r.seen + (r.hint or "")) for r in rows)


def test_hf_token_is_needed_when_pushing_and_never_printed(tmp_path: Path) -> None:
    target = HubTarget("model", "acme/x", "--push-to hf://acme/x")
    missing = check_env(PreflightOptions(), job(hub_target=target), environ={"HF_HOME": str(tmp_path)})
    assert [r.status for r in missing] == ["fail"] and "HF_TOKEN not set" in missing[0].seen
    assert "--push-to hf://acme/x" in missing[0].seen
    present = check_env(PreflightOptions(), job(hub_target=target), environ={"HF_TOKEN": SECRET})
    assert [r.status for r in present] == ["pass"] and "HF_TOKEN" in present[0].seen
    assert SECRET not in present[0].seen


def test_a_saved_token_file_counts(tmp_path: Path) -> None:
    (tmp_path / "token").write_text(SECRET + "\n")
    rows = check_env(PreflightOptions(), job(hub_target=HubTarget("model", None, "push_to_hub=True")),
                     environ={"HF_HOME": str(tmp_path)})
    assert [r.status for r in rows] == ["pass"] and f"saved token {tmp_path / 'token'}" in rows[0].seen


def test_wandb_needs_a_key_unless_offline_or_logged_in(tmp_path: Path) -> None:
    view = job(trackers=frozenset({"wandb"}))
    home = {"HOME": str(tmp_path)}
    assert [r.status for r in check_env(PreflightOptions(), view, environ=home)] == ["fail"]
    assert [r.status for r in check_env(PreflightOptions(), view, environ={**home, "WANDB_API_KEY": "k" * 40})] == [
        "pass"]
    assert [r.status for r in check_env(PreflightOptions(), view, environ={**home, "WANDB_MODE": "offline"})] == [
        "pass"]
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    (tmp_path / ".netrc").chmod(0o600)
    rows = check_env(PreflightOptions(), view, environ=home)
    assert [r.status for r in rows] == ["pass"] and ".netrc" in rows[0].seen


def test_mlflow_needs_a_tracking_uri() -> None:
    view = job(trackers=frozenset({"mlflow"}))
    rows = check_env(PreflightOptions(), view, environ={})
    assert [r.status for r in rows] == ["fail"] and "MLFLOW_TRACKING_URI" in rows[0].seen
    ok = check_env(PreflightOptions(), view, environ={"MLFLOW_TRACKING_URI": "http://mlflow:5000"})
    assert [r.status for r in ok] == ["pass"]


def test_job_view_derives_push_trackers_and_output_from_options_and_script(tmp_path: Path) -> None:
    from guard.preflight.script import analyze_script

    path = tmp_path / "t.py"
    path.write_text('from transformers import TrainingArguments\n'
                    'TrainingArguments(output_dir="o", push_to_hub=True, hub_model_id="acme/m", '
                    'report_to=["wandb", "tensorboard"])\n')
    view = JobView.build(PreflightOptions(script=path), analyze_script(path), {"TRACKIO_SPACE_ID": "acme/dash"})
    assert view.hub_target == HubTarget("model", "acme/m", "hub_model_id='acme/m'")
    assert view.trackers == frozenset({"wandb"}) and view.output_dir == Path("o")
    assert view.trackio_space_id == "acme/dash"
    overridden = JobView.build(PreflightOptions(push_to="hf://datasets/bob/d", output_dir=tmp_path), None, {})
    assert overridden.hub_target == HubTarget("dataset", "bob/d", "--push-to hf://datasets/bob/d")
    folder = JobView.build(PreflightOptions(push_to=str(tmp_path / "sec")), None, {})
    assert folder.hub_target is None and folder.folder_target == tmp_path / "sec"


# -- budget ------------------------------------------------------------------------------------------------------


def test_unknown_timeout_on_hf_jobs_names_the_30_minute_default() -> None:
    row = check_budget(PreflightOptions(platform="hf_jobs", expected_duration_s=3600))
    assert row.status == "warn" and "30 minutes" in row.seen and "would not fit" in row.seen
    assert "--timeout" in row.hint


def test_timeout_under_1_3_times_the_expected_duration_fails() -> None:
    row = check_budget(PreflightOptions(timeout_s=3600, timeout_source="--timeout", expected_duration_s=3000))
    assert row.status == "fail" and "timeout 1h (from --timeout)" in row.seen and "1h5m" in row.seen


def test_timeout_with_room_passes() -> None:
    row = check_budget(PreflightOptions(timeout_s=7200, timeout_source="SLURM_JOB_END_TIME", expected_duration_s=3600))
    assert row.status == "pass" and row.seen == "timeout 2h (from SLURM_JOB_END_TIME), expected 1h (x2.0)"


# -- distributed -------------------------------------------------------------------------------------------------


def test_not_distributed_is_na() -> None:
    rows = check_distributed(PreflightOptions(), environ={}, gpus=None)
    assert [r.status for r in rows] == ["n/a"]


def test_torchrun_matching_gpus_passes_and_master_addr_resolves() -> None:
    env = {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "RANK": "5", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    rows = check_distributed(PreflightOptions(platform="torchrun"), environ=env, gpus=GPUS4)
    assert [r.status for r in rows] == ["pass"]
    assert "world size 8" in rows[0].seen and "MASTER_ADDR 127.0.0.1 resolves" in rows[0].seen


def test_more_local_ranks_than_gpus_fails() -> None:
    env = {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "127.0.0.1"}
    rows = check_distributed(PreflightOptions(), environ=env, gpus=GPUS4)
    assert [r.status for r in rows] == ["fail"] and "LOCAL_WORLD_SIZE=8 processes on this node, 4 GPUs" in rows[0].seen


def test_fewer_local_ranks_than_gpus_warns() -> None:
    env = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    rows = check_distributed(PreflightOptions(), environ=env, gpus=GPUS4)
    assert [r.status for r in rows] == ["pass", "warn"] and "2 GPUs idle" in rows[1].seen


def test_master_addr_that_does_not_resolve_fails() -> None:
    def resolve(host: str, port: Any) -> Any:
        raise socket.gaierror(-2, "Name or service not known")

    env = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "node-17.invalid"}
    rows = check_distributed(PreflightOptions(), environ=env, gpus=None, resolve=resolve)
    assert [r.status for r in rows] == ["fail"] and "node-17.invalid does not resolve" in rows[0].seen


def test_a_hanging_name_lookup_is_bounded() -> None:
    release = threading.Event()

    def hang(host: str, port: Any) -> Any:
        release.wait(5)
        return []

    env = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "slow-dns"}
    try:
        rows = check_distributed(PreflightOptions(network_timeout_s=0.05), environ=env, gpus=None, resolve=hang)
    finally:
        release.set()
    assert [r.status for r in rows] == ["pass", "warn"] and "no DNS answer in 0.05 s" in rows[1].seen


def test_malformed_world_size_and_missing_master_addr_fail() -> None:
    rows = check_distributed(PreflightOptions(), environ={"WORLD_SIZE": "two", "LOCAL_WORLD_SIZE": "1"}, gpus=None)
    assert any(r.status == "fail" and "WORLD_SIZE='two'" in r.seen for r in rows)
    rows = check_distributed(PreflightOptions(), environ={"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1"}, gpus=None)
    assert any(r.status == "fail" and "MASTER_ADDR is not set" in r.seen for r in rows)


def test_slurm_tasks_per_node_against_gpus() -> None:
    env = {"SLURM_JOB_ID": "42", "SLURM_NTASKS": "16", "SLURM_NTASKS_PER_NODE": "8(x2)"}
    rows = check_distributed(PreflightOptions(platform="slurm"), environ=env, gpus=GPUS4)
    assert any(r.status == "fail" and "SLURM_NTASKS_PER_NODE=8" in r.seen for r in rows)


# -- tracking ----------------------------------------------------------------------------------------------------


def test_no_tracker_is_na() -> None:
    assert [r.status for r in check_tracking(job(), environ={})] == ["n/a"]


def test_a_tracker_that_is_not_installed_fails() -> None:
    rows = check_tracking(job(trackers=frozenset({"notatracker_guard"})), environ={})
    assert [r.status for r in rows] == ["fail"] and "notatracker_guard is not installed" in rows[0].seen


@pytest.fixture
def fake_trackio(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in ``trackio`` package on sys.path (the real one is an optional extra, not installed here)."""
    (tmp_path / "trackio").mkdir()
    (tmp_path / "trackio" / "__init__.py").write_text("__version__ = '0.0-test'\n")
    monkeypatch.syspath_prepend(str(tmp_path))


def test_trackio_space_that_would_be_public_warns(fake_trackio: None) -> None:
    view = job(trackers=frozenset({"trackio"}), trackio_space_id="acme/dash")
    rows = check_tracking(view, environ={"HF_TOKEN": SECRET}, space_private=lambda space: None)
    assert [r.status for r in rows] == ["warn"] and "would be created public" in rows[0].seen
    assert "private=True" in rows[0].hint


def test_trackio_space_private_or_existing_private_passes(fake_trackio: None) -> None:
    private = job(trackers=frozenset({"trackio"}), trackio_space_id="acme/dash", trackio_private=True)
    assert [r.status for r in check_tracking(private, environ={"HF_TOKEN": SECRET})] == ["pass"]
    existing = job(trackers=frozenset({"trackio"}), trackio_space_id="acme/dash")
    rows = check_tracking(existing, environ={"HF_TOKEN": SECRET}, space_private=lambda space: True)
    assert [r.status for r in rows] == ["pass"] and "exists and is private" in rows[0].seen
    public = check_tracking(existing, environ={"HF_TOKEN": SECRET}, space_private=lambda space: False)
    assert [r.status for r in public] == ["warn"] and "is public" in public[0].seen


def test_trackio_space_without_a_token_fails(fake_trackio: None, tmp_path: Path) -> None:
    view = job(trackio_space_id="acme/dash")
    rows = check_tracking(view, environ={"HF_HOME": str(tmp_path / "empty")})
    assert [r.status for r in rows] == ["fail"] and "needs an HF token" in rows[0].seen
