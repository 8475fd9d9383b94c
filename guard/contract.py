"""How a run ended, as data, and its renderings: the VERDICT line, the JSON report, the exit code.

The grammar (``../shared/CONTRACT.md``, "The VERDICT line")::

    VERDICT: STATUS reason=REASON exit=CODE elapsed=SECONDS [KEY=VALUE ...]

The text after ``VERDICT: `` splits with ``shlex.split``; values with spaces or quotes are quoted with
``shlex.quote``. Optional keys appear in a fixed order when known.

Statuses, reasons and exit codes are enums (``Status``, ``Reason``: ``str`` enums; ``ExitCode``: an ``int`` enum),
so they compare equal to, and render as, the plain values the contract writes. The VERDICT line is rendered
(``render_line``) and parsed (``parse_verdict``, used by ``python -m guard watch``) here.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shlex
import signal
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from enum import Enum, IntEnum
from pathlib import Path
from typing import Any, Protocol

from guard.files import write_atomic

__all__ = [
    "EXIT_GUARD_ERROR",
    "EXIT_INCOMPLETE",
    "EXIT_NON_FINITE",
    "EXIT_OWN_CODE_TAKEN",
    "EXIT_PREFLIGHT",
    "EXIT_PUSH_FAILED",
    "EXIT_SECURED",
    "EXIT_STALLED",
    "EXIT_TIMEOUT_UNSECURED",
    "EXIT_USAGE",
    "TABLE_EXIT_CODES",
    "ExitCode",
    "Reason",
    "RunResult",
    "Status",
    "TextMasker",
    "Verdict",
    "parse_verdict",
    "render_line",
    "settle_exit_code",
    "signal_name",
    "write_report",
]

log = logging.getLogger("guard.contract")


class TextMasker(Protocol):
    """What masks the VERDICT line and the report: ``guard.core.masking.Masker``, or an adapter of a function."""

    def mask_text(self, text: str) -> str:
        """``text`` with every secret value replaced."""
        ...


class Status(str, Enum):
    """The VERDICT's STATUS (contract, "The VERDICT line")."""

    PASS = "PASS"
    FAIL = "FAIL"
    TIMEOUT = "TIMEOUT"
    INTERRUPTED = "INTERRUPTED"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Reason(str, Enum):
    """The VERDICT's ``reason=`` (contract, the table of statuses, reasons and exit codes)."""

    OK = "ok"
    DRY_RUN = "dry_run"
    USAGE = "usage"
    PREFLIGHT = "preflight"
    NON_FINITE_LOSS = "non_finite_loss"
    STALLED = "stalled"
    PUSH_FAILED = "push_failed"
    INCOMPLETE = "incomplete"
    CRASH = "crash"
    OOM = "oom"
    KILLED = "killed"
    GUARD_ERROR = "guard_error"
    DEADLINE = "deadline"
    SIGNAL = "signal"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class ExitCode(IntEnum):
    """The guard's fixed exit codes (a crash exits with the job's own code; a signal with 128 + its number)."""

    OK = 0
    USAGE = 2
    PREFLIGHT = 3
    NON_FINITE = 4
    STALLED = 5
    PUSH_FAILED = 6
    INCOMPLETE = 7  # the job exited 0, but training ended early on an error it swallowed
    GUARD_ERROR = 70
    SECURED = 75  # stopped early, the newest checkpoint is secured where pushed= says (EX_TEMPFAIL)
    TIMEOUT_UNSECURED = 124  # as timeout(1)

    def __str__(self) -> str:  # "5", as on Python 3.11+, also on 3.10
        return str(int(self))

    def __format__(self, spec: str) -> str:
        return format(int(self), spec)


