"""Durations and sizes as the contract spells them (``7200``, ``45s``, ``1.5h``, ``D-HH:MM:SS``; ``500MB``,
``1.5GiB``), parsed and rendered, and a step as the guard's lines spell it. Part of the guard's bottom layer:
imports nothing of the guard but ``errors``."""

from __future__ import annotations

import math
import re

from guard.errors import UsageError

__all__ = ["DURATION_FORMS", "SIZE_FORMS", "format_duration_s", "format_size", "parse_duration", "parse_size",
           "step_text"]

DURATION_FORMS = ("whole seconds (7200), a number and a unit s/m/h/d (45s, 90m, 1.5h, 1d) or several in that order "
                  "(1h30m, 1m40s, as the guard's own lines write them), HH:MM:SS or D-HH:MM:SS")
SIZE_FORMS = "bytes (1000000) or a number and a unit (500MB, 10GB, 1.5GiB, 2T)"

_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_NUMBER_UNIT = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([smhd])\s*$", re.IGNORECASE)
# Several units, largest first, each once: what ``format_duration_s`` writes (``1h30m``, ``1d2h``, ``1m40s``).
_UNITS = re.compile(r"^\s*(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+(?:\.\d*)?)s)?\s*$", re.IGNORECASE)
_CLOCK = re.compile(r"^\s*(?:(\d+)-)?(\d+):(\d{1,2}):(\d{1,2})\s*$")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgtp]?)(i?)(b?)\s*$", re.IGNORECASE)


def parse_duration(text: str, *, option: str = "duration") -> float:
    """Parse a DURATION as the contract spells it.

    Args:
        text: ``7200`` (seconds), ``45s``, ``90m``, ``1.5h``, ``1d``, several units largest first (``1h30m``,
            ``1m40s``: what ``format_duration_s`` writes), ``HH:MM:SS`` or Slurm's ``D-HH:MM:SS``.
        option: the option name used in the error message.

    Returns:
        The duration in seconds (float, >= 0).

    Raises:
        UsageError: the text is none of these forms, or negative.
    """
    raw = str(text).strip()
    seconds: float | None = None
    if re.fullmatch(r"\d+(?:\.\d*)?", raw):
        seconds = float(raw)
    elif m := _NUMBER_UNIT.match(raw):
        seconds = float(m.group(1)) * _UNIT_S[m.group(2).lower()]
    elif (m := _UNITS.match(raw)) and any(m.groups()):
        seconds = sum(float(g) * size for g, size in zip(m.groups(), (86400.0, 3600.0, 60.0, 1.0), strict=True)
                      if g)
    elif m := _CLOCK.match(raw):
        days, hours, minutes, secs = (int(g) if g else 0 for g in m.groups())
        if minutes < 60 and secs < 60:
            seconds = days * 86400.0 + hours * 3600.0 + minutes * 60.0 + secs
    if seconds is None or not math.isfinite(seconds):
        raise UsageError(f"{option}: {text!r} is not a duration; accepted: {DURATION_FORMS}", option=option)
    return seconds


def parse_size(text: str, *, option: str = "size") -> int:
    """Parse a SIZE: ``1000000``, ``500MB``, ``10GB`` (powers of 1000), ``1.5GiB`` (powers of 1024).

    Returns:
        The size in bytes (int, >= 0).

    Raises:
        UsageError: the text is not a size.
    """
    m = _SIZE.match(str(text))
    if not m:
        raise UsageError(f"{option}: {text!r} is not a size; accepted: {SIZE_FORMS}", option=option)
    number, prefix, binary, _ = m.groups()
    base = 1024 if binary else 1000
    power = " kmgtp".index(prefix.lower()) if prefix else 0
    return int(float(number) * base**power)


def format_duration_s(seconds: float) -> str:
    """Render seconds for a human: ``7200`` -> ``"2h"``, ``5400`` -> ``"1h30m"``, ``45`` -> ``"45s"``,
    ``0.5`` -> ``"0.5s"`` (under a minute a fraction is kept; negative values count as 0)."""
    seconds = max(0.0, float(seconds))
    if seconds < 60 and seconds != int(seconds):
        return f"{seconds:g}s"
    total = round(seconds)
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if total >= size:
            parts.append(f"{total // size}{unit}")
            total %= size
    return "".join(parts) or "0s"


def format_size(size_bytes: float) -> str:
    """Render a size for a human in powers of 1000, as ``parse_size`` reads them back: ``812 B``, ``43.1 kB``,
    ``64.0 MB``, ``1.25 GB`` (a test job's checkpoint of a few kB is not ``0.0 MB``; negative values count as 0)."""
    size = max(0.0, float(size_bytes))
    if size < 1000:
        return f"{size:.0f} B"
    for unit, scale in (("kB", 1e3), ("MB", 1e6)):
        if round(size / scale, 1) < 1000:  # 999,999 bytes: "1.0 MB", not "1000.0 kB"
            return f"{size / scale:.1f} {unit}"
    return f"{size / 1e9:.2f} GB"


def step_text(step: int | None) -> str:
    """``"step N"``, or ``"step not known"`` for a save whose step neither the job reported nor the files record
    (a ``model.pt`` found by the scan of the output folder): the guard's lines never say ``step None``."""
    return "step not known" if step is None else f"step {step}"
