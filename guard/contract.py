"""How a run ended, as data, and its renderings: the VERDICT line, the JSON report, the exit code.

The grammar (``../shared/CONTRACT.md``, "The VERDICT line")::

    VERDICT: STATUS reason=REASON exit=CODE elapsed=SECONDS [KEY=VALUE ...]

The text after ``VERDICT: `` splits with ``shlex.split``; values with spaces or quotes are quoted with
``shlex.quote``. Optional keys appear in a fixed order when known.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from guard.run.masking import Masker

__all__ = [
    "EXIT_GUARD_ERROR",
    "EXIT_INCOMPLETE",
    "EXIT_NON_FINITE",
    "EXIT_PREFLIGHT",
    "EXIT_PUSH_FAILED",
    "EXIT_SECURED",
    "EXIT_STALLED",
    "EXIT_TIMEOUT_UNSECURED",
    "EXIT_USAGE",
    "RunResult",
    "render_line",
    "signal_name",
    "write_report",
]

# Exit codes of the contract.
EXIT_OK = 0
EXIT_USAGE = 2
EXIT_PREFLIGHT = 3
EXIT_NON_FINITE = 4
EXIT_STALLED = 5
EXIT_PUSH_FAILED = 6
EXIT_INCOMPLETE = 7  # the job exited 0, but training ended early on an error it swallowed
EXIT_GUARD_ERROR = 70
EXIT_SECURED = 75  # stopped early, the newest checkpoint is secured where pushed= says (EX_TEMPFAIL)
EXIT_TIMEOUT_UNSECURED = 124  # as timeout(1)

STATUSES = ("PASS", "FAIL", "TIMEOUT", "INTERRUPTED")
#: Optional keys, in the order they are written.
OPTIONAL_KEYS = (
    "step",
    "loss",
    "rank",
    "node",
    "checkpoint",
    "pushed",
    "secured",
    "resumed_from",
    "signal",
    "check",
    "hint",
)


def signal_name(signum: int) -> str:
    """``15`` -> ``"SIGTERM"`` (``"SIG15"`` for a number without a name)."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"SIG{signum}"


@dataclass
class RunResult:
    """How one guard run ended. Built by the supervisor (or the CLI for usage and preflight errors).

    Attributes:
        status: ``PASS``, ``FAIL``, ``TIMEOUT`` or ``INTERRUPTED``.
        reason: ``ok``, ``dry_run``, ``usage``, ``preflight``, ``non_finite_loss``, ``stalled``, ``push_failed``,
            ``incomplete``, ``crash``, ``oom``, ``killed``, ``guard_error``, ``deadline``, ``signal``.
        exit_code: the guard's exit code (the contract's table).
        elapsed_s: seconds since the guard started.
        step, loss: the last training step and loss seen (None when none was seen).
        sanity: the losses of the sanity pass, in order.
        extra: optional VERDICT keys (``checkpoint``, ``pushed``, ``secured``, ``signal``, ``check``, ``rank`` ...).
        hint: one line: what to do.
        details: anything else for the JSON report (preflight rows, job exit status, exceptions ...).
    """

    status: str
    reason: str
    exit_code: int
    elapsed_s: float = 0.0
    step: int | None = None
    loss: float | None = None
    sanity: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    hint: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"unknown status {self.status!r}")


def _format_value(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:.6g}"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def render_line(result: RunResult, masker: Masker | None = None) -> str:
    """The one VERDICT line for ``result`` (no trailing newline), secrets masked.

    Example:
        >>> render_line(RunResult("FAIL", "non_finite_loss", 4, 12.34, step=3, loss=float("nan")))
        'VERDICT: FAIL reason=non_finite_loss exit=4 elapsed=12.3 step=3 loss=nan'
    """
    fields: dict[str, Any] = {"reason": result.reason, "exit": result.exit_code, "elapsed": f"{result.elapsed_s:.1f}"}
    known = {"step": result.step, "loss": result.loss, "hint": result.hint, **result.extra}
    for key in OPTIONAL_KEYS:
        if known.get(key) is not None:
            fields[key] = known[key]
    for key, value in result.extra.items():
        if key not in fields and value is not None:
            fields[key] = value
    def text(value: Any) -> str:
        shown = " ".join(_format_value(value).splitlines())  # one line, whatever a hint contained
        return masker.mask_text(shown) if masker else shown  # masked before quoting, so quoting can't hide it

    parts = [result.status] + [f"{key}={shlex.quote(text(value))}" for key, value in fields.items()]
    return "VERDICT: " + " ".join(parts)  # status, keys and numbers carry no secret; every value was masked


def report_dict(result: RunResult) -> dict[str, Any]:
    """The JSON report's content (non-finite floats become strings, so the file stays strict JSON)."""
    data = asdict(result)
    data["elapsed_s"] = round(result.elapsed_s, 3)

    def clean(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return str(value)
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v) for v in value]
        return value

    return clean(data)


def write_report(path: str | os.PathLike[str], result: RunResult, masker: Masker | None = None) -> None:
    """Write the JSON report atomically (temporary file in the same folder, fsync, rename).

    Raises:
        OSError: the folder cannot be written.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(report_dict(result), indent=2, sort_keys=True, default=str)
    if masker is not None:
        text = masker.mask_text(text)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
