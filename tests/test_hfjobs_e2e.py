"""End to end on the Hugging Face Jobs paths: real uv (offline, a wheel built here), the real `hf` CLI's
`--dry-run` against the local Hub server, the guard as a real process with the HF Jobs variables set."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import pytest
from conftest import JOBS, REPO, guard_env, run_guard

from tests.hubserver import TOKENS, HubServer

pytestmark = [pytest.mark.slow]

UV = shutil.which("uv") or os.path.join(os.path.dirname(sys.executable), "uv")
HF = shutil.which("hf") or os.path.join(os.path.dirname(sys.executable), "hf")
HF_ENV = {"JOB_ID": "6712ab0c", "CPU_CORES": "2", "MEMORY": "16Gi", "ACCELERATOR": "cpu-basic"}
FAST = ["--skip-check", "gpu=no GPU in the tests", "--heartbeat", "0"]

needs_uv = pytest.mark.skipif(not os.access(UV, os.X_OK), reason="uv is not installed (pip install uv)")


def make_wheel(dest: Path, name: str, version: str, files: dict[str, str]) -> Path:
    """A minimal pure-Python wheel (PEP 427): the files, METADATA, WHEEL and RECORD with sha256s."""
    info = f"{name}-{version}.dist-info"
    files = {**files,
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n",
             f"{info}/WHEEL": ("Wheel-Version: 1.0\nGenerator: jobguard-tests\nRoot-Is-Purelib: true\n"
                               "Tag: py3-none-any\n")}
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    dest.mkdir(parents=True, exist_ok=True)
    wheel = dest / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)
    return wheel


def uv_env(tmp_path: Path) -> dict[str, str]:
    """uv offline: only the wheels built here (find-links), its own cache, this Python."""
    wheels = tmp_path / "wheels"
    make_wheel(wheels, "tinydep_jobguard", "1.0", {"tinydep_jobguard/__init__.py": "VALUE = 42\n"})
    return {"UV_CACHE_DIR": str(tmp_path / "uv-cache"), "UV_NO_INDEX": "1", "UV_OFFLINE": "1",
            "UV_FIND_LINKS": str(wheels), "UV_PYTHON": sys.executable, "UV_PYTHON_DOWNLOADS": "never",
            "UV_NO_CONFIG": "1", "PATH": os.pathsep.join([os.path.dirname(UV), os.environ.get("PATH", "")])}


def fields(stdout: str) -> dict[str, str]:
    verdict = [line for line in stdout.splitlines() if line.startswith("VERDICT: ")][-1]
    parts = shlex.split(verdict[len("VERDICT: "):])
    return {"status": parts[0], **dict(p.split("=", 1) for p in parts[1:])}


# ---------------------------------------------------------------------------------------------------------------
# PEP 723 dependencies
# ---------------------------------------------------------------------------------------------------------------


@needs_uv
def test_guard_under_uv_runs_the_script_in_its_own_environment(tmp_path: Path) -> None:
    env = guard_env(uv_env(tmp_path))
    env.pop("UV", None)
    proc = subprocess.run([UV, "run", "--no-project", "--", sys.executable, "-m", "guard", *FAST,
                           "--report", str(tmp_path / "report.json"), str(JOBS / "pep723_dep.py")],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert fields(proc.stdout)["status"] == "PASS"
    assert "[guard] uv: auto: the guard runs under uv and pep723_dep.py needs tinydep-jobguard==1.0" in proc.stderr
    job_python = re.search(r"tinydep 42 python=(\S+)", proc.stdout)
    assert job_python is not None, proc.stdout
    assert job_python.group(1).startswith(str(tmp_path / "uv-cache")), "the job ran outside uv's script environment"
    assert f"uv: the job's Python: {job_python.group(1)}" in proc.stderr
    assert "PEP 723: installed by uv in" in proc.stderr
    assert re.search(r"python +pass +imports ok: tinydep_jobguard", proc.stderr), proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["details"]["uv"]["python"] == job_python.group(1)
    assert report["details"]["sanity_status"] == "passed", "the agent was not inside the uv environment's process"


def test_without_uv_a_missing_dependency_is_a_clear_preflight_line(tmp_path: Path) -> None:
    run = run_guard([*FAST, str(JOBS / "pep723_dep.py")], env={"UV": "", "UV_RUN_RECURSION_DEPTH": ""},
                    cwd=tmp_path)
    assert run.returncode == 3, run.stderr[-3000:]
    assert run.fields()["check"] == "python"
    assert "[guard] uv: auto: 1 PEP 723 dependency missing here, but the guard does not run under uv" in run.stderr
    assert re.search(r"python +warn +PEP 723: tinydep-jobguard not installed", run.stderr), run.stderr[-3000:]
    assert "import tinydep_jobguard failed: ModuleNotFoundError" in run.stderr
    assert "--uv on" in run.fields()["hint"]


@needs_uv
def test_uv_on_builds_the_environment_in_a_plain_python(tmp_path: Path) -> None:
    run = run_guard(["--uv", "on", *FAST, str(JOBS / "pep723_dep.py")], env={**uv_env(tmp_path), "UV": ""},
                    cwd=tmp_path, timeout_s=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "[guard] uv: on (--uv on)" in run.stderr and "tinydep 42" in run.stdout


@needs_uv
def test_uv_on_with_an_unresolvable_dependency_fails_preflight(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text("# /// script\n# dependencies = ['nothere-jobguard']\n# ///\nprint(1)\n")
    run = run_guard(["--uv", "on", *FAST, str(script)], env=uv_env(tmp_path), cwd=tmp_path, timeout_s=300)
    assert run.returncode == 3 and run.fields()["check"] == "python", run.stderr[-3000:]
    assert "PEP 723: uv could not build job.py's environment: uv sync --script exited 1" in run.stderr


# ---------------------------------------------------------------------------------------------------------------
# [tool.hf-jobs]: secrets and timeout, with the HF Jobs variables set
# ---------------------------------------------------------------------------------------------------------------


def test_a_secret_the_header_asks_for_fails_preflight_on_hf_jobs(tmp_path: Path) -> None:
    run = run_guard([*FAST, str(JOBS / "hfjobs_loop.py"), "--output-dir", str(tmp_path / "out")], env=HF_ENV,
                    cwd=tmp_path)
    assert run.returncode == 3, run.stderr[-3000:]
    assert run.fields()["check"] == "env"
    assert "MY_JOB_SECRET not set ([tool.hf-jobs] secrets in hfjobs_loop.py)" in run.stderr


def test_the_header_timeout_stops_the_job_in_time_with_a_secured_checkpoint(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    started = time.monotonic()
    run = run_guard([*FAST, "--push-to", str(tmp_path / "secured"), "--report", str(report),
                     str(JOBS / "hfjobs_loop.py"), "--output-dir", str(tmp_path / "out")],
                    env={**HF_ENV, "MY_JOB_SECRET": "a-secret-value-123"}, cwd=tmp_path, timeout_s=90)
    took_s = time.monotonic() - started
    assert run.returncode == 75, run.stderr[-3000:]
    assert (run.fields()["status"], run.fields()["reason"], run.fields()["secured"]) == ("TIMEOUT", "deadline", "yes")
    assert took_s < 40
    assert "[tool.hf-jobs] timeout in hfjobs_loop.py 40s from" in run.stderr
    assert "platform: hf_jobs (job_id=6712ab0c flavor=cpu-basic" in run.stderr
    assert (tmp_path / "secured" / "last-checkpoint" / "state.txt").exists()
    details = json.loads(report.read_text())["details"]
    assert details["platform"]["name"] == "hf_jobs" and details["platform"]["job_id"] == "6712ab0c"


# ---------------------------------------------------------------------------------------------------------------
# Zero-config: `hf jobs uv run train.py`, jobguard in the script's own dependencies
# ---------------------------------------------------------------------------------------------------------------


@needs_uv
def test_zero_config_uv_script_runs_under_the_guard_with_its_header_timeout(tmp_path: Path) -> None:
    env = uv_env(tmp_path)
    # A stand-in for the jobguard wheel (the tests are offline, PyPI is not): a .pth file that puts this checkout
    # and the packages jobguard depends on (from this virtual environment) on the script environment's path.
    site = sysconfig.get_paths()["purelib"]
    make_wheel(Path(env["UV_FIND_LINKS"]), "jobguard", "0.1.0", {"jobguard_checkout.pth": f"{REPO}\n{site}\n"})
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "UV", "VIRTUAL_ENV")}
    proc = subprocess.run([UV, "run", "--script", str(JOBS / "zero_config.py")], capture_output=True, text=True,
                          env={**clean, **env}, cwd=tmp_path, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert fields(proc.stdout)["status"] == "PASS" and "zero-config done" in proc.stdout
    assert "[tool.hf-jobs] timeout in zero_config.py 20m from" in proc.stderr
    assert "auto: zero_config.py's PEP 723 dependencies are all satisfied here" in proc.stderr


# ---------------------------------------------------------------------------------------------------------------
# Every documented `hf jobs` command, through the real CLI's --dry-run
# ---------------------------------------------------------------------------------------------------------------


def documented_hf_jobs_commands() -> list[str]:
    """The `hf jobs run` / `hf jobs uv run` lines of the README's code blocks."""
    found, inside = [], False
    for line in (REPO / "README.md").read_text().splitlines():
        if line.lstrip().startswith("```"):
            inside = not inside
        elif inside and re.match(r"\s*hf jobs (uv )?run ", line):
            found.append(line.strip())
    return found