# The module-level names other modules use (aliases of the enums' members).
EXIT_OK = ExitCode.OK
EXIT_USAGE = ExitCode.USAGE
EXIT_PREFLIGHT = ExitCode.PREFLIGHT
EXIT_NON_FINITE = ExitCode.NON_FINITE
EXIT_STALLED = ExitCode.STALLED
EXIT_PUSH_FAILED = ExitCode.PUSH_FAILED
EXIT_INCOMPLETE = ExitCode.INCOMPLETE
EXIT_GUARD_ERROR = ExitCode.GUARD_ERROR
EXIT_SECURED = ExitCode.SECURED
EXIT_TIMEOUT_UNSECURED = ExitCode.TIMEOUT_UNSECURED

#: The exit codes of the contract's table that mean something of their own (2-7, 70, 75, 124). A job that exits with one
#: of them by itself is reported with ``EXIT_OWN_CODE_TAKEN`` and its own code in ``job_exit=``, so that a scheduler
#: rule on the guard's codes (requeue on 75, fail fast on 2, 3, 4) never reads a crash as "secured, resume".
TABLE_EXIT_CODES = frozenset(int(code) for code in ExitCode if code != ExitCode.OK)
#: The guard's exit code for a job's own exit code that is one of ``TABLE_EXIT_CODES`` (contract: "1 when that code
#: is one of this table's").
EXIT_OWN_CODE_TAKEN = 1

STATUSES = tuple(status.value for status in Status)
REASONS = tuple(reason.value for reason in Reason)
#: Optional keys, in the order they are written.
OPTIONAL_KEYS = (
    "step",
    "steps",
    "loss",
    "rank",
    "node",
    "checkpoint",
    "pushed",
    "secured",
    "secured_step",
    "missing",
    "resumed_from",
    "job_exit",
    "signal",
    "check",
    "warning",
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

    status: str  # a Status (or its plain value)
    reason: str  # a Reason (or its plain value)
    exit_code: int  # an ExitCode, or the job's code, or 128 + a signal
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


def settle_exit_code(result: RunResult) -> RunResult:
    """Make ``result``'s exit code mean one thing only (contract, the table of exit codes); returns ``result``.

    - ``crash`` and ``oom`` carry the job's own exit code: when it is one of ``TABLE_EXIT_CODES`` (a job that exits
      4, 75 or 124 by itself), the guard exits ``EXIT_OWN_CODE_TAKEN`` (1) and keeps the job's code in ``job_exit=``
      and in the report's ``details["job_exit_code"]``.
    - 75 means "the newest checkpoint is secured": a result with exit 75 whose ``secured=`` is not ``yes`` exits
      124 (``TIMEOUT``) or 128 + its signal (``INTERRUPTED``), and ``EXIT_OWN_CODE_TAKEN`` for any other status.

    Called once, on the way to the VERDICT (``guard.run.cli``), whatever built the result.
    """
    code = int(result.exit_code)
    if str(result.reason) in (Reason.CRASH.value, Reason.OOM.value) and code in TABLE_EXIT_CODES:
        result.extra.setdefault("job_exit", code)
        result.details.setdefault("job_exit_code", code)
        result.exit_code = EXIT_OWN_CODE_TAKEN
        log.info("the job's own exit code %d is one of the guard's (2-7, 70, 75, 124): exit %d, job_exit=%d", code,
                 EXIT_OWN_CODE_TAKEN, code)
    elif code == ExitCode.SECURED and _format_value(result.extra.get("secured")) != "yes":
        if str(result.status) == Status.TIMEOUT.value:
            result.exit_code = ExitCode.TIMEOUT_UNSECURED
        elif str(result.status) == Status.INTERRUPTED.value and (signum := _signal_number(result.extra)) is not None:
            result.exit_code = 128 + signum
        else:
            result.exit_code = EXIT_OWN_CODE_TAKEN
        log.warning("exit 75 without secured=yes: exit %d instead (75 always means a secured checkpoint)",
                    int(result.exit_code))
    return result


def _signal_number(extra: Mapping[str, Any]) -> int | None:
    name = extra.get("signal")
    try:
        return int(signal.Signals[str(name)]) if name else None
    except KeyError:
        return None


def _format_value(value: Any) -> str:
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:.6g}"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def render_line(result: RunResult, masker: TextMasker | None = None) -> str:
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

    parts = [str(result.status)] + [f"{key}={shlex.quote(text(value))}" for key, value in fields.items()]
    return "VERDICT: " + " ".join(parts)  # status, keys and numbers carry no secret; every value was masked


