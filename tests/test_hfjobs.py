"""The script's [tool.hf-jobs] table, the flavor table, the uv decision: against the real huggingface_hub and uv."""

from __future__ import annotations

import os
import shutil
import sys
import textwrap
from pathlib import Path

import pytest

from guard.errors import UsageError
from guard.preflight import PreflightOptions, run_preflight, with_flavor_gpus
from guard.preflight._job import JobView
from guard.preflight.env import check_env
from guard.preflight.hfjobs import FLAVORS, VALID_KEYS, expected_flavor, read_hf_jobs
from guard.run import uvenv
from guard.run.cli import build_config
from guard.run.platform import detect
from guard.run.stages import resolve_budget

HF_ENV = {"JOB_ID": "6712ab", "CPU_CORES": "2", "MEMORY": "16Gi", "ACCELERATOR": ""}


def header(table: str, deps: str = "[]") -> str:
    body = "\n".join(f"# {line}" if line else "#" for line in textwrap.dedent(table).strip().splitlines())
    return f"# /// script\n# dependencies = {deps}\n#\n# [tool.hf-jobs]\n{body}\n# ///\nprint('hi')\n"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "train.py"
    path.write_text(text)
    return path


def test_table_is_read_like_hf_jobs_uv_run_reads_it(tmp_path: Path) -> None:
    from huggingface_hub.cli._uv_script_header import parse_uv_script_header

    text = header('''
        flavor = "a10g-large"
        timeout = "1.5h"
        secrets = ["HF_TOKEN", "WANDB_API_KEY"]
        env = { MODE = "fast" }
        labels = { team = "nlp" }
    ''')
    table = read_hf_jobs(text, path=Path("train.py"))
    theirs = parse_uv_script_header(text)
    assert table is not None and table.error is None and theirs is not None
    assert (table.flavor, table.timeout_text, list(table.secrets)) == (theirs.flavor, theirs.timeout, theirs.secrets)
    assert list(table.env) == list(theirs.env)
    assert table.timeout_s == 5400


def test_valid_keys_and_flavors_match_the_installed_huggingface_hub() -> None:
    from huggingface_hub import JobHardware
    from huggingface_hub.cli._uv_script_header import VALID_KEYS as THEIRS

    assert VALID_KEYS == THEIRS
    assert set(FLAVORS) == {flavor.value for flavor in JobHardware}


@pytest.mark.parametrize(("table", "line", "text"), [
    ('flavor = "t4-small"\ntimeot = "2h"', 6, "unknown key 'timeot'"),
    ('flavor = "t4-small"\ntimeout = true', 6, "timeout must be a duration"),
    ('timeout = "two hours"', 5, "'two hours' is not a positive duration"),
    ('secrets = { HF_TOKEN = "hf_x" }', 5, "secrets must be a list of names"),
    ('flavor = "t4-small"\n\nenv = { A = 1 }', 7, "env must be a table of strings"),
])
def test_a_malformed_table_names_its_line(table: str, line: int, text: str) -> None:
    result = read_hf_jobs(header(table), path=Path("train.py"))
    assert result is not None and result.error is not None
    assert result.error.startswith(f"train.py line {line}: [tool.hf-jobs] ")
    assert text in result.error


def test_a_malformed_table_fails_preflight_with_the_line(tmp_path: Path) -> None:
    path = write(tmp_path, header('timeout = "soon"'))
    report = run_preflight(PreflightOptions(script=path, skip_checks={"gpu": "t", "storage": "t"}), environ={})
    assert report.failed is not None and report.failed.name == "python"
    assert report.failed.seen.startswith("train.py line 5: [tool.hf-jobs] timeout 'soon'")


def test_no_table_no_block() -> None:
    assert read_hf_jobs("print(1)\n", path=Path("x.py")) is None
    assert read_hf_jobs("# /// script\n# dependencies = []\n# ///\n", path=Path("x.py")) is None


