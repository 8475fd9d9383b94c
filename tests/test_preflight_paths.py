"""Paths not taken and the job's command line, through ``run_preflight``: public-script shapes of our own."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import textwrap
from pathlib import Path
from typing import Any

from guard.preflight import GpuInfo, PreflightOptions, run_preflight
from guard.preflight._job import JobView
from guard.preflight.cmdline import read_job_args
from guard.preflight.script import analyze_script
from guard.preflight.trainer import check_compile_mentions

# run_clm.py / TRL sft.py shape: arguments parsed by HfArgumentParser, a push only when asked.
HF_STYLE = '''
import sys
from transformers import HfArgumentParser, Trainer, TrainingArguments

def main():
    parser = HfArgumentParser((TrainingArguments,))
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        (training_args,) = parser.parse_json_file(json_file=sys.argv[1])
    else:
        (training_args,) = parser.parse_args_into_dataclasses()
    trainer = Trainer(model=None, args=training_args)
    trainer.train()
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name="x")
    else:
        trainer.create_model_card()

if __name__ == "__main__":
    main()
'''

# nanoGPT train.py shape: flags as module globals, the tracker imported and started only when on.
NANO_STYLE = '''
import os
import torch
wandb_log = False
compile = True
master_process = int(os.environ.get("RANK", "0")) == 0
if wandb_log and master_process:
    import wandb
    wandb.init(project="p")
model = torch.nn.Linear(2, 2)
if compile:
    model = torch.compile(model)
'''


def write(tmp_path: Path, text: str, name: str = "train.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def rows(tmp_path: Path, script: Path, *args: str, **environ: str) -> dict[str, list[Any]]:
    opts = PreflightOptions(script=script, script_args=tuple(args), output_dir=tmp_path / "out",
                            skip_checks={"python": "tested elsewhere", "gpu": "none here"})
    env = {"HF_HOME": str(tmp_path / "hf"), "HOME": str(tmp_path), **environ}
    report = run_preflight(opts, environ=env)
    out: dict[str, list[Any]] = {}
    for row in report.results:
        out.setdefault(row.name, []).append(row)
    return out


def statuses(found: dict[str, list[Any]], name: str) -> list[str]:
    return [row.status for row in found[name]]


def test_a_push_only_under_its_flag_is_logged_at_debug_not_a_warning(tmp_path: Path, caplog) -> None:
    with caplog.at_level(logging.DEBUG, logger="guard.preflight"):
        found = rows(tmp_path, write(tmp_path, HF_STYLE))
    assert "warn" not in statuses(found, "env") and "fail" not in statuses(found, "env")
    assert "HF_TOKEN not set: " in caplog.text and "runs only if training_args.push_to_hub" in caplog.text
    assert statuses(found, "hub-auth") == ["n/a"]


# A transformers example's shape (examples/pytorch/language-modeling/run_clm.py): PEP 723 metadata with unpinned
# dependencies, check_min_version, require_version, send_example_telemetry, optional integrations under an `if`,
# a push under its flag.
UPSTREAM = """
# /// script
# dependencies = [
#     "packaging",
#     "transformers @ git+https://github.com/huggingface/transformers.git",
# ]
# ///
import sys

from transformers import HfArgumentParser, Trainer, TrainingArguments
from transformers.utils import check_min_version, send_example_telemetry
from transformers.utils.versions import require_version

check_min_version("4.0.0")
require_version("datasets>=2.14.0", "To fix: pip install -r requirements.txt")


def main():
    (training_args,) = HfArgumentParser((TrainingArguments,)).parse_args_into_dataclasses()
    send_example_telemetry("run_clm", training_args)
    if training_args.report_to == ["wandb"]:
        import notapkg_guard_optional_xyz
    trainer = Trainer(model=None, args=training_args)
    trainer.train()
    if training_args.push_to_hub:
        trainer.push_to_hub()


if __name__ == "__main__":
    main()
