"""The script's own Hugging Face Jobs settings: the ``[tool.hf-jobs]`` table of its PEP 723 ``script`` block.

``hf jobs uv run train.py`` (huggingface_hub >= 2.x) reads launch defaults from that table; the guard reads the
same table so that the job's settings are not repeated by hand:

- ``timeout`` is a deadline source when no ``--timeout``/``GUARD_TIMEOUT`` is given (see ``guard.stages``);
- ``secrets`` and ``env`` name variables the job needs (the env check);
- ``flavor`` gives the accelerator the job expects (type and count, ``FLAVORS``) for the GPU check.

Sources: ``huggingface_hub/cli/_uv_script_header.py`` (2.4.0): the table name ``tool.hf-jobs``, its keys
(``VALID_KEYS`` there: image, flavor, python, timeout, name, namespace, network_group, env, secrets, labels,
volumes, network_aliases), their types (strings; ``timeout`` a string or an integer of seconds; ``env`` and
``labels`` tables of strings; ``secrets``, ``volumes``, ``network_aliases`` lists of strings; ``secrets`` never a
table), and that an unknown key is an error. ``hf jobs`` turns a timeout such as ``"2h"`` into seconds with the
units s, m, h, d (``_create_job_spec`` in ``huggingface_hub/_jobs_api.py``). The flavor table is the
``JobHardware`` enum of ``huggingface_hub/_jobs_api.py`` (2.4.0) with the hardware each flavor gives, from the
Hub documentation (``docs/hub/jobs-configuration.md``, "Hardware flavor").
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from guard.preflight.script import PEP723_REGEX

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

__all__ = ["FLAVORS", "FlavorGpus", "HfJobsTable", "expected_flavor", "read_hf_jobs", "read_hf_jobs_file"]

TABLE = "tool.hf-jobs"

#: The keys ``hf jobs uv run`` accepts in ``[tool.hf-jobs]`` (``UvScriptHeader`` fields, huggingface_hub 2.4.0).
VALID_KEYS: tuple[str, ...] = ("image", "flavor", "python", "timeout", "name", "namespace", "network_group", "env",
                               "secrets", "labels", "volumes", "network_aliases")
_STR_KEYS = ("image", "flavor", "python", "name", "namespace", "network_group")
_TABLE_KEYS = ("env", "labels")
_LIST_KEYS = ("secrets", "volumes", "network_aliases")


@dataclass(frozen=True)
class FlavorGpus:
    """The accelerators an HF Jobs flavor gives: ``gpu_type`` (text the NVML name contains) and ``count``."""

    gpu_type: str | None
    count: int


#: HF Jobs flavor -> the GPUs it gives (CPU flavors: none). From the ``JobHardware`` enum (huggingface_hub 2.4.0)
#: and the Hub's "Hardware flavor" table (jobs-configuration.md). NVML names: "Tesla T4", "NVIDIA A10G",
#: "NVIDIA L4", "NVIDIA L40S", "NVIDIA A100-SXM4-80GB", "NVIDIA H200", "NVIDIA RTX PRO 6000 ...".
FLAVORS: Mapping[str, FlavorGpus] = {
    "cpu-basic": FlavorGpus(None, 0), "cpu-upgrade": FlavorGpus(None, 0),
    "cpu-performance": FlavorGpus(None, 0), "cpu-xl": FlavorGpus(None, 0),
    "t4-small": FlavorGpus("T4", 1), "t4-medium": FlavorGpus("T4", 1),
    "l4x1": FlavorGpus("L4", 1), "l4x4": FlavorGpus("L4", 4),
    "l40sx1": FlavorGpus("L40S", 1), "l40sx4": FlavorGpus("L40S", 4), "l40sx8": FlavorGpus("L40S", 8),
    "a10g-small": FlavorGpus("A10G", 1), "a10g-large": FlavorGpus("A10G", 1),
    "a10g-largex2": FlavorGpus("A10G", 2), "a10g-largex4": FlavorGpus("A10G", 4),
    "a100-large": FlavorGpus("A100", 1), "a100x4": FlavorGpus("A100", 4), "a100x8": FlavorGpus("A100", 8),
    "h200": FlavorGpus("H200", 1), "h200x2": FlavorGpus("H200", 2), "h200x4": FlavorGpus("H200", 4),
    "h200x8": FlavorGpus("H200", 8),
    "rtx-pro-6000": FlavorGpus("RTX PRO 6000", 1), "rtx-pro-6000x2": FlavorGpus("RTX PRO 6000", 2),
    "rtx-pro-6000x4": FlavorGpus("RTX PRO 6000", 4), "rtx-pro-6000x8": FlavorGpus("RTX PRO 6000", 8),
}


@dataclass(frozen=True)
class HfJobsTable:
    """The script's ``[tool.hf-jobs]`` table, checked.

    Attributes:
        path: the script.
        values: the table as written (key -> value), empty on an error.
        timeout_s: ``timeout`` in seconds, or None when not given.
        timeout_text: ``timeout`` as written (``"2h"``, ``"3600"``), or None.
        flavor: ``flavor``, or None.
        secrets: ``secrets`` names.
        env: ``env`` names (their values are set by ``hf jobs`` at launch).
        error: what is wrong with the table, naming the file and line, or None.
    """

    path: Path
    values: Mapping[str, Any] = field(default_factory=dict)
    timeout_s: float | None = None
    timeout_text: str | None = None
    flavor: str | None = None
    secrets: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    error: str | None = None


def _key_line(lines: list[str], first: int, key: str | None) -> int:
    """The file's 1-based line of ``key = ...`` inside ``[tool.hf-jobs]`` (else of the table header, else ``first``)."""
    header = re.compile(r"^#\s*\[\s*tool\s*\.\s*[\"']?hf-jobs[\"']?\s*\]")
    start = next((i for i in range(first - 1, len(lines)) if header.match(lines[i])), None)
    if start is None:
        return first
    if key:
        pattern = re.compile(rf"^#\s*[\"']?{re.escape(key)}[\"']?\s*[=.]")
        for i in range(start + 1, len(lines)):
            if re.match(r"^#\s*\[", lines[i]) or lines[i].startswith("# ///"):
                break
            if pattern.match(lines[i]):
                return i + 1
    return start + 1