def test_timeout_from_the_table_is_the_deadline_when_no_flag(tmp_path: Path) -> None:
    path = write(tmp_path, header('timeout = "40s"'))
    config = build_config([str(path)], {})
    deadline = resolve_budget(config, detect({}))
    assert deadline.timeout_s == 40 and deadline.source.startswith("[tool.hf-jobs] timeout in train.py 40s from")
    flagged = build_config(["--timeout", "2h", str(path)], {})
    assert resolve_budget(flagged, detect({})).timeout_s == 7200
    env = build_config([str(path)], {"GUARD_TIMEOUT": "90m"})
    assert resolve_budget(env, detect({})).source.startswith("GUARD_TIMEOUT 1h30m")


def test_table_secrets_and_env_are_required_on_hf_jobs(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = write(tmp_path, header('secrets = ["MY_SECRET"]\nenv = { MODE = "x" }'))
    table = read_hf_jobs(path.read_text(), path=path)
    opts = PreflightOptions(script=path, platform="hf_jobs")
    rows = check_env(opts, JobView.build(opts, None, {}), environ={}, hf_jobs=table)
    assert [(r.status, r.seen.split(" (")[0]) for r in rows] == [("fail", "MY_SECRET not set"),
                                                                 ("fail", "MODE not set")]
    assert "[tool.hf-jobs] secrets in train.py" in rows[0].seen
    # off HF Jobs the table's names are not required: the script's metadata, nothing to act on, logged at DEBUG
    opts = PreflightOptions(script=path, platform="local")
    with caplog.at_level("DEBUG", logger="guard.preflight"):
        rows = check_env(opts, JobView.build(opts, None, {}), environ={}, hf_jobs=table)
    assert not [r for r in rows if r.status in ("warn", "fail")], rows
    assert "MY_SECRET not set" in caplog.text and "not on HF Jobs, so not required" in caplog.text
    opts = PreflightOptions(script=path, platform="hf_jobs")
    rows = check_env(opts, JobView.build(opts, None, {}), environ={"MY_SECRET": "s3cr3t-value", "MODE": "x"},
                     hf_jobs=table)
    assert [r.status for r in rows] == ["pass"] and "MY_SECRET ([tool.hf-jobs] secrets" in rows[0].seen


def test_flavor_gives_the_gpu_expectation_on_hf_jobs(tmp_path: Path) -> None:
    table = read_hf_jobs(header('flavor = "a100x4"'), path=Path("train.py"))
    opts = with_flavor_gpus(PreflightOptions(platform="hf_jobs"), table, HF_ENV)
    assert (opts.require_gpus, opts.gpu_type) == (4, "A100")
    assert opts.gpu_source == "flavor a100x4 ([tool.hf-jobs] flavor in train.py): 4x A100"
    # ACCELERATOR (what the platform gave, e.g. after hf jobs run --flavor) wins over the table
    opts = with_flavor_gpus(PreflightOptions(platform="hf_jobs"), table, {**HF_ENV, "ACCELERATOR": "l4x1"})
    assert (opts.require_gpus, opts.gpu_type) == (1, "L4")
    assert expected_flavor(None, {"ACCELERATOR": "none"}) is None
    # flags win; elsewhere than HF Jobs nothing is expected; CPU flavors expect nothing
    assert with_flavor_gpus(PreflightOptions(platform="hf_jobs", require_gpus=1), table, HF_ENV).gpu_type is None
    assert with_flavor_gpus(PreflightOptions(platform="local"), table, HF_ENV).require_gpus is None
    cpu = read_hf_jobs(header('flavor = "cpu-basic"'), path=Path("train.py"))
    assert with_flavor_gpus(PreflightOptions(platform="hf_jobs"), cpu, HF_ENV).require_gpus is None


def test_a_gpu_flavor_without_a_gpu_fails_the_gpu_check(tmp_path: Path) -> None:
    path = write(tmp_path, header('flavor = "t4-small"'))
    report = run_preflight(PreflightOptions(script=path, platform="hf_jobs", skip_checks={"python": "t"}),
                           environ=HF_ENV)
    gpu = [row for row in report.results if row.name == "gpu"]
    assert gpu[0].status == "fail" and "flavor t4-small ([tool.hf-jobs] flavor in train.py): 1x T4" in gpu[0].seen


def test_uv_option_parses() -> None:
    assert build_config(["--uv", "on", "--", "true"], {}).settings.job.uv == "on"
    assert build_config(["--", "true"], {"GUARD_UV": "off"}).settings.job.uv == "off"
    assert build_config(["--", "true"], {}).settings.job.uv == "auto"
    with pytest.raises(UsageError, match="--uv: 'maybe'; accepted: auto, on, off"):
        build_config(["--uv", "maybe", "--", "true"], {})


def test_under_uv_is_read_from_what_uv_run_sets() -> None:
    uv = shutil.which("uv") or os.path.join(os.path.dirname(sys.executable), "uv")
    assert uvenv.under_uv({}) is None
    assert uvenv.under_uv({"VIRTUAL_ENV": "/x"}) is None
    assert uvenv.under_uv({"UV": uv}) == uv


def test_uv_plan(tmp_path: Path) -> None:
    uv = os.path.join(os.path.dirname(sys.executable), "uv")
    dep = tmp_path / "dep.py"
    dep.write_text("# /// script\n# dependencies = ['notapkg-xyz-guard']\n# ///\n")
    satisfied = tmp_path / "ok.py"
    satisfied.write_text("# /// script\n# dependencies = ['packaging']\n# ///\n")
    plain = tmp_path / "plain.py"
    plain.write_text("print(1)\n")
    assert uvenv.plan_uv("auto", dep, {}).use is False  # plain pip/conda: never
    assert "does not run under uv" in uvenv.plan_uv("auto", dep, {}).why
    under = uvenv.plan_uv("auto", dep, {"UV": uv})
    assert under.use and under.missing == ("notapkg-xyz-guard",) and under.uv == uv
    assert uvenv.plan_uv("auto", satisfied, {"UV": uv}).use is False
    assert uvenv.plan_uv("on", satisfied, {"PATH": os.path.dirname(uv)}).use is True
    assert uvenv.plan_uv("off", dep, {"UV": uv}).use is False
    assert uvenv.plan_uv("on", plain, {}).use is False
    assert uvenv.plan_uv("on", None, {}).use is False


def test_sync_without_uv_is_an_error_not_an_exception(tmp_path: Path) -> None:
    env = uvenv.sync_script(None, tmp_path / "x.py", {})
    assert env.python is None and env.error == "uv is not on PATH"


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: comments dropped, backslash continuations joined (Dockerfile reference)."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pending += line[:-1] + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            keyword, _, rest = pending.partition(" ")
            instructions.append((keyword.upper(), rest.strip()))
            pending = ""
    return instructions


def test_dockerfile_is_well_formed_and_says_where_the_script_comes_from() -> None:
    import json
    import shlex

    repo = Path(__file__).resolve().parent.parent
    path = repo / "docker" / "Dockerfile"
    steps = dockerfile_instructions(path)
    assert steps[0][0] == "FROM"
    for keyword, args in steps:
        if keyword == "ENV":
            names = [part.split("=", 1)[0] for part in shlex.split(args)]
            assert "PYTHONUNBUFFERED" not in names, "PYTHONUNBUFFERED slows the guard's output passthrough"
        if keyword == "COPY":  # every source is in the build context (the repository root)
            for source in shlex.split(args)[:-1]:
                assert (repo / source).exists(), source
    entrypoint = json.loads(next(args for keyword, args in steps if keyword == "ENTRYPOINT"))
    assert entrypoint == ["/entrypoint.sh"]
    assert 'exec jobguard "$@"' in (repo / "entrypoint.sh").read_text()  # not shadowed by a guard.py in /workspace
    comments = path.read_text()
    assert "-v hf://" in comments and "COPY train.py" in comments
