"""Entry points a project's own ``guard.py`` cannot replace: the container's entrypoint.sh (the ``jobguard``
console script) and ``python -P -m guard``, run from a folder holding a user's ``guard.py``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import JOBS, REPO, guard_env

pytestmark = pytest.mark.slow

USER_GUARD = "print('the user guard.py ran')\n"  # a project's gradient guard, say


def _console_script() -> Path | None:
    """The ``jobguard`` console script of this interpreter's environment (``pip install -e .`` makes it)."""
    beside = Path(sys.executable).with_name("jobguard")
    return beside if beside.exists() else (Path(found) if (found := shutil.which("jobguard")) else None)


def _run(argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, env=guard_env(env), capture_output=True, text=True, timeout=120,
                          check=False)


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    (tmp_path / "guard.py").write_text(USER_GUARD)
    shutil.copy(JOBS / "plain_loop.py", tmp_path / "train.py")
    shutil.copy(JOBS / "plain_sgd.py", tmp_path / "plain_sgd.py")  # the job's own module, beside it
    return tmp_path


def test_python_m_guard_from_a_folder_with_a_guard_py_runs_the_users_file(workspace: Path) -> None:
    # The fault the entry forms below avoid: `python -m` puts the working folder first on sys.path.
    run = _run([sys.executable, "-m", "guard", "train.py", "--steps", "3"], workspace)
    assert "the user guard.py ran" in run.stdout and "VERDICT:" not in run.stdout


def test_entrypoint_from_a_folder_with_a_guard_py_runs_the_guard(workspace: Path) -> None:
    script = _console_script()
    if script is None:
        pytest.skip("no jobguard console script in this environment (pip install -e .)")
    env = {"PATH": f"{script.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    run = _run(["sh", str(REPO / "entrypoint.sh"), "--skip-check", "python=not this test's subject", "train.py",
                "--steps", "3"], workspace, env)
    assert "the user guard.py ran" not in run.stdout, run.stdout
    assert run.returncode == 0, run.stderr[-3000:]
    verdicts = [line for line in run.stdout.splitlines() if line.startswith("VERDICT: ")]
    assert verdicts and verdicts[-1].startswith("VERDICT: PASS"), run.stdout[-2000:]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="python -P is Python 3.11 and newer")
def test_python_dash_p_from_a_folder_with_a_guard_py_runs_the_guard(workspace: Path) -> None:
    run = _run([sys.executable, "-P", "-m", "guard", "--skip-check", "python=not this test's subject", "train.py",
                "--steps", "3"], workspace)
    assert "the user guard.py ran" not in run.stdout
    assert run.returncode == 0 and run.stdout.splitlines()[-1].startswith("VERDICT: PASS"), run.stderr[-3000:]
