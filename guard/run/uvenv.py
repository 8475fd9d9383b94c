"""Running a PEP 723 script in the environment uv builds for it, where the user chose uv.

``hf jobs uv run ... --with 'jobguard @ WHEEL_URL' -- jobguard train.py`` gives uv an environment with jobguard only:
the script's own ``# /// script`` dependencies are not in it. When the guard itself runs under uv (or
``--uv on``) and the script's dependencies are not all satisfied here, the guard has uv build the script's own
environment (``uv sync --script SCRIPT``, the environment ``uv run --script SCRIPT`` uses), checks the Python
rows of preflight with that environment's interpreter (``uv python find --script SCRIPT``) and runs the job with
that interpreter, with ``VIRTUAL_ENV`` and ``PATH`` as ``uv run`` sets them. The job is started directly, not
through ``uv run``: uv ends with 128 + N when its child dies of signal N, which would hide the signal from the
guard's verdict, and the interpreter that runs is exactly the one preflight checked. The agent still loads in
every process: ``PYTHONPATH`` (the guard's ``_site`` folder) passes through unchanged.

In a plain pip or conda environment (no uv around the guard) this never happens unless ``--uv on``: a
resolver must not replace a container's CUDA build of torch behind the user's back.

uv facts (uv 0.13, verified with ``uv run --with X python -c 'print(os.environ)'``): ``uv run`` sets ``UV`` (the
path of the uv binary) and ``UV_RUN_RECURSION_DEPTH`` in the environment of what it runs, and ``VIRTUAL_ENV``
to the environment it built; ``uv sync --script`` creates or updates the script's cached environment
(``environments-v2/<name>-<hash>``) and exits non-zero with uv's resolver error when it cannot.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["SYNC_TIMEOUT_S", "UvEnvironment", "UvPlan", "plan_uv", "sync_script", "under_uv"]

log = logging.getLogger("guard.run.uvenv")

#: How long ``uv sync --script`` may take (a first install of torch and friends can take minutes).
SYNC_TIMEOUT_S = 1800.0

Runner = Callable[..., Any]  # subprocess.run


def under_uv(environ: Mapping[str, str]) -> str | None:
    """The uv binary that started this process (``UV``, set by ``uv run``), or None when uv did not start it."""
    path = (environ.get("UV") or "").strip()
    if path and os.access(path, os.X_OK):
        return path
    if path or (environ.get("UV_RUN_RECURSION_DEPTH") or "").strip():
        return shutil.which("uv", path=environ.get("PATH")) or path or None
    return None


@dataclass(frozen=True)
class UvPlan:
    """Whether the job runs in the script's own uv environment.

    Attributes:
        use: True: build the script's environment with uv and run the job there.
        why: one line for the config log (the decision and its reason).
        uv: the uv binary to call (None when not found).
        missing: the PEP 723 dependencies not satisfied by this interpreter.
    """

    use: bool
    why: str
    uv: str | None = None
    missing: tuple[str, ...] = ()


def unsatisfied(dependencies: tuple[str, ...]) -> tuple[str, ...]:
    """The PEP 508 strings of ``dependencies`` this interpreter does not satisfy (markers that do not apply skipped;
    an unparsable requirement counts as unsatisfied)."""
    from importlib import metadata

    from packaging.requirements import InvalidRequirement, Requirement

    missing: list[str] = []
    for text in dependencies:
        try:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate():
                continue
            version = metadata.version(req.name)
        except (InvalidRequirement, metadata.PackageNotFoundError):
            missing.append(text)
            continue
        except Exception:  # noqa: BLE001 - an odd marker: treat as applying
            missing.append(text)
            continue
        if req.specifier and not req.specifier.contains(version, prereleases=True):
            missing.append(text)
    return tuple(missing)


def plan_uv(mode: str, script: Path | None, environ: Mapping[str, str]) -> UvPlan:
    """Decide whether the job runs in the script's uv environment (``--uv auto|on|off``).

    ``auto`` (default): yes when the script has a ``# /// script`` block whose dependencies are not all satisfied
    here and the guard itself runs under uv (``UV`` set by ``uv run``). ``on``: yes whenever the script has the
    block (uv must be on PATH). ``off``: never.
    """
    if mode == "off":
        return UvPlan(False, "off (--uv off)")
    if script is None:
        return UvPlan(False, f"{mode}: not a script job (command form): nothing to do")
    try:
        text = script.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return UvPlan(False, f"{mode}: cannot read {script.name}")
    block = None
    if "# /// script" in text:  # a block starts with that line: else no need to import guard.preflight to read it
        from guard.preflight.script import read_pep723

        block = read_pep723(text)
    if block is None or block.error:
        what = "no `# /// script` block" if block is None else "its `# /// script` block is broken"
        return UvPlan(False, f"{mode}: {script.name} has {what}: runs with this interpreter")
    missing = unsatisfied(block.dependencies)
    started_by = under_uv(environ)
    uv = started_by or shutil.which("uv", path=environ.get("PATH"))
    if mode == "on":
        return UvPlan(True, f"on (--uv on): {script.name}'s PEP 723 environment, built by uv", uv, missing)
    if not missing:
        return UvPlan(False, f"auto: {script.name}'s PEP 723 dependencies are all satisfied here", uv)
    if started_by is None:
        return UvPlan(False, f"auto: {len(missing)} PEP 723 dependenc{'y' if len(missing) == 1 else 'ies'} missing "
                      "here, but the guard does not run under uv (plain pip/conda: nothing is installed)", None,
                      missing)
    return UvPlan(True, f"auto: the guard runs under uv and {script.name} needs {', '.join(missing)}: "
                  "its PEP 723 environment, built by uv", uv, missing)


@dataclass(frozen=True)
class UvEnvironment:
    """The script's environment as uv built it, or why it could not.

    Attributes:
        python: the environment's interpreter (absolute path), or None on an error.
        prefix: the environment's folder (``VIRTUAL_ENV`` for the job), or None.
        error: uv's last lines on a failure, or None.
        seconds: how long ``uv sync --script`` took.
    """

    python: str | None = None
    prefix: str | None = None
    error: str | None = None
    seconds: float = 0.0
    env_extra: Mapping[str, str] = field(default_factory=dict)


def _tail(text: str, lines: int = 3) -> str:
    kept = [line.strip() for line in (text or "").strip().splitlines() if line.strip()]
    return " | ".join(kept[-lines:]) or "no output"


def sync_script(uv: str | None, script: Path, environ: Mapping[str, str], *, runner: Runner = subprocess.run,
                timeout_s: float = SYNC_TIMEOUT_S) -> UvEnvironment:
    """Build (or reuse) the script's environment: ``uv sync --script SCRIPT``, then ``uv python find --script``.

    Args:
        uv: the uv binary (None: not found, an error).
        script: the PEP 723 script.
        environ: the environment uv runs with (its ``UV_*`` settings: index, find-links, offline, cache).
        runner: ``subprocess.run`` or a stand-in.
        timeout_s: the limit of ``uv sync``.

    Returns:
        The environment; ``error`` set when uv is missing, fails or runs past ``timeout_s``. Never raises.
    """
    import time

    if uv is None:
        return UvEnvironment(error="uv is not on PATH")
    env = dict(environ)
    start = time.monotonic()
    try:
        done = runner([uv, "sync", "--script", str(script)], capture_output=True, text=True, env=env,
                      timeout=timeout_s)
        if done.returncode != 0:
            return UvEnvironment(error=f"uv sync --script exited {done.returncode}: {_tail(done.stderr)}",
                                 seconds=time.monotonic() - start)
        found = runner([uv, "python", "find", "--script", str(script)], capture_output=True, text=True, env=env,
                       timeout=120)
    except subprocess.TimeoutExpired:
        return UvEnvironment(error=f"uv sync --script did not finish in {timeout_s:g} s",
                             seconds=time.monotonic() - start)
    except OSError as exc:
        return UvEnvironment(error=f"cannot run {uv}: {exc.strerror or exc}")
    seconds = time.monotonic() - start
    python = (found.stdout or "").strip().splitlines()[-1:] if found.returncode == 0 else []
    if not python:
        return UvEnvironment(error=f"uv python find --script exited {found.returncode}: {_tail(found.stderr)}",
                             seconds=seconds)
    interpreter = python[0]
    prefix = str(Path(interpreter).parent.parent)
    path = os.pathsep.join(p for p in (str(Path(interpreter).parent), environ.get("PATH", "")) if p)
    return UvEnvironment(python=interpreter, prefix=prefix, seconds=seconds,
                         env_extra={"VIRTUAL_ENV": prefix, "PATH": path})