def dry_run(line: str, cwd: Path, env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], dict[str, str]]:
    args = shlex.split(line)
    at = 4 if args[2] == "uv" else 3
    args = [HF, *args[1:at], "--dry-run", *args[at:]]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=cwd, timeout=120, check=False)
    summary: dict[str, str] = {}
    for row in proc.stdout.splitlines():
        match = re.match(r"^  (\w+)\s{2,}(.*)$", row)
        if match:
            summary[match.group(1)] = match.group(2)
    return proc, summary


@pytest.mark.hub
def test_every_documented_hf_jobs_command_builds_a_guarded_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub
    from huggingface_hub import HfApi, Volume

    lines = documented_hf_jobs_commands()
    assert any(" uv run " in f" {line} " for line in lines) and any(" jobs run " in line for line in lines)
    shutil.copy(JOBS / "hfjobs_loop.py", tmp_path / "train.py")
    monkeypatch.chdir(tmp_path)  # hf jobs uv run ships local files named relative to the working folder
    with HubServer() as hub:
        env = {**guard_env(hub.env(token=TOKENS["write"], hf_home=tmp_path / "hf")), "MY_JOB_SECRET": "x" * 12}
        api = HfApi(endpoint=hub.url, token=TOKENS["write"])
        # Shipping local files needs a storage bucket, which the local server does not offer: the upload alone
        # is replaced; the command is built by huggingface_hub's own code.
        api._upload_scripts_to_bucket = lambda **kw: [Volume(type="bucket", source="alice/jobs-artifacts",  # type: ignore[method-assign]
                                                             mount_path="/data", path="run-1")]
        for line in lines:
            proc, summary = dry_run(line, tmp_path, env)
            assert proc.returncode == 0, f"{line}\n{proc.stdout}\n{proc.stderr}"
            assert "(dry run) Job not submitted." in proc.stdout
            if " uv run " not in line:
                assert "jobguard" in summary["command"] and "train.py" in summary["command"], line
                continue
            script_args = shlex.split(summary.get("args", ""))
            command, _, _, volumes = api._create_uv_command_env_and_secrets(
                script=summary["script"], script_args=script_args,
                dependencies=shlex.split(summary.get("with", "")) or None,
                python=None, env={}, secrets={}, namespace="alice", token=TOKENS["write"])
            shown = shlex.join(command)
            assert "/data/train.py" in shown and volumes and volumes[0].mount_path == "/data", shown
            if summary["script"] == "train.py":  # the zero-config form: the guard comes from the script itself
                assert summary.get("timeout") == "40s (from script)", proc.stdout
            else:
                assert " jobguard " in f" {shown} ", shown
    assert huggingface_hub.__version__ >= "2"
