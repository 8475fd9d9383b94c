"""The supervisor's timing decisions as small pure objects, driven by the caller's clock.

They hold no threads and never sleep: the event loop asks each one when it is next due (``due_at``) to bound
its ``select`` timeout, and whether it has fired (``expired``/``kill_due``) after each wake-up. Tests drive them
with plain numbers.
"""

from __future__ import annotations

import math

__all__ = ["Escalation", "StallWatch"]


class StallWatch:
    """A hang is no training step for ``timeout_s`` seconds, or, before the first step, no output at all.

    Args:
        timeout_s: the ``--stall-timeout`` in seconds; 0 (or less) turns the watch off.
        now: the clock's value at start (monotonic seconds).
    """

    def __init__(self, timeout_s: float, now: float) -> None:
        self.timeout_s = timeout_s
        self.last_progress = now
        self.first_step_seen = False
        self.paused = False

    def output(self, now: float) -> None:
        """The job printed something (counts as progress only before the first step)."""
        if not self.first_step_seen:
            self.last_progress = now

    def step(self, now: float) -> None:
        """The job finished a training step."""
        self.first_step_seen = True
        self.last_progress = now

    def pause(self) -> None:
        """Stop watching (the guard itself is stopping the job or securing a checkpoint)."""
        self.paused = True

    def due_at(self) -> float:
        return math.inf if self.paused or self.timeout_s <= 0 else self.last_progress + self.timeout_s

    def expired(self, now: float) -> bool:
        return now >= self.due_at()

    def silent_for_s(self, now: float) -> float:
        return now - self.last_progress


class Escalation:
    """SIGTERM now, SIGKILL ``grace_s`` later unless everything has ended.

    Args:
        grace_s: seconds between the SIGTERM and the SIGKILL (``--grace``).
    """

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.term_at: float | None = None
        self.killed = False

    @property
    def started(self) -> bool:
        return self.term_at is not None

    def start(self, now: float, grace_s: float | None = None) -> bool:
        """Begin (idempotent); returns True the first time, when the caller must send SIGTERM."""
        if self.term_at is not None:
            return False
        if grace_s is not None:
            self.grace_s = grace_s
        self.term_at = now
        return True

    def due_at(self) -> float:
        if self.term_at is None or self.killed:
            return math.inf
        return self.term_at + self.grace_s

    def kill_due(self, now: float) -> bool:
        """True once, when the grace has run out: the caller must send SIGKILL."""
        if self.term_at is None or self.killed or now < self.due_at():
            return False
        self.killed = True
        return True
