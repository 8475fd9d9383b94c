"""Trainer-config checks: the agent's dict, and the same checks from a real script's static literals."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

from guard.preflight import PreflightOptions, check_trainer_config, run_preflight
from guard.preflight.gpu import GpuInfo
from guard.preflight.script import analyze_script

T4 = GpuInfo(0, "Tesla T4", "GPU-t4", (7, 5), 16 * 10**9)
P100 = GpuInfo(0, "Tesla P100-PCIE-16GB", "GPU-p100", (6, 0), 16 * 10**9)
H100 = GpuInfo(0, "NVIDIA H100", "GPU-h100", (9, 0), 80 * 10**9)

AGENT_CONFIG: dict[str, Any] = {
    "output_dir": "out", "push_to_hub": False, "hub_model_id": None, "hub_strategy": "every_save",
    "save_strategy": "steps", "eval_strategy": "no", "report_to": [], "bf16": False, "fp16": False,
    "torch_compile": False, "gradient_checkpointing": False, "has_eval_dataset": False, "max_steps": 100,
    "loss_class": None,
}


def check(gpus: list[GpuInfo] | None = None, timeout_known: bool = False, environ: dict[str, str] | None = None,
          **changes: Any) -> list:
    return check_trainer_config({**AGENT_CONFIG, **changes}, gpus=gpus, timeout_known=timeout_known,
                                environ=environ or {})


def only(rows: list) -> Any:
    assert len(rows) == 1, rows
    return rows[0]


def test_a_sound_config_passes_with_a_summary() -> None:
    row = only(check(gpus=[H100], bf16=True, timeout_known=True))
    assert row.status == "pass" and "bf16=True" in row.seen and "GPU cc 9.0" in row.seen


def test_eval_strategy_without_eval_dataset_fails() -> None:
    row = only(check(eval_strategy="steps"))
    assert row.status == "fail" and "eval_strategy='steps'" in row.seen and "eval_dataset" in row.hint


def test_eval_strategy_enum_text_is_understood() -> None:
    assert only(check(eval_strategy="IntervalStrategy.EPOCH")).status == "fail"
    assert only(check(eval_strategy="epoch", has_eval_dataset=True)).status == "pass"


def test_push_to_hub_without_hub_model_id_warns_with_the_repo_it_would_use() -> None:
    row = only(check(push_to_hub=True, output_dir="/data/run-7"))
    assert row.status == "warn" and "<your user>/run-7" in row.seen


def test_push_to_hub_while_offline_fails() -> None:
    rows = check(push_to_hub=True, hub_model_id="acme/x", environ={"HF_HUB_OFFLINE": "1"})
    assert [r.status for r in rows] == ["fail"] and "HF_HUB_OFFLINE=1" in rows[0].seen


@pytest.mark.parametrize(("changes", "text"), [
    ({"save_strategy": "no"}, "save_strategy='no'"),
    ({"push_to_hub": True, "hub_model_id": "acme/x", "hub_strategy": "end"}, "hub_strategy='end'"),
])
def test_settings_that_lose_work_on_a_kill_warn_only_with_a_deadline(changes: dict, text: str) -> None:
    row = only(check(timeout_known=True, **changes))
    assert row.status == "warn" and text in row.seen
    assert only(check(timeout_known=False, **changes)).status == "pass"


def test_bf16_below_cc_8_fails() -> None:
    row = only(check(gpus=[T4], bf16=True))
    assert row.status == "fail" and "cc 7.5" in row.seen and "fp16" in row.hint


def test_torch_compile_below_cc_7_fails_and_passes_on_cc_7_5() -> None:
    row = only(check(gpus=[P100], torch_compile=True))
    assert row.status == "fail" and "Triton needs cc 7.0+" in row.seen
    assert only(check(gpus=[T4], torch_compile=True)).status == "pass"


def test_unknown_gpus_skip_the_capability_checks() -> None:
    assert only(check(gpus=None, bf16=True, torch_compile=True)).status == "pass"


def test_gradient_checkpointing_with_a_cached_loss_warns() -> None:
    row = only(check(gradient_checkpointing=True, loss_class="CachedMultipleNegativesRankingLoss"))
    assert row.status == "warn" and "GradCache" in row.seen
    assert only(check(gradient_checkpointing=True, loss_class="MultipleNegativesRankingLoss")).status == "pass"


def test_missing_keys_are_unknown_not_flagged() -> None:
    rows = check_trainer_config({"eval_strategy": "steps"}, gpus=None, timeout_known=True, environ={})
    assert only(rows).status == "pass"
    empty = check_trainer_config({}, gpus=None, timeout_known=True, environ={})
    assert only(empty).status == "n/a"


def test_the_static_config_has_the_agent_shape_and_fails_the_same_way(tmp_path: Path) -> None:
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent('''
        from transformers import Trainer, TrainingArguments
        args = TrainingArguments(output_dir="out", eval_strategy="epoch", bf16=True, save_strategy="no")
        Trainer(model=model, args=args, train_dataset=train)
    '''))
    config = analyze_script(path).trainer_config
    assert set(config) <= set(AGENT_CONFIG) | {"hub_private_repo", "trackio_space_id"}
    rows = check_trainer_config(config, gpus=[T4], timeout_known=True, environ={})
    assert sorted((r.status, r.seen.split(" ")[0]) for r in rows) == [
        ("fail", "bf16=True"), ("fail", "eval_strategy='epoch'"), ("warn", "save_strategy='no'")]


def test_run_preflight_reports_the_static_trainer_failure(tmp_path: Path) -> None:
    path = tmp_path / "train.py"
    path.write_text('from transformers import TrainingArguments\nTrainingArguments("o", eval_strategy="steps")\n'
                    'Trainer(model=m, args=a)\n')
    report = run_preflight(PreflightOptions(script=path, skip_checks={"python": "test", "gpu": "test"}),
                           environ={"HF_HOME": str(tmp_path)})
    assert report.failed is not None and report.failed.name == "trainer-config"
    assert "eval_strategy='steps'" in report.failed.seen
