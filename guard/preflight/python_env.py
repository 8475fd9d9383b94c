"""Python environment checks: the script's PEP 723 dependencies are installed, its key imports work.

Dependencies are compared with ``importlib.metadata`` and ``packaging``; imports are tried in a child Python
process with a timeout, so the supervisor itself never imports torch (a broken CUDA build can crash or hang the
importing process).
"""

from __future__ import annotations

import json
import logging
import platform
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path
from typing import Any

from guard.preflight._common import one_line
from guard.preflight._models import CheckResult
from guard.preflight.script import Pep723Block, ScriptFacts

__all__ = ["FOUND_ONLY", "IMPORT_TIMEOUT_S", "IMPORT_WORKERS", "check_imports", "check_pep723", "key_imports",
           "uv_error_hint"]

log = logging.getLogger("guard.preflight")

NAME = "python"

#: How long the child process may take to import the job's key modules (torch on a cold network filesystem can
#: take tens of seconds). Past it the row is a warning, not a failure: slow is not broken.
IMPORT_TIMEOUT_S = 120.0

#: How many import children run at once.
IMPORT_WORKERS = 4

#: Modules worth importing even when the script imports them only indirectly: the job's framework.
_KEY_FIRST = ("torch", "transformers")

#: Frameworks whose import alone takes seconds (torch: 1-3 s warm, tens of seconds on a cold network filesystem).
#: When the script imports one unconditionally at module level, the job imports it first thing anyway: the child
#: only finds it (``importlib.util.find_spec``: not installed is still a ``fail`` before the job starts) and reads
#: its version from its metadata, instead of importing it a second time before the job may start. A broken
#: install that imports but crashes then fails the job at its first line, named by the crash's diagnosis. Measured
#: (benchmarks/README.md): a guarded ``import torch`` job's start-up 2.7x plain with the full import, under 1.5x so.
FOUND_ONLY = frozenset({"torch", "transformers", "tensorflow", "jax", "flax", "accelerate", "deepspeed", "datasets",
                        "diffusers", "peft", "trl", "vllm", "lightning", "pytorch_lightning", "keras"})

_MARK = "@@guard-preflight-imports@@"

# The child: import each module (a name after ``--find`` is only found, see ``FOUND_ONLY``), report version, time
# and error as one JSON line after a marker (the modules may print to stdout themselves). argv[1] is the script's
# folder, put first on sys.path as the job will have it.
_CHILD = f"""
import importlib, importlib.util, json, sys, time
sys.path.insert(0, sys.argv[1])
out = {{}}
find = False
for name in sys.argv[2:]:
    if name == "--find":
        find = True
        continue
    start = time.perf_counter()
    try:
        if find:
            if importlib.util.find_spec(name) is None:
                raise ModuleNotFoundError(f"No module named {{name!r}}")
            try:
                from importlib import metadata
                version = metadata.version(name)
            except Exception:
                version = ""
            out[name] = {{"ok": True, "version": version, "s": time.perf_counter() - start, "found": True}}
            continue
        module = importlib.import_module(name)
        out[name] = {{"ok": True, "version": str(getattr(module, "__version__", "") or ""),
                     "s": time.perf_counter() - start}}
    except BaseException as exc:
        out[name] = {{"ok": False, "error": type(exc).__name__ + ": " + str(exc)}}
sys.stdout.write("\\n{_MARK}" + json.dumps(out) + "\\n")
"""

Runner = Callable[..., Any]  # subprocess.run


#: What to do when the script's PEP 723 dependencies are not installed here.
UV_HINT = ("run the guard under uv (uv run --with 'jobguard @ WHEEL_URL' jobguard ..., hf jobs uv run ...) or pass "
           "--uv on so that uv installs them; or pip install them here")


def uv_error_hint(uv_error: str) -> str:
    """The hint for a script environment uv could not build: install uv when it is missing, else fix the block."""
    if uv_error.startswith("uv is not on PATH"):
        return "install uv (pip install uv) or put it on PATH, or --uv off to run with this interpreter"
    return "fix the dependencies (uv sync --script shows the error), or --uv off to run with this interpreter"


