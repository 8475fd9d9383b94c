"""The ranks of a distributed job, as the supervisor sees them: which one is primary, and which one fell silent.

A plain policy object, driven by the caller's clock (no threads, no sleeping; tests use plain numbers):

- The primary rank is this machine's first rank when the launcher's command says which it is
  (``expected_primary``: rank 0 on node 0, ``node_rank x nproc-per-node`` elsewhere), from the first step on,
  whatever order the ranks connect and report in; else (or when that rank never reports within
  ``FALLBACK_STEPS`` steps of another's) the lowest rank seen so far. Only its steps feed the sanity pass,
  ``step`` and ``loss``; every rank is still checked for non-finite losses by the caller.
- Every rank's last step time is watched: a rank silent for ``stall_timeout_s`` while another rank stepped within
  that time is stalled (``FAIL reason=stalled rank=R``). When all ranks are silent together (a collective that
  waits for a dead peer, a long save), this watch says nothing: the job-wide stall watch (``timers.StallWatch``)
  decides then.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from guard.preflight.launch import LaunchCommand

__all__ = ["FALLBACK_STEPS", "RankWatch", "configured_node_rank", "expected_primary", "parse_launch"]

#: When the expected primary rank has not reported by the time another rank reports this many steps, the lowest
#: rank seen stands instead (a launcher whose rank numbering the guard did not read right).
FALLBACK_STEPS = 50


class RankWatch:
    """Per-rank progress.

    Args:
        stall_timeout_s: the ``--stall-timeout`` in seconds.
        expected_primary: this machine's first rank as the launcher's command says it, or None (unknown).

    Attributes:
        last_step: rank -> (last step, monotonic seconds when it was reported), for every rank seen.
        done: ranks that ended their training (not watched for silence any more).
    """

    def __init__(self, stall_timeout_s: float, expected_primary: int | None = None) -> None:
        self.stall_timeout_s = stall_timeout_s
        self.expected_primary = expected_primary
        self.last_step: dict[int, tuple[int, float]] = {}
        self.paused = False
        self.done: set[int] = set()

    @property
    def primary(self) -> int | None:
        """The expected primary rank (see the module's docstring), else the lowest rank seen (None before any rank
        reported a step)."""
        expected = self.expected_primary
        if expected is not None and (expected in self.last_step or not self.last_step
                                     or max(step for step, _ in self.last_step.values()) < FALLBACK_STEPS):
            return expected
        return min(self.last_step) if self.last_step else None

    def on_step(self, rank: int, step: int | None, now: float) -> bool:
        """Record a training step of ``rank`` (``step`` None: one more than its last); True when ``rank`` is the
        primary rank, whose step and loss stand for the job's."""
        if step is None:
            step = self.last_step.get(rank, (0, now))[0] + 1
        self.last_step[rank] = (int(step), now)
        self.done.discard(rank)
        return rank == self.primary

    def alive(self, rank: int, now: float) -> None:
        """``rank`` made progress without a step number (CUDA-graph replays): its step stays, its time moves."""
        step = self.last_step.get(rank, (0, now))[0]
        self.last_step[rank] = (step, now)

    def finished(self, rank: int) -> None:
        """``rank`` ended its training (``train_end``): it is silent on purpose from now on."""
        self.done.add(rank)

    def pause(self) -> None:
        """Stop watching (the guard itself is stopping the job)."""
        self.paused = True

    def silent_for_s(self, rank: int, now: float) -> float:
        """Seconds since ``rank``'s last step (0 for a rank never seen)."""
        return now - self.last_step[rank][1] if rank in self.last_step else 0.0

    def stalled_rank(self, now: float) -> int | None:
        """The rank silent for ``stall_timeout_s`` while another rank went on (the longest silent, then the lowest),
        or None."""
        watched = self._watched()
        if len(watched) < 2:
            return None
        silent = [r for r, when in watched.items() if now - when >= self.stall_timeout_s]
        going_on = [r for r, when in watched.items() if now - when < self.stall_timeout_s]
        if not silent or not going_on:
            return None
        return min(silent, key=lambda r: (self.last_step[r][1], r))

    def due_at(self) -> float:
        """When ``stalled_rank`` may next say a rank (monotonic seconds; ``inf`` with fewer than two ranks)."""
        watched = self._watched()
        return min(watched.values()) + self.stall_timeout_s if len(watched) >= 2 else math.inf

    def _watched(self) -> dict[int, float]:
        if self.paused:
            return {}
        return {rank: when for rank, (_, when) in self.last_step.items() if rank not in self.done}


def parse_launch(command: Sequence[str]) -> LaunchCommand | None:
    """``guard.preflight.launch.parse_launch``, imported (with all of ``guard.preflight``) only for a command that
    can be a launcher's: ``torchrun``, ``accelerate``, or one with ``-m``; None for any other, as it says."""
    argv = list(command)
    if not argv or (os.path.basename(argv[0]) not in ("torchrun", "accelerate") and "-m" not in argv):
        return None
    from guard.preflight.launch import parse_launch as parse

    return parse(argv)


def configured_node_rank(environ: Mapping[str, str], command: Sequence[str]) -> int | None:
    """This machine's node rank as the guard's environment (``NODE_RANK``, torchrun's ``GROUP_RANK``, Slurm's
    ``SLURM_NODEID``) or the launcher's command (``torchrun --node-rank N``, ``accelerate launch --machine_rank N``)
    says; None when neither does."""
    for name in ("NODE_RANK", "GROUP_RANK", "SLURM_NODEID"):
        value = environ.get(name, "")
        if value.isdigit():
            return int(value)
    launch = parse_launch(command)
    for option in ("--node-rank", "--node_rank", "--machine-rank", "--machine_rank"):
        value = launch.values.get(option, "") if launch is not None else ""
        if value.isdigit():
            return int(value)
    return None


def expected_primary(environ: Mapping[str, str], command: Sequence[str]) -> int | None:
    """The rank whose steps stand for the job's, known before any agent connects: with a launcher command
    (``torchrun``, ``accelerate launch``), this machine's first rank (``node_rank x procs per node``; rank 0 on node
    0); None for any other command (the lowest rank seen then stands)."""
    launch = parse_launch(command)
    if launch is None:
        return None
    node = configured_node_rank(environ, command) or 0
    procs = launch.procs_per_node
    if node == 0:
        return 0
    return node * procs if procs is not None else None
