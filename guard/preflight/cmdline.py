"""What the job's own command line asks for: ``train.py --report_to wandb --push_to_hub ...``, read, never run.

The forms read are those of ``transformers.HfArgumentParser`` and the argparse scripts built like it:

- ``--name value`` and ``--name=value``; a name followed by several values is a list (``--report_to wandb
  mlflow``, argparse ``nargs="+"``); dashes in names read as underscores (``--push-to-hub``).
- a bare boolean flag: ``--push_to_hub`` means True; ``--push_to_hub true|false|yes|no|1|0`` (HfArgumentParser's
  ``string_to_bool``) gives that value.
- a config file: one ``.json``/``.yaml``/``.yml`` positional argument (HfArgumentParser's ``parse_json_file`` /
  ``parse_yaml_file`` examples: ``python run_clm.py args.json``), TRL's ``--config FILE`` (``TrlParser``), and a
  ``.py`` positional read as ``NAME = literal`` lines (nanoGPT's ``configurator.py`` runs such files).
  Flags on the command line win over the file's values, as with ``TrlParser``.

Values stay text unless they read as a boolean, a whole number or a decimal number. Short options (``-v``) and
positionals that are not config files are ignored. Nothing here imports more than the standard library, except
PyYAML (a dependency of ``transformers``) when a YAML file is named.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["CONFIG_SUFFIXES", "JobArgs", "read_job_args", "to_bool"]

#: File suffixes read as a config file when given as a positional argument.
CONFIG_SUFFIXES = (".json", ".yaml", ".yml", ".py")

#: HfArgumentParser's ``string_to_bool`` (transformers/hf_argparser.py) accepts these, case-insensitive.
_TRUE = frozenset({"yes", "true", "t", "y", "1"})
_FALSE = frozenset({"no", "false", "f", "n", "0"})
_NUMBER = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")


def to_bool(value: Any) -> bool | None:
    """A flag's value as HfArgumentParser reads booleans; None when it is not a boolean.

    ``True``/``False`` stay; ``"yes"``, ``"true"``, ``"t"``, ``"y"``, ``"1"`` (any case) are True; ``"no"``,
    ``"false"``, ``"f"``, ``"n"``, ``"0"`` are False; ``0``/``1`` count too. Anything else is None.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        low = value.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
    return None


def _scalar(text: str) -> Any:
    """``"true"`` -> True, ``"10"`` -> 10, ``"2e-5"`` -> 2e-05; other text unchanged."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if _NUMBER.match(text.strip()):
        number = float(text)
        return int(number) if number.is_integer() and re.fullmatch(r"[+-]?\d+", text.strip()) else number
    return text


def _name(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _is_value(token: str) -> bool:
    """A token that is an option's value, not the next option: anything not starting with ``-``, or a number."""
    return not token.startswith("-") or bool(_NUMBER.match(token))


@dataclass(frozen=True)
class JobArgs:
    """The job's settings as its command line and config files give them.

    Attributes:
        values: name (underscores, no dashes) -> value: True for a bare flag, a list for several values, numbers
            and ``true``/``false`` converted; the file's values first, then the command line's on top.
        given: the names written on the command line itself (not only in a file).
        config_files: the config files read, in order.
        problems: why a named config file could not be read (missing, bad JSON/YAML, PyYAML not installed).
    """

    values: Mapping[str, Any] = field(default_factory=dict)
    given: frozenset[str] = frozenset()
    config_files: tuple[Path, ...] = ()
    problems: tuple[str, ...] = ()

    def get(self, name: str, default: Any = None) -> Any:
        """The value of ``name`` (underscores), or ``default``."""
        return self.values.get(name, default)

    def flag(self, name: str) -> bool | None:
        """``name`` read as a boolean (``to_bool``); None when absent or not a boolean."""
        return to_bool(self.values[name]) if name in self.values else None

    def text(self, name: str) -> str | None:
        """``name`` as one string (the first of a list), or None when absent or a bare flag."""
        value = self.values.get(name)
        if isinstance(value, list):
            value = value[0] if value else None
        if value is None or isinstance(value, bool):
            return None
        return str(value)

    def items(self, name: str) -> list[str]:
        """``name`` as a list of strings: ``--report_to wandb mlflow`` or ``--report_to wandb,mlflow`` -> both."""
        value = self.values.get(name)
        if value is None or isinstance(value, bool):
            return []
        parts = value if isinstance(value, list) else [value]
        return [piece.strip() for part in parts for piece in str(part).split(",") if piece.strip()]

    def source(self, name: str, value: object = None) -> str:
        """Where ``name`` came from, for messages: ``--name VALUE`` on the command line, else
        ``name: VALUE in FILE`` (the config file)."""
        if name in self.given or not self.config_files:
            return f"--{name}" if value is None else f"--{name} {value}"
        shown = self.values.get(name) if value is None else value
        return f"{name}: {shown} in {self.config_files[-1].name}"


