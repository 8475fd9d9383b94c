"""What the supervisor tells the in-job agent, read from the ``GUARD_AGENT_*`` variables (stdlib only).

The agent reads its own settings (it never imports the guard's command-line options module, ``guard.run.config``);
the variable names are ``guard.protocol``'s.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from .. import protocol

__all__ = ["AgentSettings", "agent_settings"]


class AgentSettings:
    """The agent's settings (immutable; a plain class, not a dataclass: ``dataclasses`` costs every job ~10 ms of
    imports, ``inspect`` and ``ast`` with it, that a job without torch never pays otherwise).

    Attributes:
        socket_path: the supervisor's socket (``GUARD_AGENT_SOCKET``); None: no supervisor, every call a no-op.
        sanity_steps: how many first steps are read one by one (``GUARD_AGENT_SANITY_STEPS``, default 5).
        check_every: after the sanity pass, read the loss every N steps (``GUARD_AGENT_CHECK_EVERY``, default 10).
        resume_path: the checkpoint folder to resume from (``GUARD_AGENT_RESUME_PATH``), or None.
        resume_step: that checkpoint's step (``GUARD_AGENT_RESUME_STEP``, default 0).
        ack_timeout_s: how long the agent waits for the supervisor's ``ack`` after ``trainer_config`` (seconds).
    """

    __slots__ = ("ack_timeout_s", "check_every", "resume_path", "resume_step", "sanity_steps", "socket_path")
    _FIELDS = ("socket_path", "sanity_steps", "check_every", "resume_path", "resume_step", "ack_timeout_s")
    socket_path: str | None
    sanity_steps: int
    check_every: int
    resume_path: str | None
    resume_step: int
    ack_timeout_s: float

    def __init__(self, socket_path: str | None, sanity_steps: int = 5, check_every: int = 10,
                 resume_path: str | None = None, resume_step: int = 0, ack_timeout_s: float = 10.0) -> None:
        for name, value in zip(self._FIELDS, (socket_path, sanity_steps, check_every, resume_path, resume_step,
                                                ack_timeout_s), strict=True):
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"AgentSettings is immutable: cannot set {name}")

    def _values(self) -> tuple[object, ...]:
        return tuple(getattr(self, name) for name in self._FIELDS)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AgentSettings) and self._values() == other._values()

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        return "AgentSettings(" + ", ".join(f"{name}={getattr(self, name)!r}" for name in self._FIELDS) + ")"


def agent_settings(environ: Mapping[str, str] | None = None) -> AgentSettings:
    """Read the ``GUARD_AGENT_*`` variables the supervisor set for the job (default: ``os.environ``). Never raises;
    a malformed number falls back to its default."""
    env = os.environ if environ is None else environ

    def _int(name: str, default: int) -> int:
        try:
            return max(0, int(env.get(name, default)))
        except ValueError:
            return default

    return AgentSettings(
        socket_path=env.get(protocol.ENV_SOCKET) or None,
        sanity_steps=_int(protocol.ENV_SANITY_STEPS, 5),
        check_every=max(1, _int(protocol.ENV_CHECK_EVERY, 10)),
        resume_path=env.get(protocol.ENV_RESUME_PATH) or None,
        resume_step=_int(protocol.ENV_RESUME_STEP, 0),
    )