def check_pep723(facts: ScriptFacts | None, *, uv_environment: str | None = None,
                 uv_error: str | None = None) -> list[CheckResult]:
    """Rows for the script's PEP 723 ``script`` block: each dependency installed and satisfying its specifier.

    Args:
        facts: the script's facts, or None without a script.
        uv_environment: the folder where uv built the script's environment (``--uv``): the job runs there, so the
            dependencies are uv's to install and this interpreter's packages do not matter.
        uv_error: why uv could not build that environment: a ``fail`` row.

    Dependencies missing here (or at another version) are a ``warn``, not a ``fail``: the job is not run through
    uv, nothing installs them, and the import check fails the run when the script really imports one. Unpinned
    dependencies (no version specifier) are a warning; ``requires-python`` is checked against this interpreter;
    dependencies whose environment marker does not apply here are skipped.
    """
    from packaging.markers import InvalidMarker, UndefinedEnvironmentName
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    if facts is None:
        return [CheckResult(NAME, "n/a", "no script given: no PEP 723 block to read")]
    block: Pep723Block | None = facts.pep723
    name = facts.path.name
    if block is None:
        return [CheckResult(NAME, "n/a", f"no `# /// script` block (PEP 723) in {name}")]
    if block.error:
        return [CheckResult(NAME, "fail", f"{name}: {block.error}",
                            "fix the block: uv and hf jobs uv run refuse it too")]
    if uv_error is not None:
        return [CheckResult(NAME, "fail",
                            f"PEP 723: uv could not build {name}'s environment: {one_line(uv_error, 240)}",
                            uv_error_hint(uv_error))]
    rows: list[CheckResult] = []
    problems: list[str] = []
    missing: list[str] = []
    if block.requires_python and uv_environment is None:
        try:
            if not SpecifierSet(block.requires_python).contains(platform.python_version(), prereleases=True):
                problems.append(f"requires-python {block.requires_python}, this is Python {platform.python_version()}")
        except InvalidSpecifier:
            problems.append(f"requires-python {block.requires_python!r} is not a version specifier")
    satisfied: list[str] = []
    unpinned: list[str] = []
    for text in block.dependencies:
        try:
            req = Requirement(text)
        except InvalidRequirement as exc:
            problems.append(f"{text!r} is not a valid requirement ({one_line(exc, 80)})")
            continue
        if not req.specifier and req.url is None:
            unpinned.append(req.name)
        if uv_environment is not None:
            satisfied.append(req.name)
            continue
        try:
            if req.marker is not None and not req.marker.evaluate():
                continue
        except (InvalidMarker, UndefinedEnvironmentName):
            pass
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            missing.append(f"{req.name} not installed")
            continue
        if req.specifier and not req.specifier.contains(version, prereleases=True):
            missing.append(f"{req.name} {version} installed, {req.specifier} asked")
            continue
        satisfied.append(f"{req.name} {version}")
    if problems:
        rows.append(CheckResult(NAME, "fail", f"PEP 723: {'; '.join(problems)}",
                                "fix the block (uv refuses it too), or run with a matching Python"))
    if missing:
        rows.append(CheckResult(NAME, "warn", f"PEP 723: {'; '.join(missing)} (the job does not run through uv: "
                                "nothing installs them)", UV_HINT))
    if not problems and not missing:
        if uv_environment is not None:
            listed = ", ".join(satisfied) if satisfied else "no dependencies"
            rows.append(CheckResult(NAME, "pass", f"PEP 723: installed by uv in {uv_environment}: {listed}"))
        else:
            listed = ", ".join(satisfied) if satisfied else "no dependencies"
            rows.append(CheckResult(NAME, "pass", f"PEP 723: {listed}"))
    if unpinned:  # the script's own metadata (an upstream example's): nothing its user does about it here
        log.debug("python: PEP 723: unpinned: %s (pin versions, e.g. name==1.2.3, so a rerun gets the same code)",
                  ", ".join(unpinned))
    return rows


def _import_names(dist: str) -> list[str]:
    """The top-level modules an installed distribution provides, from
    ``importlib.metadata.packages_distributions()`` (``scikit-learn`` -> ``sklearn``); [] when not installed."""
    from packaging.utils import canonicalize_name

    wanted = canonicalize_name(dist)
    names = [module for module, dists in _packages_distributions().items()
             if not module.startswith("_") and any(canonicalize_name(d) == wanted for d in dists)]
    normalized = dist.replace("-", "_").replace(".", "_").lower()
    # a distribution that ships several top-level modules (and helpers): try the one named like it, else all
    return [normalized] if normalized in names else sorted(names)


def _packages_distributions() -> Mapping[str, list[str]]:
    return metadata.packages_distributions()


def key_imports(facts: ScriptFacts, *, pep723_modules: bool = True) -> list[str]:
    """The modules to try: the script's unconditional third-party imports, plus its PEP 723 dependencies' modules.

    Standard-library modules, the guard itself and modules that live next to the script are left out; torch and
    transformers go first. ``pep723_modules=False`` leaves out the dependencies' modules (they are looked up in
    this interpreter's metadata, which says nothing about a uv script environment).
    """
    from packaging.requirements import InvalidRequirement, Requirement

    stdlib = set(getattr(sys, "stdlib_module_names", ())) | set(sys.builtin_module_names)
    folder = facts.path.parent
    names: list[str] = []
    for module in facts.imports:
        if module in stdlib or module in ("guard", "__future__"):
            continue
        if (folder / f"{module}.py").exists() or (folder / module).is_dir():
            continue
        names.append(module)
    if pep723_modules and facts.pep723 and not facts.pep723.error:
        for text in facts.pep723.dependencies:
            try:
                req = Requirement(text)
            except InvalidRequirement:
                continue
            names.extend(m for m in _import_names(req.name) if m not in stdlib)
    ordered = [m for m in _KEY_FIRST if m in names] + [m for m in names if m not in _KEY_FIRST]
    return list(dict.fromkeys(ordered))


