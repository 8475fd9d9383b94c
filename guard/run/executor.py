"""Carries out the decisions the policies return: the watchdog's ``Decision`` and the outcomes of the loop.

A decision records the run's outcome (the first one stands; ``LoopLink.record`` pauses the watches), may ask the
agents and py-spy for stacks, stops the job now or at a time, and tells securing, which secures what was saved
before a failure. A non-finite loss is secured first: the job is frozen (SIGSTOP) while the checkpoint saved
before it is pushed, then thawed and stopped (``release``), so that it cannot save over that checkpoint.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING

from guard.core.helpers import HELPERS
from guard.core.masking import Masker
from guard.core.state import Outcome
from guard.run.joblink import LoopLink
from guard.run.watchdog import Decision

if TYPE_CHECKING:
    from guard.secure.securing import Securing

__all__ = ["Executor"]

log = logging.getLogger("guard.supervisor")


class Executor:
    """Carries out decisions on the job through the loop's ``LoopLink``.

    Args:
        link: the loop's job link (the job, the agents, the stop timers, the outcome).
        clock: monotonic seconds.
        masker: masks the stacks py-spy prints.
        securer: the securing flow, told of every outcome, or None.

    Attributes:
        frozen: the job is SIGSTOPped while a failure's checkpoint is secured (``release`` thaws and stops it).
    """

    def __init__(self, link: LoopLink, *, clock: Callable[[], float], masker: Masker,
                 securer: Securing | None = None) -> None:
        self.link = link
        self.clock = clock
        self.masker = masker
        self.securer = securer
        self.frozen = False

    def carry_out(self, decisions: list[Decision], now: float) -> None:
        """Carry out the watchdog's ``decisions`` in order (``now``: monotonic seconds) until an outcome stands."""
        link = self.link
        for decision in decisions:
            if link.state.outcome is not None:
                return
            if decision.dump_stacks:
                link.broadcast({"t": "dump"})
                if link.job is not None:
                    from guard.observe.stacks import dump_stacks

                    HELPERS.submit(dump_stacks, link.job, self.masker)  # py-spy (up to 8 x 5 s) off the loop
            self.decide(decision.outcome, stop=decision.stop)
            if decision.stop_in_s is not None:
                link.stop_at = now + decision.stop_in_s  # the agents print their stacks first

    def decide(self, outcome: Outcome, *, stop: bool = True, secure: bool = True) -> None:
        """Record ``outcome`` unless one stands; with ``stop``, stop the job; with ``secure``, tell securing (a
        failure secures what was saved before it). After a non-finite loss with a push running, the job is frozen
        instead of stopped until securing is over."""
        link, securer = self.link, self.securer
        if not link.record(outcome):
            return
        if stop and secure and securer is not None and outcome.reason == "non_finite_loss" and link.job_alive():
            # Secure first, then stop: a job told to stop (or training on) may save again over the good checkpoint
            # (a loop's SIGTERM handler rewriting ckpt.pt with the NaN weights). Frozen with SIGSTOP meanwhile,
            # thawed and stopped once securing is over (bounded by its secure_by: --grace).
            securer.on_decided(link, outcome)
            if securer.push_running():
                log.info("pausing the job (SIGSTOP) while the checkpoint saved before the non-finite loss is secured")
                self.frozen = True
                link.signal_job(signal.SIGSTOP)
            else:
                link.stop_job(self.clock())
            return
        if stop:
            link.stop_job(self.clock())
        if secure and securer is not None:
            securer.on_decided(link, outcome)

    def release(self, now: float) -> None:
        """Once securing is over, a frozen job is thawed (SIGCONT) and stopped; ``now``: monotonic seconds."""
        if not self.frozen or (self.securer is not None and self.securer.busy()):
            return
        self.frozen = False
        self.link.signal_job(signal.SIGCONT)
        if self.link.job_alive():
            self.link.stop_job(now)

    def thaw(self) -> None:
        """At teardown: a frozen job gets SIGCONT (its leftovers are then stopped)."""
        if self.frozen:
            self.link.signal_job(signal.SIGCONT)
