"""The job's own command line, read as HfArgumentParser / TrlParser / nanoGPT's configurator would read it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from guard.preflight._job import args_config
from guard.preflight.cmdline import read_job_args, to_bool


def test_name_value_forms_and_dashes() -> None:
    args = read_job_args(["--output_dir", "out", "--learning_rate=2e-5", "--max-steps", "10", "--seed=-1"])
    assert args.values == {"output_dir": "out", "learning_rate": 2e-5, "max_steps": 10, "seed": -1}
    assert args.given == frozenset(args.values)


@pytest.mark.parametrize(("argv", "expected"), [
    (["--push_to_hub"], True),
    (["--push_to_hub", "true"], True),
    (["--push_to_hub", "False"], False),
    (["--push_to_hub=no"], False),
    (["--push_to_hub", "--output_dir", "out"], True),
    (["--push-to-hub", "1"], True),
])
def test_booleans_as_hfargumentparser_reads_them(argv: list[str], expected: bool) -> None:
    assert read_job_args(argv).flag("push_to_hub") is expected


def test_several_values_are_a_list_and_commas_split() -> None:
    assert read_job_args(["--report_to", "wandb", "mlflow", "--bf16"]).items("report_to") == ["wandb", "mlflow"]
    assert read_job_args(["--report_to=wandb,trackio"]).items("report_to") == ["wandb", "trackio"]
    assert read_job_args(["--bf16"]).items("report_to") == []


def test_a_json_positional_is_read_and_flags_win(tmp_path: Path) -> None:
    (tmp_path / "args.json").write_text(json.dumps({"output_dir": "from-file", "report_to": ["wandb"],
                                                    "push_to_hub": True}))
    args = read_job_args(["args.json"], cwd=tmp_path)
    assert args.values["report_to"] == ["wandb"] and args.flag("push_to_hub") is True
    assert args.config_files == (tmp_path / "args.json",) and args.given == frozenset()
    assert args.source("report_to", "wandb") == "report_to: wandb in args.json"
    both = read_job_args(["args.json", "--output_dir", "cli"], cwd=tmp_path)
    assert both.text("output_dir") == "cli" and both.source("output_dir", "cli") == "--output_dir cli"


def test_trl_config_flag_reads_yaml(tmp_path: Path) -> None:
    (tmp_path / "sft.yaml").write_text("output_dir: out\nreport_to:\n  - wandb\nhub_model_id: acme/sft\n")
    args = read_job_args(["--config", "sft.yaml", "--push_to_hub"], cwd=tmp_path)
    assert args.text("hub_model_id") == "acme/sft" and args.flag("push_to_hub") is True
    assert args_config(args) == {"output_dir": "out", "push_to_hub": True, "hub_model_id": "acme/sft",
                                 "report_to": ["wandb"]}


def test_a_python_config_positional_gives_its_literals(tmp_path: Path) -> None:
    (tmp_path / "cfg.py").write_text("wandb_log = True\nout_dir = 'out-x'\nlr = 1e-3 * 2\n")
    args = read_job_args(["cfg.py", "--compile=False"], cwd=tmp_path)
    assert args.values == {"wandb_log": True, "out_dir": "out-x", "compile": False}


def test_unreadable_config_is_a_problem_not_an_error(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text("{not json")
    args = read_job_args(["bad.json", "--config", "missing.yaml"], cwd=tmp_path)
    assert args.values == {} and len(args.problems) == 2
    assert "bad.json" in args.problems[0] and "missing.yaml" in args.problems[1]


def test_report_to_none_means_no_tracker_and_to_bool() -> None:
    assert args_config(read_job_args(["--report_to", "none"])) == {"report_to": []}
    assert [to_bool(v) for v in ("YES", "f", 1, "maybe", None)] == [True, False, True, None, None]
