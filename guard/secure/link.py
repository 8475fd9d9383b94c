"""What securing sees of the supervisor's loop (:class:`JobLink`) and of the allocation's end time
(:class:`EndTimeSource`): the protocols ``guard.secure.securing.Securing``'s hooks are given.

``guard.run.joblink.LoopLink`` offers ``JobLink`` and ``guard.run.slurm.SlurmRefresher`` ``EndTimeSource``; tests
offer fakes (``tests/fakes.py``).
"""

from __future__ import annotations

from typing import Protocol

from guard.core.state import Message, Outcome, RunState

__all__ = ["EndTimeSource", "JobLink"]


class EndTimeSource(Protocol):
    """Where a changed end time of the allocation comes from (``guard.run.slurm.SlurmRefresher``)."""

    last_source: str

    def maybe_refresh(self, now_s: float | None = None) -> float | None:
        """A new end time (epoch seconds) when a refresh that finished since says so, else None; never blocks."""


class JobLink(Protocol):
    """What securing needs from the supervisor's loop (``guard.run.joblink.LoopLink`` offers it; tests offer
    a fake).

    Attributes:
        state: the run's state: ``progress.step``, ``facts`` (the Trainer, the saves), ``outcome``.
        check_every: ``--check-every``: the agents report a step at least this often (in steps).
        node_rank: this machine's node rank, or None when not known (yet).
        follows_node_0: node 0's guard decides checkpoints for this machine (through the job's store).
    """

    state: RunState
    check_every: int

    @property
    def node_rank(self) -> int | None: ...

    @property
    def follows_node_0(self) -> bool: ...

    def job_running(self) -> bool:
        """The job's main process started and has not exited."""

    def job_alive(self) -> bool:
        """A process of the job's tree still runs."""

    def job_exit_code(self) -> int | None:
        """The job's exit code once it exited (negative: the signal), else None."""

    def job_stopped(self) -> bool:
        """The guard stopped the job (``stop`` to the agents, SIGTERM)."""

    def agents_connected(self) -> int:
        """How many agents are connected now."""

    def world_size(self) -> int:
        """The largest world size an agent reported (1 without one)."""

    def training_ranks(self) -> set[int]:
        """Ranks that reported training steps."""

    def newest_rank_step(self) -> int | None:
        """The highest step any rank reported, or None."""

    def rank_steps(self) -> dict[int, int]:
        """Each training rank's last reported step."""

    def broadcast(self, message: Message) -> int:
        """Send a command to every agent; returns how many got it."""

    def signal_job(self, signum: int) -> None:
        """Send ``signum`` to every process of the job."""

    def stop_job_at(self, at: float, grace_s: float | None) -> None:
        """Stop the job at ``at`` (monotonic seconds) with ``grace_s`` before SIGKILL, unless an earlier stop is
        set."""

    def decide(self, outcome: Outcome) -> None:
        """Record an outcome if none stands (the first one stands)."""

    def wake(self) -> None:
        """Run the timers (``tick``) on the loop's next turn."""
