"""What the supervisor tells the in-job agent, read from the ``GUARD_AGENT_*`` variables (stdlib only).

The agent reads its own settings (it never imports the guard's command-line options module, ``guard.run.config``);
the variable names are ``guard.protocol``'s.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from .. import protocol

__all__ = ["AgentSettings", "agent_settings"]


@dataclass(frozen=True)
class AgentSettings:
    """The agent's settings.

    Attributes:
        socket_path: the supervisor's socket (``GUARD_AGENT_SOCKET``); None: no supervisor, every call a no-op.
        sanity_steps: how many first steps are read one by one (``GUARD_AGENT_SANITY_STEPS``, default 5).
        check_every: after the sanity pass, read the loss every N steps (``GUARD_AGENT_CHECK_EVERY``, default 10).
        resume_path: the checkpoint folder to resume from (``GUARD_AGENT_RESUME_PATH``), or None.
        resume_step: that checkpoint's step (``GUARD_AGENT_RESUME_STEP``, default 0).
        ack_timeout_s: how long the agent waits for the supervisor's ``ack`` after ``trainer_config`` (seconds).
    """

    socket_path: str | None
    sanity_steps: int = 5
    check_every: int = 10
    resume_path: str | None = None
    resume_step: int = 0
    ack_timeout_s: float = 10.0


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
