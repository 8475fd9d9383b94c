"""The install path for remote jobs: jobguard is not on the package index, so a job names the wheel built here by
its URL (a Hub repo's ``resolve`` URL, as the README's Hugging Face Jobs section says). Built with ``pip wheel``,
installed in a fresh environment, run by ``uv run`` offline, and every README form tried through the real ``hf``
CLI's ``--dry-run`` against the local Hub server."""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.metadata
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from conftest import REPO, guard_env
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.hubserver import TOKENS, HubServer

pytestmark = [pytest.mark.slow]

UV = shutil.which("uv") or os.path.join(os.path.dirname(sys.executable), "uv")
HF = shutil.which("hf") or os.path.join(os.path.dirname(sys.executable), "hf")
HUB = "https://huggingface.co"
WHEEL_REPO = "me/jobguard-wheels"  # the README's example repo

needs_uv = pytest.mark.skipif(not os.access(UV, os.X_OK), reason="uv is not installed (pip install uv)")


def _requirements(lines: list[str] | None) -> list[Requirement]:
    reqs = [Requirement(r) for r in lines or []]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def _repack(dist: importlib.metadata.Distribution, dest: Path) -> None:
    """A wheel of an installed distribution, rebuilt from its installed files (its dist-info WHEEL keeps the tag),
    so uv can install it with no index (PEP 427 layout, a fresh RECORD)."""
    wheel_info = Parser().parsestr(dist.read_text("WHEEL") or "")
    tag = (wheel_info.get_all("Tag") or ["py3-none-any"])[0]
    name = re.sub(r"[-_.]+", "_", dist.metadata["Name"])
    base = Path(str(dist.locate_file("")))
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    with zipfile.ZipFile(dest / f"{name}-{dist.version}-{tag}.whl", "w", zipfile.ZIP_DEFLATED) as archive:
        for entry in dist.files or []:
            path = entry.as_posix()
            if path.startswith("..") or "__pycache__" in path or path.endswith((".pyc", "/RECORD", "INSTALLER")):
                continue
            data = (base / path).read_bytes()
            archive.writestr(path, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            writer.writerow([path, f"sha256={digest}", len(data)])
        info = next(p.as_posix().split("/")[0] for p in dist.files or [] if p.as_posix().endswith("/METADATA"))
        writer.writerow([f"{info}/RECORD", "", ""])
        archive.writestr(f"{info}/RECORD", record.getvalue())


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """``(jobguard wheel, folder of wheels)``: the wheel built from this checkout (``pip wheel . --no-deps``, the
    build backend of this environment: no download), and its dependencies repacked from this environment."""
    folder = tmp_path_factory.mktemp("wheels")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation",
                           "-q", "-w", str(folder)], capture_output=True, text=True, timeout=300, check=False,
                          cwd=folder)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [wheel] = folder.glob("jobguard-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read(next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    todo, seen = _requirements(Parser().parsestr(metadata).get_all("Requires-Dist")), {"jobguard"}
    while todo:
        req = todo.pop()
        key = canonicalize_name(req.name)
        if key in seen:
            continue
        seen.add(key)
        dist = importlib.metadata.distribution(req.name)  # every dependency is installed here (the test extra)
        _repack(dist, folder)
        todo += _requirements(dist.requires)
    return wheel, folder


def _uv_env(tmp_path: Path, folder: Path, *, offline: bool = True) -> dict[str, str]:
    env = {"UV_CACHE_DIR": str(tmp_path / "uv-cache"), "UV_NO_INDEX": "1", "UV_FIND_LINKS": str(folder),
           "UV_PYTHON": sys.executable, "UV_PYTHON_DOWNLOADS": "never", "UV_NO_CONFIG": "1",
           "PATH": os.pathsep.join([os.path.dirname(UV), os.environ.get("PATH", "")])}
    if offline:
        env["UV_OFFLINE"] = "1"
    return guard_env(env)


def _script(requirement: str) -> str:
    """The README's zero-config form with ``requirement`` as the guard's dependency, and a job that needs nothing
    else (the environment uv builds holds jobguard only)."""
    return ("# /// script\n"
            f"# dependencies = [{requirement!r}]\n"
            "# ///\n"
            "import guard; guard.protect('--skip-check', 'gpu=no GPU in the tests')\n"
            "for step in range(1, 4):\n"
            "    print(f'step {step} loss={1.0 / step}', flush=True)\n"
            "print('job done', flush=True)\n").replace("'", '"')


def test_the_wheel_installs_in_a_fresh_environment_and_runs(wheels: tuple[Path, Path], tmp_path: Path) -> None:
    wheel, folder = wheels
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    proc = subprocess.run([UV, "pip", "install", "--python", str(python), str(wheel)], capture_output=True,
                          text=True, env=_uv_env(tmp_path, folder), timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    version = subprocess.run([str(venv / "bin" / "jobguard"), "--version"], capture_output=True, text=True,
                             env={"PATH": os.environ.get("PATH", "")}, timeout=60, check=False)
    assert version.returncode == 0 and version.stdout.strip() == "jobguard 0.1.0", (version.stdout, version.stderr)


@needs_uv
def test_uv_run_script_offline_with_the_wheel_named_by_its_url(wheels: tuple[Path, Path], tmp_path: Path) -> None:
    wheel, folder = wheels
    script = tmp_path / "train.py"
    script.write_text(_script(f"jobguard @ {wheel.as_uri()}"))
    proc = subprocess.run([UV, "run", "--script", str(script)], capture_output=True, text=True, cwd=tmp_path,
                          env=_uv_env(tmp_path, folder), timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "job done" in proc.stdout and proc.stdout.splitlines()[-1].startswith("VERDICT: PASS"), proc.stdout


def _readme_wheel_forms() -> tuple[list[str], list[str]]:
    """The README's ``hf jobs`` commands and PEP 723 blocks that name the wheel by a Hub URL."""
    commands, blocks, inside, block = [], [], False, []
    for line in (REPO / "README.md").read_text().splitlines():
        if line.lstrip().startswith("```"):
            if inside and any("resolve/main/jobguard-" in b for b in block) and block[0].startswith("# /// script"):
                blocks.append("\n".join(block) + "\n")
            inside, block = not inside, []
            continue
        if inside:
            block.append(line)
            if re.match(r"\s*hf jobs (uv )?run ", line) and "resolve/main/jobguard-" in line:
                commands.append(line.strip())
    return commands, blocks


@needs_uv
@pytest.mark.hub
def test_the_readme_wheel_url_forms_run_from_a_hub_repo(wheels: tuple[Path, Path], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # Each README form with huggingface.co replaced by the local Hub server, the wheel uploaded there: the real hf
    # CLI builds the job (--dry-run), then uv runs what the job runs, taking jobguard from the Hub URL.
    from huggingface_hub import HfApi, Volume

    wheel, folder = wheels
    commands, blocks = _readme_wheel_forms()
    assert commands and blocks, "the README's Hugging Face Jobs section names no wheel URL"
    readme = " ".join((REPO / "README.md").read_text().split())
    assert "not on the package index" in readme
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('job done')\n")
    with HubServer() as hub:
        hub.add_repo(WHEEL_REPO, {wheel.name: wheel.read_bytes()})
        env = guard_env(hub.env(token=TOKENS["write"], hf_home=tmp_path / "hf"))
        api = HfApi(endpoint=hub.url, token=TOKENS["write"])
        api._upload_scripts_to_bucket = lambda **kw: [Volume(type="bucket", source="alice/jobs-artifacts",  # type: ignore[method-assign]
                                                             mount_path="/data", path="run-1")]
        for line in commands:
            local = line.replace(HUB, hub.url).replace("jobguard-0.1.0-", wheel.name.split("py3")[0])
            args = shlex.split(local)
            at = 4 if args[2] == "uv" else 3
            proc = subprocess.run([HF, *args[1:at], "--dry-run", *args[at:]], capture_output=True, text=True,
                                  env=env, timeout=120, check=False)
            assert proc.returncode == 0 and "(dry run) Job not submitted." in proc.stdout, (line, proc.stderr)
            with_ = re.search(r"^  with\s{2,}(.*)$", proc.stdout, re.M)
            assert with_ is not None and f"{hub.url}/{WHEEL_REPO}/resolve/main/{wheel.name}" in with_.group(1), \
                proc.stdout
            # What the job then runs: uv with that requirement, jobguard from the Hub repo.
            run = subprocess.run([UV, "run", "--no-project", "--with", with_.group(1).strip(), "--", "jobguard",
                                  "--version"], capture_output=True, text=True,
                                 env={**_uv_env(tmp_path, folder, offline=False), **hub.env()}, timeout=300,
                                 check=False)
            assert run.returncode == 0 and run.stdout.strip() == "jobguard 0.1.0", (run.stdout, run.stderr[-2000:])
        body = _script("x").split("# ///\n")[-1]  # a job that needs nothing but the guard
        for block in blocks:
            header = block.replace(HUB, hub.url).partition("\n# ///\n")[0] + "\n# ///\n"
            script = tmp_path / "zero_config.py"
            script.write_text(header + body)
            proc = subprocess.run([HF, "jobs", "uv", "run", "--dry-run", script.name], capture_output=True,
                                  text=True, env=env, timeout=120, check=False)
            assert proc.returncode == 0 and "(dry run) Job not submitted." in proc.stdout, (block, proc.stderr)
            # uv runs it here with the README's jobguard requirement alone: torch and transformers, also listed
            # there, are not needed by this job and not in the wheel folder.
            deps = re.search(r"# dependencies = \[(.*)\]", header)
            assert deps is not None
            wanted = [d.strip().strip('"') for d in deps.group(1).split(",") if "jobguard" in d]
            assert len(wanted) == 1 and wanted[0].startswith("jobguard @ http"), wanted
            script.write_text(re.sub(r"# dependencies = \[.*\]", f'# dependencies = ["{wanted[0]}"]', header) + body)
            run = subprocess.run([UV, "run", "--script", script.name], capture_output=True, text=True,
                                 env={**_uv_env(tmp_path, folder, offline=False), **hub.env()}, timeout=300,
                                 check=False)
            assert run.returncode == 0 and run.stdout.splitlines()[-1].startswith("VERDICT: PASS"), \
                (run.stdout[-2000:], run.stderr[-2000:])