_TIMESTAMP = r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(?:[.,]\d{1,9})?(?:Z|[+-]\d{2}:?\d{2})?"
_VERDICT_LINE = re.compile(rf"^(?:{_TIMESTAMP}[ \t]+|\[{_TIMESTAMP}\][ \t]+)?VERDICT: (?P<rest>.*)$")
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_EXIT = re.compile(r"^[0-9]{1,3}$")


@dataclass(frozen=True)
class Verdict:
    """One parsed guard VERDICT line.

    Attributes:
        status: one of ``STATUSES``.
        reason: the ``reason=`` value (``ok``, ``non_finite_loss``, ...).
        exit_code: the ``exit=`` value, 0..255.
        elapsed_s: the ``elapsed=`` value, seconds since the guard started.
        fields: every ``KEY=VALUE`` pair of the line as strings, required keys included (``step``, ``loss``,
            ``pushed``, ``hint``... when present).
    """

    status: str
    reason: str
    exit_code: int
    elapsed_s: float
    fields: Mapping[str, str] = field(default_factory=dict, hash=False)


def parse_verdict(line: str) -> Verdict | None:
    """Parse one log line as a guard VERDICT line (the inverse of ``render_line``).

    A line counts when it starts with ``VERDICT: ``, after at most one timestamp prefix (``2025-01-02T03:04:05Z``
    or the same in brackets, as log collectors add).

    Args:
        line: one line of the log, with or without its trailing ``\\n`` / ``\\r\\n``.

    Returns:
        The ``Verdict``, or ``None`` when the line is not a guard VERDICT line, or it is but does not parse (shell
        quoting, unknown STATUS, a token that is not ``KEY=VALUE``, a missing or malformed
        ``reason``/``exit``/``elapsed``); the latter is logged at debug level.
    """
    match = _VERDICT_LINE.match(line.rstrip("\r\n"))
    if match is None:
        return None
    try:
        tokens = shlex.split(match["rest"])
    except ValueError as exc:
        log.debug("VERDICT-like line ignored (%s): %r", exc, line)
        return None
    if not tokens or tokens[0] not in STATUSES:
        log.debug("VERDICT-like line ignored (STATUS not one of %s): %r", "/".join(STATUSES), line)
        return None
    fields: dict[str, str] = {}
    for token in tokens[1:]:
        key, sep, value = token.partition("=")
        if not sep or not _KEY.match(key):
            log.debug("VERDICT-like line ignored (%r is not KEY=VALUE): %r", token, line)
            return None
        fields[key] = value
    reason = fields.get("reason", "")
    exit_text = fields.get("exit", "")
    exit_code = int(exit_text) if _EXIT.match(exit_text) else -1
    try:
        elapsed_s = float(fields.get("elapsed", ""))
    except ValueError:
        elapsed_s = math.nan
    if not reason or not 0 <= exit_code <= 255 or not math.isfinite(elapsed_s) or elapsed_s < 0:
        log.debug("VERDICT-like line ignored (reason, exit 0..255 or elapsed missing or malformed): %r", line)
        return None
    return Verdict(tokens[0], reason, exit_code, elapsed_s, fields)


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

    cleaned: dict[str, Any] = clean(data)
    return cleaned


def write_report(path: str | os.PathLike[str], result: RunResult, masker: TextMasker | None = None) -> None:
    """Write the JSON report atomically (temporary file in the same folder, fsync, rename).

    Raises:
        OSError: the folder cannot be written.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(report_dict(result), indent=2, sort_keys=True, default=str)
    if masker is not None:
        text = masker.mask_text(text)
    write_atomic(target, (text + "\n").encode("utf-8"), mode=0o600)  # owner-only: the job's command and settings