"""


def test_an_upstream_scripts_metadata_gets_no_warning_its_user_cannot_act_on(tmp_path: Path) -> None:
    # issue 21: every upstream script got 3-4 warnings about its own metadata; a warning names something to do
    script = write(tmp_path, UPSTREAM)
    opts = PreflightOptions(script=script, output_dir=tmp_path / "out", timeout_s=3600.0,
                            skip_checks={"gpu": "none here"})
    report = run_preflight(opts, environ={"HF_HOME": str(tmp_path / "hf"), "HOME": str(tmp_path),
                                          "PATH": os.environ.get("PATH", "")})
    warned = [(r.name, r.seen) for r in report.results if r.status == "warn"]
    assert warned == [], warned


def test_push_to_hub_on_the_command_line_needs_a_write_token(tmp_path: Path) -> None:
    found = rows(tmp_path, write(tmp_path, HF_STYLE), "--output_dir", "o", "--push_to_hub", "--hub_model_id", "acme/m")
    assert found["env"][0].status == "fail" and "--hub_model_id acme/m" in found["env"][0].seen
    assert statuses(found, "hub-auth") == ["fail"]
    off = rows(tmp_path, write(tmp_path, HF_STYLE), "--push_to_hub", "false")
    assert "fail" not in statuses(off, "env") + statuses(off, "hub-auth")


def test_report_to_wandb_on_the_command_line_without_a_key_fails(tmp_path: Path) -> None:
    found = rows(tmp_path, write(tmp_path, HF_STYLE), "--report_to", "wandb", "--output_dir", "o")
    env_fail = [r for r in found["env"] if r.status == "fail"]
    assert env_fail and "--report_to wandb" in env_fail[0].seen
    honoured = rows(tmp_path, write(tmp_path, HF_STYLE), "--report_to", "wandb", WANDB_MODE="disabled")
    assert "fail" not in statuses(honoured, "env") + statuses(honoured, "tracking")


def test_a_json_config_argument_is_read_like_the_command_line(tmp_path: Path) -> None:
    (tmp_path / "args.json").write_text(json.dumps({"output_dir": str(tmp_path / "from-json"),
                                                    "report_to": "wandb"}))
    script = write(tmp_path, HF_STYLE)
    opts = PreflightOptions(script=script, script_args=(str(tmp_path / "args.json"),),
                            skip_checks={"python": "x", "gpu": "x"})
    report = run_preflight(opts, environ={"HF_HOME": str(tmp_path / "hf"), "HOME": str(tmp_path)})
    assert report.failed is not None and report.failed.name == "env"
    assert "report_to: wandb in args.json" in report.failed.seen
    assert any("from-json" in r.seen for r in report.results if r.name == "storage")


def test_a_tracker_import_under_a_false_flag_is_not_a_failure(tmp_path: Path) -> None:
    script = write(tmp_path, NANO_STYLE)
    facts = analyze_script(script)
    assert "wandb" not in facts.imports and facts.trackers == frozenset()
    assert {(m.kind, m.what, m.taken) for m in facts.mentions} == {("import", "wandb", False),
                                                                  ("tracker", "wandb", False)}
    found = rows(tmp_path, script)
    assert "fail" not in statuses(found, "env") + statuses(found, "tracking")
    assert statuses(found, "tracking") == ["n/a"]  # the python row warns for the import, once
    if importlib.util.find_spec("wandb") is None:
        view = JobView.build(PreflightOptions(script=script), facts, {})
        from guard.preflight.misc import check_optional_imports
        assert check_optional_imports(view) == []  # off: logged at DEBUG, nothing to act on (issue 21)


def test_turning_the_flag_on_makes_it_count(tmp_path: Path) -> None:
    found = rows(tmp_path, write(tmp_path, NANO_STYLE), "--wandb_log=True")
    assert "fail" in statuses(found, "env")  # no WANDB_API_KEY, and the user asked for wandb
    facts = analyze_script(write(tmp_path, NANO_STYLE), overrides=read_job_args(["--wandb_log=True"]).values)
    assert "wandb" in facts.imports and facts.trackers == frozenset({"wandb"})


def test_compile_under_a_flag_is_counted_only_when_on(tmp_path: Path) -> None:
    script = write(tmp_path, NANO_STYLE)
    assert analyze_script(script).trainer_config.get("torch_compile") is True  # compile = True by default
    off = analyze_script(script, overrides={"compile": False})
    assert "torch_compile" not in off.trainer_config
    assert [(m.kind, m.taken) for m in off.mentions if m.kind == "compile"] == [("compile", False)]
    unknown = analyze_script(write(tmp_path, "import torch, sys\nm = None\nif sys.argv[1:]:\n"
                                             "    m = torch.compile(m)\n", "u.py"))
    assert "torch_compile" not in unknown.trainer_config
    old = [GpuInfo(0, "Tesla P100", "GPU-0", (6, 0))]
    view = JobView.build(PreflightOptions(script=script), off, {})
    assert [r.status for r in check_compile_mentions(view, old)] == ["warn"]
    assert check_compile_mentions(view, [GpuInfo(0, "NVIDIA H100", "GPU-0", (9, 0))]) == []


def test_main_guard_and_else_branches(tmp_path: Path) -> None:
    facts = analyze_script(write(tmp_path, '''
        import torch
        debug = False
        if __name__ == "__main__":
            import transformers
        if debug:
            pass
        else:
            import datasets
        if not debug:
            torch.compile(None)
    '''))
    assert facts.imports == ("torch", "transformers", "datasets")
    assert facts.trainer_config.get("torch_compile") is True and facts.mentions == ()


def test_the_trainers_actual_settings_need_their_credentials(tmp_path: Path) -> None:
    from guard.preflight.trainer import check_job_settings

    base = {"HOME": str(tmp_path), "HF_HOME": str(tmp_path / "hf")}

    def failed(config: dict[str, Any], **environ: str) -> list[tuple[str, str]]:
        rows = check_job_settings(config, gpus=None, timeout_known=False, environ={**base, **environ})
        return [(r.name, r.seen) for r in rows if r.status == "fail"]

    wandb = failed({"report_to": ["wandb"], "output_dir": "o"})
    assert ("env", "WANDB_API_KEY not set and no wandb login (TrainingArguments report_to wandb)") in wandb
    assert not [r for r in failed({"report_to": ["wandb"]}, WANDB_MODE="offline") if r[0] == "env"]
    assert not [r for r in failed({"report_to": ["wandb"]}, WANDB_API_KEY="k") if r[0] == "env"]
    push = failed({"push_to_hub": True, "hub_model_id": "acme/m", "report_to": []})
    assert [name for name, _ in push] == ["env"] and "hub_model_id='acme/m'" in push[0][1]
    assert failed({"push_to_hub": False, "report_to": []}) == []
