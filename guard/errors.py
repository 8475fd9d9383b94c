"""Every error the guard raises, under one root, one family per stage.

Each error carries a one-line ``hint`` (what to do) besides its message (what went wrong). The single error
boundary is ``guard.run.cli.main()``: it renders an error as one ``[guard]`` line plus a VERDICT, and maps the
family to the contract's exit code (see ``exit_code``). Failures of the *job* are never exceptions: they are
data (``guard.contract.RunResult``).
"""

from __future__ import annotations

__all__ = [
    "BudgetError",
    "ConfigError",
    "DestinationError",
    "GuardError",
    "HubError",
    "PreflightError",
    "PushFailedError",
    "SupervisorError",
    "TransientDestinationError",
    "UsageError",
]


class GuardError(Exception):
    """Root of every error raised by the guard itself.

    Args:
        message: what went wrong, one line.
        hint: what to do about it, one line. Defaults to a generic pointer at ``GUARD_DEBUG=1``.
    """

    #: Exit code of the contract for this family (``guard_error``: 70).
    exit_code: int = 70
    #: ``reason=`` of the VERDICT for this family.
    reason: str = "guard_error"
    default_hint = "set GUARD_DEBUG=1 for the traceback and report it as a bug"

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint or self.default_hint


# ---------------------------------------------------------------------------------------------------------------
# Command line and configuration
# ---------------------------------------------------------------------------------------------------------------


class UsageError(GuardError, ValueError):
    """A malformed option, a missing or unreadable script: the job is not started (exit 2)."""

    exit_code = 2
    reason = "usage"
    default_hint = "run `jobguard --help` for the accepted forms"

    def __init__(self, message: str, *, option: str | None = None, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.option = option


class ConfigError(UsageError):
    """A value from the environment (``GUARD_*``) or from a flag that cannot be parsed."""


# ---------------------------------------------------------------------------------------------------------------
# Stages
# ---------------------------------------------------------------------------------------------------------------


class PreflightError(GuardError):
    """A preflight check failed: the job is not started (exit 3)."""

    exit_code = 3
    reason = "preflight"

    def __init__(self, message: str, *, check: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.check = check


class SupervisorError(GuardError):
    """The supervisor could not start or control the job (a fault of the guard or of the machine)."""


class BudgetError(GuardError):
    """The deadline could not be computed (a malformed Slurm variable, a start time in the future)."""


class HubError(GuardError):
    """A Hub or filesystem destination could not be read or written."""

    def __init__(self, message: str, *, destination: str | None = None, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.destination = destination


class DestinationError(HubError):
    """A destination's verb (``guard.secure.dest.base.Store``) could not finish: refused, unreachable, a file that
    does not verify there, or its deadline passed. ``transient`` says whether the same call may succeed if tried
    again; only the caller decides about retrying."""

    transient: bool = False


class TransientDestinationError(DestinationError):
    """A destination's verb failed in a way that a retry may fix: a reset or timeout, HTTP 408/429/5xx, S3's
    ``503 SlowDown``, a write that lost a race to another writer."""

    transient = True


class PushFailedError(HubError):
    """A checkpoint or the final model could not be secured at its destination after every retry (exit 6)."""

    exit_code = 6
    reason = "push_failed"

    def __init__(
        self,
        message: str,
        *,
        destination: str | None = None,
        attempts: int = 0,
        hint: str | None = None,
    ) -> None:
        super().__init__(message, destination=destination, hint=hint)
        self.attempts = attempts


class PartsMissingError(PushFailedError):
    """A many-node checkpoint is not whole at the destination by the push's deadline: this node's part is there,
    verified, but another node's is not (or the parts together lack what the format names), so the record was not
    moved. ``missing`` is the VERDICT's ``missing=`` value (``node1``, ``files``, ``conflict``)."""

    def __init__(self, message: str, *, missing: str, destination: str | None = None, hint: str | None = None) -> None:
        super().__init__(message, destination=destination, hint=hint)
        self.missing = missing


class CheckpointRewrittenError(PushFailedError):
    """A checkpoint's file was written again (in place, or replaced) after the save it was reported for, before or
    while it was copied: it no longer holds that step, so it is never secured under it. The job's newer save is
    reported on its own and secured under its own step."""


class WeightsNotFiniteError(PushFailedError):
    """A checkpoint's saved weights hold a NaN or an infinity (read by the guard, ``guard.secure.weights``): never
    secured (a push refuses it before any byte moves) and never resumed (a fetch refuses it before placing it).
    ``file`` is the file (relative to the checkpoint), ``tensor`` the first such tensor in it."""

    def __init__(self, message: str, *, file: str, tensor: str, destination: str | None = None,
                 hint: str | None = None) -> None:
        super().__init__(message, destination=destination, hint=hint)
        self.file = file
        self.tensor = tensor
