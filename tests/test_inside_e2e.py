"""The agent inside the job's processes: loaded under a private name, chained to a container's ``sitecustomize``."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
from conftest import REPO, run_guard


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def test_a_project_with_its_own_guard_py_gets_its_own_module(tmp_path: Path) -> None:
    project = tmp_path / "project"
    _write(project / "guard.py", 'VALUE = "the project\'s own guard"\n')
    script = _write(project / "train.py", """\
        import sys
        import guard
        print("value:", guard.VALUE)
        print("agent loaded:", "_jobguard.inside.agent" in sys.modules)
        print("options module:", [n for n in sys.modules if n.endswith("run.config")])
    """)
    run = run_guard([str(script)], cwd=tmp_path)
    assert "value: the project's own guard" in run.stdout, run.stderr
    assert "agent loaded: True" in run.stdout
    assert "options module: []" in run.stdout  # the agent reads its own settings, not the CLI's options
    assert run.fields()["status"] == "PASS", run.stderr


#: Modules a bare ``python -c pass`` does not import and the agent must not bring into every process of a job:
#: ``typing`` alone is 4-5 ms of each start (``-X importtime``), ``inspect`` (with ``ast``, ``dis``) more.
HEAVY_AT_START = ("typing", "inspect", "dataclasses", "importlib.abc", "ast")


def test_the_agent_brings_no_heavy_module_into_a_jobs_start(tmp_path: Path) -> None:
    script = _write(tmp_path / "train.py", f"""\
        import sys
        print("agent loaded:", "_jobguard.inside.agent" in sys.modules)
        print("heavy:", [m for m in {HEAVY_AT_START!r} if m in sys.modules])
    """)
    run = run_guard([str(script)], cwd=tmp_path)
    assert "agent loaded: True" in run.stdout, run.stderr
    assert "heavy: []" in run.stdout, run.stdout


def test_the_public_api_reaches_the_agent_loaded_under_the_private_name(tmp_path: Path) -> None:
    # A script that imports jobguard's guard: guard.report() talks to the one agent of the process (a NaN it
    # reports ends the run), and no second copy of the agent is imported.
    script = _write(tmp_path / "train.py", """\
        import sys
        import guard
        for step in range(1, 4):
            guard.report(step=step, loss=2.0 if step < 3 else float("nan"))
            print("second agent:", "guard.inside.agent" in sys.modules, flush=True)
        import time
        time.sleep(30)
    """)
    run = run_guard([str(script)], cwd=tmp_path, timeout_s=60)
    assert "second agent: True" not in run.stdout
    assert "second agent: False" in run.stdout
    fields = run.fields()
    assert fields["status"] == "FAIL" and fields["reason"] == "non_finite_loss", run.verdict
    assert fields["step"] == "3"


@pytest.mark.parametrize("how", ["append", "insert"])
def test_a_container_sitecustomize_that_extends_sys_path_is_kept(tmp_path: Path, how: str) -> None:
    vendor = tmp_path / "vendor"
    _write(vendor / "vendored_lib.py", 'GREETING = "from the vendored folder"\n')
    site = tmp_path / "container_site"
    _write(site / "sitecustomize.py", f"""\
        import sys
        sys.path.{how}({'0, ' if how == 'insert' else ''}{str(vendor)!r})
    """)
    script = _write(tmp_path / "train.py", """\
        import vendored_lib
        print(vendored_lib.GREETING)
    """)
    run = run_guard([str(script)], cwd=tmp_path, env={"PYTHONPATH": os.pathsep.join((str(REPO), str(site)))})
    assert "from the vendored folder" in run.stdout, run.stderr
    assert "ModuleNotFoundError" not in run.stderr
    assert run.fields()["status"] == "PASS"
