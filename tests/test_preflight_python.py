"""Python environment checks: PEP 723 dependencies against the real installed packages, imports in a real child."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path
from typing import Any

from guard.preflight.python_env import check_imports, check_pep723, key_imports
from guard.preflight.script import analyze_script

PACKAGING = metadata.version("packaging")


def script(folder: Path, deps: list[str] | None, body: str = "", requires: str | None = None) -> Path:
    lines = []
    if deps is not None:
        lines += ["# /// script"]
        if requires:
            lines += [f'# requires-python = "{requires}"']
        lines += ["# dependencies = ["] + [f'#   "{d}",' for d in deps] + ["# ]", "# ///"]
    path = folder / "job.py"
    path.write_text("\n".join(lines) + "\n" + textwrap.dedent(body))
    return path


def test_satisfied_pinned_dependencies_pass(tmp_path: Path) -> None:
    rows = check_pep723(analyze_script(script(tmp_path, [f"packaging=={PACKAGING}", "pytest>=7"])))
    assert [r.status for r in rows] == ["pass"]
    assert f"packaging {PACKAGING}" in rows[0].seen


def test_missing_and_unsatisfied_dependencies_warn_together_without_uv(tmp_path: Path) -> None:
    rows = check_pep723(analyze_script(script(tmp_path, ["notapkg-xyz-guard>=1", "packaging<1"])))
    assert rows[0].status == "warn"
    assert "notapkg-xyz-guard not installed" in rows[0].seen
    assert f"packaging {PACKAGING} installed, <1 asked" in rows[0].seen
    assert "does not run through uv" in rows[0].seen and "--uv on" in (rows[0].hint or "")


def test_in_a_uv_environment_the_dependencies_are_uvs(tmp_path: Path) -> None:
    facts = analyze_script(script(tmp_path, ["notapkg-xyz-guard>=1"]))
    rows = check_pep723(facts, uv_environment="/envs/job-123")
    assert [r.status for r in rows] == ["pass"]
    assert rows[0].seen == "PEP 723: installed by uv in /envs/job-123: notapkg-xyz-guard"
    rows = check_pep723(facts, uv_error="uv sync --script exited 1: No solution found")
    assert [r.status for r in rows] == ["fail"] and "No solution found" in rows[0].seen
    assert "fix the dependencies" in (rows[0].hint or "")


def test_uv_missing_says_install_uv_not_fix_the_dependencies(tmp_path: Path) -> None:
    from guard.run.uvenv import sync_script

    path = script(tmp_path, ["notapkg-xyz-guard>=1"])
    error = sync_script(None, path, {}).error
    assert error is not None
    rows = check_pep723(analyze_script(path), uv_error=error)
    assert [r.status for r in rows] == ["fail"] and "uv is not on PATH" in rows[0].seen
    assert "install uv" in (rows[0].hint or "") and "fix the dependencies" not in (rows[0].hint or "")


def test_import_names_come_from_packages_distributions(tmp_path: Path, monkeypatch: Any) -> None:
    from guard.preflight import python_env

    # the real metadata of this environment: nvidia-ml-py installs pynvml, PyYAML installs yaml
    facts = analyze_script(script(tmp_path, ["nvidia-ml-py", "PyYAML", "packaging"]))
    names = key_imports(facts)
    assert {"pynvml", "yaml", "packaging"} <= set(names)
    assert not {"nvidia_ml_py", "pyyaml"} & set(names)
    # scikit-learn is checked as sklearn (a stand-in mapping: sklearn is not installed here)
    monkeypatch.setattr(python_env, "_packages_distributions", lambda: {"sklearn": ["scikit-learn"]})
    assert key_imports(analyze_script(script(tmp_path, ["scikit-learn"]))) == ["sklearn"]
    assert key_imports(analyze_script(script(tmp_path, ["scikit-learn"])), pep723_modules=False) == []


def test_unpinned_dependencies_are_logged_at_debug_not_warned(tmp_path: Path, caplog: Any) -> None:
    # the script's own metadata (an upstream example's): its user cannot act on it (issue 21)
    with caplog.at_level("DEBUG", logger="guard.preflight"):
        rows = check_pep723(analyze_script(script(tmp_path, ["packaging", "pytest>=7"])))
    assert [r.status for r in rows] == ["pass"]
    assert "PEP 723: unpinned: packaging" in caplog.text


def test_markers_that_do_not_apply_are_skipped(tmp_path: Path) -> None:
    rows = check_pep723(analyze_script(script(tmp_path, ["notapkg-xyz-guard>=1; python_version < '3'"])))
    assert [r.status for r in rows] == ["pass"]


def test_requires_python_is_checked(tmp_path: Path) -> None:
    rows = check_pep723(analyze_script(script(tmp_path, [], requires=">=4")))
    assert rows[0].status == "fail" and "requires-python >=4" in rows[0].seen


def test_invalid_requirement_fails(tmp_path: Path) -> None:
    rows = check_pep723(analyze_script(script(tmp_path, ["not a requirement!!"])))
    assert rows[0].status == "fail" and "not a valid requirement" in rows[0].seen


def test_two_blocks_fail(tmp_path: Path) -> None:
    path = tmp_path / "job.py"
    block = "# /// script\n# dependencies = []\n# ///\n"
    path.write_text(block + "import os\n" + block)
    rows = check_pep723(analyze_script(path))
    assert [r.status for r in rows] == ["fail"] and "2 `# /// script` blocks" in rows[0].seen


def test_no_block_is_na_with_reason(tmp_path: Path) -> None:
    rows = check_pep723(analyze_script(script(tmp_path, None, "print(1)\n")))
    assert [(r.status, r.seen) for r in rows] == [("n/a", "no `# /// script` block (PEP 723) in job.py")]


def test_key_imports_leave_out_stdlib_local_modules_and_put_torch_first(tmp_path: Path) -> None:
    (tmp_path / "helpers.py").write_text("")
    facts = analyze_script(script(tmp_path, ["pytest"], "import os, json\nimport helpers\nimport packaging\n"
                                  "import transformers\nimport torch\n"))
    assert key_imports(facts) == ["torch", "transformers", "packaging", "pytest"]


def test_imports_run_in_a_real_child_process(tmp_path: Path) -> None:
    facts = analyze_script(script(tmp_path, None, "import packaging\n"))
    row = check_imports(facts, environ={"PATH": "/usr/bin:/bin"})
    assert row.status == "pass" and f"packaging {PACKAGING}" in row.seen
    assert "packaging" in sys.modules  # (the test process's own import, not the check's)


def test_a_missing_import_fails_with_the_error(tmp_path: Path) -> None:
    facts = analyze_script(script(tmp_path, None, "import packaging\nimport notamodule_guard_xyz\n"))
    row = check_imports(facts, environ={})
    assert row.status == "fail"
    assert row.seen.startswith("import notamodule_guard_xyz failed: ModuleNotFoundError")


def test_an_import_that_kills_the_child_fails(tmp_path: Path) -> None:
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "crashy_guard_mod.py").write_text("import os\nos._exit(7)\n")
    job = tmp_path / "job"
    job.mkdir()
    facts = analyze_script(script(job, None, "import crashy_guard_mod\n"))
    row = check_imports(facts, environ={"PYTHONPATH": str(lib)})
    assert row.status == "fail" and "import crashy_guard_mod killed the child process (exit 7)" in row.seen


def test_each_module_gets_its_own_child(tmp_path: Path) -> None:
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "crashy_guard_mod.py").write_text("import os\nos._exit(7)\n")
    (lib / "fine_guard_mod.py").write_text("__version__ = '1.2'\n")
    job = tmp_path / "job"
    job.mkdir()
    facts = analyze_script(script(job, None, "import fine_guard_mod\nimport crashy_guard_mod\n"))
    commands: list[list[str]] = []

    def recording_runner(cmd: list[str], **kwargs: Any) -> Any:
        commands.append(cmd)
        return subprocess.run(cmd, **kwargs)

    row = check_imports(facts, environ={"PYTHONPATH": str(lib)}, runner=recording_runner)
    assert sorted(cmd[-1] for cmd in commands) == ["crashy_guard_mod", "fine_guard_mod"]
    assert row.status == "fail" and row.seen.startswith("import crashy_guard_mod killed")
    ok = check_imports(analyze_script(script(job, None, "import fine_guard_mod\n")), environ={"PYTHONPATH": str(lib)})
    assert ok.status == "pass" and ok.seen.startswith("imports ok: fine_guard_mod 1.2 (slowest: fine_guard_mod")


def test_an_import_past_the_timeout_warns(tmp_path: Path) -> None:
    calls: list[dict[str, Any]] = []

    def slow_runner(cmd: list[str], **kwargs: Any) -> Any:
        calls.append(kwargs)
        raise subprocess.TimeoutExpired(cmd, kwargs["timeout"])

    facts = analyze_script(script(tmp_path, None, "import torch\n"))
    row = check_imports(facts, environ={}, runner=slow_runner, timeout_s=5)
    assert row.status == "warn" and row.seen == "importing torch did not finish in 5 s"
    assert calls[0]["timeout"] == 5 and calls[0]["cwd"] == str(tmp_path)


def test_no_third_party_import_is_na(tmp_path: Path) -> None:
    row = check_imports(analyze_script(script(tmp_path, None, "import os\n")), environ={})
    assert row.status == "n/a" and "no third-party module" in row.seen


def test_a_framework_the_script_imports_first_is_found_not_imported(tmp_path: Path, monkeypatch: Any) -> None:
    """A module of ``FOUND_ONLY`` the script imports unconditionally is only found by the child (the job imports
    it at its start anyway): its import's crash is the job's to show; not installed still fails before the job."""
    import guard.preflight.python_env as python_env

    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "crashy_framework_mod.py").write_text("import os\nos._exit(7)\n")
    job = tmp_path / "job"
    job.mkdir()
    monkeypatch.setattr(python_env, "FOUND_ONLY", frozenset({"crashy_framework_mod", "absent_framework_mod"}))
    row = check_imports(analyze_script(script(job, None, "import crashy_framework_mod\n")),
                        environ={"PYTHONPATH": str(lib)})
    assert row.status == "pass" and "crashy_framework_mod found, imported by the job at its start" in row.seen
    missing = check_imports(analyze_script(script(job, None, "import absent_framework_mod\n")), environ={})
    assert missing.status == "fail"
    assert missing.seen.startswith("import absent_framework_mod failed: ModuleNotFoundError")
    # imported only by a PEP 723 dependency's name, not by the script at its start: imported in full
    assert check_imports(analyze_script(script(job, None, "import os\n")), environ={"PYTHONPATH": str(lib)},
                         modules=["crashy_framework_mod"]).status == "fail"
