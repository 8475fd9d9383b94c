"""End to end: what the job's command line asks for is checked before the job starts, and again when its
``TrainingArguments`` is built (before its data work)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from conftest import JOBS, run_guard

pytestmark = pytest.mark.slow


def no_keys(tmp_path: Path) -> dict[str, str]:
    return {"HOME": str(tmp_path), "HF_HOME": str(tmp_path / "hf"), "HF_TOKEN": "", "HUGGING_FACE_HUB_TOKEN": "",
            "WANDB_API_KEY": "", "WANDB_MODE": "", "WANDB_DISABLED": ""}


def test_report_to_wandb_without_a_key_fails_before_the_job_starts(tmp_path: Path) -> None:
    started = time.monotonic()
    run = run_guard(["--skip-check", "python=imports checked by the other tests", str(JOBS / "hf_args.py"),
                     "--output_dir", str(tmp_path / "out"), "--report_to", "wandb", "--use_cpu"],
                    env=no_keys(tmp_path))
    assert run.returncode == 3, run.stderr
    assert (run.fields()["reason"], run.fields()["check"]) == ("preflight", "env")
    assert "--report_to wandb" in run.stderr
    assert "data work started" not in run.stdout
    assert time.monotonic() - started < 20  # the job's own 20 s of data work never ran


def test_a_missing_key_fails_when_training_arguments_are_built(tmp_path: Path) -> None:
    run = run_guard(["--no-preflight", str(JOBS / "hf_args.py"), "--output_dir", str(tmp_path / "out"),
                     "--report_to", "wandb", "--use_cpu"], env=no_keys(tmp_path))
    assert run.returncode == 3, run.stderr
    assert (run.fields()["reason"], run.fields()["check"]) == ("preflight", "env")
    assert "preflight env fail: WANDB_API_KEY not set" in run.stderr
    assert "data work done" not in run.stdout


def test_push_only_when_asked_passes_preflight_without_a_warning(tmp_path: Path) -> None:
    # issue 21: a push under a flag that is off is nothing its user can act on: DEBUG, not a warning row
    run = run_guard(["preflight", "--skip-check", "python=checked elsewhere", str(JOBS / "hf_args.py"),
                     "--output_dir", str(tmp_path / "out")], env=no_keys(tmp_path))
    assert run.returncode == 0, run.stderr
    assert "runs only if training_args.push_to_hub" not in run.stderr
    config = tmp_path / "args.json"
    config.write_text(json.dumps({"output_dir": str(tmp_path / "out"), "push_to_hub": True}))
    asked = run_guard(["preflight", "--skip-check", "python=checked elsewhere", str(JOBS / "hf_args.py"),
                       str(config)], env=no_keys(tmp_path))
    assert asked.returncode == 3 and asked.fields()["check"] == "env", asked.stderr
    assert "push_to_hub: True in args.json" in asked.stderr


def test_a_syntax_error_is_a_preflight_failure_with_the_caret(tmp_path: Path) -> None:
    broken = tmp_path / "train.py"
    broken.write_text("import os\nx = (1,\n  2]\n")
    run = run_guard([str(broken)])
    assert run.returncode == 3, run.stderr
    assert run.verdict.startswith("VERDICT: FAIL reason=preflight exit=3")
    assert run.fields()["check"] == "script"
    lines = run.stderr.splitlines()
    at = next(i for i, line in enumerate(lines) if "does not parse: line 3" in line)
    assert lines[at + 1] == "[guard]     2]" and lines[at + 2] == "[guard]      ^"


def test_a_guard_option_after_the_script_gets_a_hint_when_the_job_refuses_it(tmp_path: Path) -> None:
    job = tmp_path / "train.py"
    job.write_text("import argparse\np = argparse.ArgumentParser()\np.add_argument('--steps', type=int)\n"
                   "p.parse_args()\n")
    run = run_guard(["--no-preflight", str(job), "--timeout", "1h"])
    # the job's argparse exit 2 is the guard's usage code: exit 1, the job's own in job_exit=
    assert run.returncode == 1 and run.fields()["reason"] == "crash", run.stderr
    assert run.fields()["job_exit"] == "2"
    assert "guard options go before the script" in run.fields()["hint"]
    assert "--timeout, also a guard option" in run.stderr  # said at the start too
    assert "traceback" not in run.fields()["hint"]