def check_imports(
    facts: ScriptFacts | None,
    *,
    environ: Mapping[str, str],
    runner: Runner = subprocess.run,
    timeout_s: float = IMPORT_TIMEOUT_S,
    modules: Sequence[str] | None = None,
    python: str | None = None,
    missing_hint: str | None = None,
) -> CheckResult:
    """Try the job's key imports, each in its own child process (``sys.executable -c ...``), side by side.

    One child per module keeps the wall time near the slowest single import (torch) instead of the sum, and a
    module that kills its interpreter cannot hide the others' results. At most ``IMPORT_WORKERS`` run at once. A
    ``FOUND_ONLY`` framework that the script imports unconditionally is found, not imported (the job imports it at
    its start: importing it here too doubled a torch job's start-up).

    Args:
        facts: the script's facts (its imports and PEP 723 block).
        environ: the job's environment, given to the children.
        runner: ``subprocess.run`` or a stand-in with its signature.
        timeout_s: each child's time limit; past it the row is ``warn`` (slow is not broken).
        modules: the modules to try; None: ``key_imports(facts)``.
        python: the interpreter that will run the job (a uv script environment's); None: ``sys.executable``.
        missing_hint: the hint for a ``ModuleNotFoundError`` (e.g. the PEP 723 dependencies are not installed
            here: run under uv); None: install or repair the module.
    """
    if modules is not None:
        names = list(modules)
    elif facts is not None:
        names = key_imports(facts, pep723_modules=python is None)
    else:
        return CheckResult(NAME, "n/a", "no script given: the job's imports are unknown")
    executable = python or sys.executable
    if not names:
        return CheckResult(NAME, "n/a", "the script imports no third-party module at top level")
    folder = str(facts.path.parent.absolute()) if facts is not None else str(Path.cwd())
    found_only = {name for name in names if name in FOUND_ONLY and facts is not None and name in facts.imports}

    def one(name: str) -> dict[str, Any]:
        try:
            proc = runner([executable, "-c", _CHILD, folder, *(["--find"] if name in found_only else []), name],
                          capture_output=True, text=True,
                          timeout=timeout_s, env=dict(environ), cwd=folder)
        except subprocess.TimeoutExpired:
            return {"timeout": True}
        except OSError as exc:
            return {"ok": False, "error": f"could not start {executable}: {exc}"}
        for line in (proc.stdout or "").splitlines():
            if line.startswith(_MARK):
                answer: dict[str, Any] = json.loads(line[len(_MARK):]).get(name, {"ok": False, "error": "no answer"})
                return answer
        lines = (proc.stderr or proc.stdout or "").strip().splitlines()
        return {"ok": False, "crash": proc.returncode, "error": lines[-1] if lines else "no output"}

    with ThreadPoolExecutor(max_workers=min(IMPORT_WORKERS, len(names)), thread_name_prefix="guard-imports") as pool:
        results = dict(zip(names, pool.map(one, names), strict=True))
    failed = [n for n in names if not results[n].get("ok") and not results[n].get("timeout")]
    if failed:
        first, info = failed[0], results[failed[0]]
        others = f" (also: {', '.join(failed[1:])})" if len(failed) > 1 else ""
        if "crash" in info:
            return CheckResult(NAME, "fail", f"import {first} killed the child process (exit {info['crash']}): "
                               f"{one_line(info['error'], 200)}{others}",
                               f"run python -c 'import {first}' to see the crash")
        error = str(info.get("error") or "")
        hint = (missing_hint if missing_hint and error.startswith("ModuleNotFoundError")
                else f"install or repair {first} in this environment (pip install ...)")
        return CheckResult(NAME, "fail", f"import {first} failed: {one_line(error, 200)}{others}", hint)
    slow = [n for n in names if results[n].get("timeout")]
    if slow:
        return CheckResult(NAME, "warn", f"importing {', '.join(slow)} did not finish in {timeout_s:g} s",
                           "a slow filesystem or a hanging import; check with python -c 'import <name>'")
    done = ", ".join(f"{n} {results[n].get('version', '')}".strip() for n in names)
    imported = [n for n in names if not results[n].get("found")]
    found = [n for n in names if results[n].get("found")]
    tail = []
    if imported:
        slowest = max(imported, key=lambda n: results[n].get("s", 0.0))
        tail.append(f"slowest: {slowest} {results[slowest].get('s', 0.0):.2f} s")
    if found:
        tail.append(f"{', '.join(found)} found, imported by the job at its start")
    return CheckResult(NAME, "pass", f"imports ok: {done} ({'; '.join(tail)})")