def read_hf_jobs(source: str, *, path: Path) -> HfJobsTable | None:
    """Read and check the ``[tool.hf-jobs]`` table of a script's PEP 723 block.

    Args:
        source: the script's text.
        path: the script (for messages).

    Returns:
        None when the script has no such table (or no block, or a block the PEP 723 row already reports as
        broken); else the table, with ``error`` set (naming ``path`` and the line) when it is malformed: not a
        table, an unknown key, a value of the wrong type, a timeout that is not a duration.
    """
    from guard.core.durations import parse_duration
    from guard.errors import UsageError

    text = source.replace("\r\n", "\n").replace("\r", "\n")
    blocks = [m for m in PEP723_REGEX.finditer(text) if m.group("type") == "script"]
    if len(blocks) != 1 or "hf-jobs" not in blocks[0].group("content"):
        return None
    match = blocks[0]
    first = text.count("\n", 0, match.start()) + 1
    lines = text.split("\n")
    content = "".join(line[2:] if line.startswith("# ") else line[1:]
                      for line in match.group("content").splitlines(keepends=True))
    try:
        table = tomllib.loads(content).get("tool", {}).get("hf-jobs")
    except tomllib.TOMLDecodeError:
        return None  # the PEP 723 row reports the TOML error with its line
    if table is None:
        return None

    def bad(key: str | None, what: str) -> HfJobsTable:
        return HfJobsTable(path, error=f"{path.name} line {_key_line(lines, first, key)}: [{TABLE}] {what}")

    if not isinstance(table, dict):
        return bad(None, "must be a table")
    unknown = sorted(k for k in table if k not in VALID_KEYS)
    if unknown:
        return bad(unknown[0], f"unknown key {unknown[0]!r}; valid keys: {', '.join(VALID_KEYS)}")
    for key in _STR_KEYS:
        if key in table and not isinstance(table[key], str):
            return bad(key, f"{key} must be a string, got {table[key]!r}")
    for key in _TABLE_KEYS:
        value = table.get(key, {})
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            return bad(key, f"{key} must be a table of strings, got {value!r}")
    for key in _LIST_KEYS:
        value = table.get(key, [])
        if key == "secrets" and isinstance(value, dict):
            return bad(key, "secrets must be a list of names (secrets = [\"HF_TOKEN\"]), not a table of values")
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            return bad(key, f"{key} must be a list of strings, got {value!r}")
    timeout_s = timeout_text = None
    if "timeout" in table:
        raw = table["timeout"]
        if isinstance(raw, bool) or not isinstance(raw, (str, int)):
            return bad("timeout", f"timeout must be a duration string (\"30m\") or whole seconds, got {raw!r}")
        timeout_text = str(raw)
        try:
            timeout_s = parse_duration(timeout_text, option="timeout")
        except UsageError:
            timeout_s = None
        if timeout_s is None or timeout_s <= 0:
            return bad("timeout", f"timeout {timeout_text!r} is not a positive duration (e.g. \"30m\", \"2h\", 7200)")
    return HfJobsTable(path, values=dict(table), timeout_s=timeout_s, timeout_text=timeout_text,
                       flavor=table.get("flavor"), secrets=tuple(table.get("secrets", ())),
                       env=tuple(table.get("env", {})))


def read_hf_jobs_file(path: Path | None) -> HfJobsTable | None:
    """``read_hf_jobs`` for a file; None without a script or when it cannot be read (other checks say why)."""
    if path is None:
        return None
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return read_hf_jobs(source, path=path)


def expected_flavor(table: HfJobsTable | None, environ: Mapping[str, str]) -> tuple[str, str] | None:
    """The flavor this job runs on, and where that came from, or None when unknown.

    On HF Jobs ``ACCELERATOR`` names the hardware actually given (``hf jobs run --flavor`` overrides the script's
    table); it wins when it is a known flavor. Otherwise the table's ``flavor``.
    """
    accelerator = (environ.get("ACCELERATOR") or "").strip().lower()
    if accelerator in FLAVORS:
        return accelerator, "ACCELERATOR"
    if table is not None and table.error is None and table.flavor:
        return table.flavor, f"[{TABLE}] flavor in {table.path.name}"
    return None
