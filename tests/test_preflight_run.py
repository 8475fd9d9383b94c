"""run_preflight as a whole: skips, order, the table, the JSON, secrets, laziness, crash containment."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import guard.preflight as preflight
from guard.errors import UsageError
from guard.preflight import CHECK_NAMES, CheckResult, PreflightOptions, render_table, run_preflight

REPO = Path(__file__).resolve().parent.parent
SECRET = "hf_" + "Z" * 34


class NoNvml:
    """A ``pynvml`` stand-in whose init fails like on a machine without the driver."""

    import pynvml as _real

    NVMLError = _real.NVMLError
    NVML_ERROR_LIBRARY_NOT_FOUND = _real.NVML_ERROR_LIBRARY_NOT_FOUND

    def nvmlInit(self) -> None:
        raise self._real.NVMLError(self._real.NVML_ERROR_LIBRARY_NOT_FOUND)


def env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {"HF_HOME": str(tmp_path / "hf"), "HOME": str(tmp_path), **extra}


def quick(tmp_path: Path, **opts: Any) -> preflight.PreflightReport:
    return run_preflight(PreflightOptions(**opts), environ=env(tmp_path), nvml=NoNvml())


def test_rows_come_in_check_order_and_every_group_has_a_row(tmp_path: Path) -> None:
    report = quick(tmp_path)
    names = [row.name for row in report.results]
    assert set(names) == set(CHECK_NAMES)
    assert names == sorted(names, key=CHECK_NAMES.index)
    assert all(row.seen for row in report.results)  # n/a always carries its reason


def test_no_driver_row_reads_like_the_issue(tmp_path: Path) -> None:
    report = quick(tmp_path)
    assert [r for r in report.results if r.name == "gpu"] == [
        CheckResult("gpu", "n/a", "no NVIDIA driver: libnvidia-ml not found")]
    assert "gpu             n/a    no NVIDIA driver: libnvidia-ml not found" in render_table(report).splitlines()


@pytest.mark.parametrize("name", CHECK_NAMES)
def test_skip_check_turns_a_group_into_one_na_row_with_the_reason(tmp_path: Path, name: str) -> None:
    report = quick(tmp_path, skip_checks={name: "checked by the cluster's prolog"}, require_gpus=1)
    rows = [r for r in report.results if r.name == name]
    assert rows == [CheckResult(name, "n/a", "skipped by --skip-check: checked by the cluster's prolog")]


def test_unknown_skip_name_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError) as err:
        quick(tmp_path, skip_checks={"gpus": "typo"})
    assert err.value.option == "--skip-check" and "'gpus'" in err.value.message and "gpu" in err.value.message


def test_failed_is_the_first_fail_and_to_json_has_every_row(tmp_path: Path) -> None:
    report = quick(tmp_path, require_gpus=1, require_env=("NOT_SET_GUARD_VAR",))
    assert report.failed is not None and report.failed.name == "env"  # env comes before gpu
    data = report.to_json()
    assert json.loads(json.dumps(data)) == data
    assert data[0] == {"name": "env", "status": "fail", "seen": "NOT_SET_GUARD_VAR not set (--require-env)",
                       "hint": data[0]["hint"]}
    assert [d["name"] for d in data] == [r.name for r in report.results]
    assert any(d["name"] == "gpu" and d["status"] == "fail" for d in data)


def test_elapsed_comes_from_the_injected_clock(tmp_path: Path) -> None:
    ticks = itertools.count(100.0, 2.5)
    report = run_preflight(PreflightOptions(), environ=env(tmp_path), nvml=NoNvml(), clock=lambda: next(ticks))
    assert report.elapsed_s == 2.5


def test_secret_values_are_never_in_the_table_or_json(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text('from transformers import TrainingArguments\n'
                      'TrainingArguments(output_dir="o", push_to_hub=True, hub_model_id="acme/m")\n')
    environ = env(tmp_path, HF_TOKEN=SECRET, MY_API_KEY="v" * 20, HF_HUB_OFFLINE="1")
    report = run_preflight(PreflightOptions(script=script, require_env=("MY_API_KEY",),
                                            skip_checks={"python": "t"}), environ=environ, nvml=NoNvml())
    text = render_table(report) + json.dumps(report.to_json())
    assert "HF_TOKEN" in text and "MY_API_KEY" in text
    assert SECRET not in text and "v" * 20 not in text


def test_offline_with_a_hub_destination_fails_and_repo_checks_are_na(tmp_path: Path) -> None:
    environ = env(tmp_path, HF_TOKEN=SECRET, HF_HUB_OFFLINE="1")
    report = run_preflight(PreflightOptions(push_to="hf://acme/run", require_models=("acme/tiny-gpt2",)),
                           environ=environ, nvml=NoNvml())
    auth = [r for r in report.results if r.name == "hub-auth"]
    repos = [r for r in report.results if r.name == "hub-repos"]
    assert [(r.status, r.seen.split(" but ")[0]) for r in auth] == [("fail", "HF_HUB_OFFLINE=1")]
    assert [r.status for r in repos] == ["n/a"] and repos[0].seen.startswith("HF_HUB_OFFLINE=1:")


def test_a_crashing_check_becomes_a_warning_and_the_others_still_run(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(opts: Any) -> Any:
        raise RuntimeError("bug in the budget check")

    monkeypatch.setattr(preflight, "check_budget", boom)
    report = quick(tmp_path)
    budget = [r for r in report.results if r.name == "budget"]
    assert [r.status for r in budget] == ["warn"] and "RuntimeError: bug in the budget check" in budget[0].seen
    assert {r.name for r in report.results} == set(CHECK_NAMES)


def test_unreadable_and_unparsable_scripts_fail_the_python_check(tmp_path: Path) -> None:
    missing = quick(tmp_path, script=tmp_path / "nope.py")
    assert missing.failed is not None and missing.failed.name == "python" and "cannot read" in missing.failed.seen
    broken = tmp_path / "broken.py"
    broken.write_text("def f(:\n")
    report = quick(tmp_path, script=broken)
    assert report.failed is not None and "does not parse" in report.failed.seen


def test_storage_rows_cover_output_push_folder_cache_and_shm(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    report = quick(tmp_path, output_dir=tmp_path / "out", push_to=str(tmp_path / "file" / "secured"),
                   min_free_disk_bytes=1)
    rows = [r for r in report.results if r.name == "storage"]
    seen = " | ".join(r.seen for r in rows)
    assert "output folder" in seen and "--push-to folder" in seen and "Hugging Face cache" in seen
    assert "/dev/shm" in seen and "(--min-free-disk)" in seen
    assert report.failed is not None and report.failed.seen.startswith("--push-to folder")


def test_a_folder_whose_file_system_never_answers_is_one_warning_not_a_hang(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from guard.preflight import storage

    hung = threading.Event()  # never set: the write probe of a folder on a hung mount

    def probe(path: Path) -> Any:
        hung.wait()

    monkeypatch.setattr(storage, "_probe", probe)
    monkeypatch.setattr(preflight, "STORAGE_TIMEOUT_S", 0.2)
    report = quick(tmp_path, output_dir=tmp_path / "out")
    rows = [r for r in report.results if r.name == "storage"]
    assert [r.status for r in rows] == ["warn"], rows
    assert f"from the file system of {tmp_path / 'out'}" in rows[0].seen and "hung network mount" in rows[0].hint
    assert {r.name for r in report.results} == set(CHECK_NAMES), "the other checks still ran"


def test_render_table_puts_a_long_seen_hint_on_its_own_line() -> None:
    rows = [CheckResult("env", "pass", "set: HF_TOKEN"),
            CheckResult("trainer-config", "fail", "x" * 100, "do this"),
            CheckResult("budget", "warn", "short", "raise it")]
    lines = render_table(rows).splitlines()
    assert lines[0].split() == ["check", "status", "seen", "hint"]
    assert lines[1] == "env             pass   set: HF_TOKEN"
    assert lines[2].endswith("x" * 100) and lines[3].strip() == "hint: do this"
    assert lines[4].startswith("budget          warn   short") and lines[4].endswith("raise it")


def test_no_hub_client_torch_or_nvml_import_without_those_checks(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from guard.preflight import PreflightOptions, run_preflight\n"
        "r = run_preflight(PreflightOptions(skip_checks={'gpu': 't'}), environ={'HF_HOME': sys.argv[1]})\n"
        "print(sorted(m for m in ('huggingface_hub', 'torch', 'pynvml', 'transformers') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, cwd=REPO,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def _has_nvml() -> bool:
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


def gpu_check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "scripts" / "gpu-check.sh"), *args], capture_output=True, text=True,
                          cwd=REPO, timeout=120)


def test_gpu_check_script_prints_the_table_and_exits_by_the_verdict() -> None:
    ok = gpu_check("--require-gpus", "0")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    lines = ok.stdout.splitlines()
    assert lines[0].split() == ["check", "status", "seen", "hint"]
    assert lines[-1].startswith("VERDICT: PASS reason=ok exit=0")
    usage = gpu_check("--skip-check", "bogus=x")
    assert usage.returncode == 2 and usage.stdout.startswith("VERDICT: FAIL reason=usage exit=2")


@pytest.mark.skipif(_has_nvml(), reason="this machine has an NVIDIA driver")
def test_gpu_check_script_fails_without_a_gpu() -> None:
    proc = gpu_check()
    assert proc.returncode == 3
    assert proc.stdout.splitlines()[-1].startswith("VERDICT: FAIL reason=preflight exit=3")
    assert "check=gpu" in proc.stdout.splitlines()[-1]