def read_job_args(args: Sequence[str], *, cwd: Path | None = None) -> JobArgs:
    """Read the job's arguments (everything after the script).

    Args:
        args: the script's arguments, as the guard received them.
        cwd: the folder relative config paths are read from (default: the current folder).

    Returns:
        The settings; never raises (an unreadable config file is listed in ``problems``).
    """
    base = cwd or Path.cwd()
    flags: dict[str, Any] = {}
    files: list[Path] = []
    i = 0
    tokens = list(args)
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if token == "--":
            continue
        if token.startswith("--") and len(token) > 2:
            name, sep, inline = token.partition("=")
            values: list[Any] = [inline] if sep else []
            while not sep and i < len(tokens) and _is_value(tokens[i]):
                values.append(tokens[i])
                i += 1
            key = _name(name)
            if key == "config" and values:
                files.append(base / str(values[0]))
                continue
            if not values:
                flags[key] = True
            elif len(values) == 1:
                flags[key] = _scalar(str(values[0]))
            else:
                flags[key] = [_scalar(str(v)) for v in values]
        elif not token.startswith("-") and token.lower().endswith(CONFIG_SUFFIXES):
            files.append(base / token)
    merged: dict[str, Any] = {}
    problems: list[str] = []
    read: list[Path] = []
    for path in files:
        data, problem = _read_config(path)
        if problem:
            problems.append(problem)
            continue
        read.append(path)
        merged.update({_name(str(k)): v for k, v in data.items()})
    merged.update(flags)
    return JobArgs(values=merged, given=frozenset(flags), config_files=tuple(read), problems=tuple(problems))


def _read_config(path: Path) -> tuple[dict[str, Any], str | None]:
    """A config file's top-level mapping, or a problem text."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        return {}, f"cannot read the config file {path}: {exc.strerror or exc}"
    suffix = path.suffix.lower()
    try:
        if suffix == ".json":
            data = json.loads(text)
        elif suffix in (".yaml", ".yml"):
            try:
                import yaml  # only for a YAML config file
            except ImportError:
                return {}, f"cannot read {path.name}: PyYAML is not installed (pip install pyyaml)"
            data = yaml.safe_load(text)
        else:
            data = _python_literals(text)
    except (ValueError, SyntaxError) as exc:  # json.JSONDecodeError is a ValueError
        return {}, f"cannot read the config file {path.name}: {type(exc).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001 - yaml.YAMLError, without importing yaml at module level
        return {}, f"cannot read the config file {path.name}: {type(exc).__name__}: {exc}"
    if not isinstance(data, dict):
        return {}, f"the config file {path.name} is not a mapping of names to values"
    return data, None


def _python_literals(text: str) -> dict[str, Any]:
    """``NAME = literal`` statements at the top level of a Python config file (nanoGPT's ``config/*.py``)."""
    out: dict[str, Any] = {}
    for stmt in ast.parse(text).body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            try:
                out[stmt.targets[0].id] = ast.literal_eval(stmt.value)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                continue
    return out
