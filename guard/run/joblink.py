"""The loop's side of securing's ``JobLink``: the job's process, the agents' connections and the stop timers.

``guard.secure.securing.Securing`` sees the running job only through a ``JobLink`` protocol (is the job running,
how many agents, which ranks train, signal it, stop it at a time, record an outcome, wake the loop). ``LoopLink``
is the supervisor's implementation of it; the loop (``guard.run.supervisor``), the decision executor
(``guard.run.executor``) and the message dispatch (``guard.run.dispatch``) share one instance and read the same
state from it: the job's ``JobProcess``, the scheduled stop, and the ``recheck`` flag that makes the loop run its
timers at once.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from guard.core.state import Message, Outcome, RunState
from guard.run.channel import AgentChannel
from guard.run.config import WatchSettings
from guard.run.process import JobProcess
from guard.run.timers import Escalation
from guard.run.watchdog import Watchdog

if TYPE_CHECKING:
    from guard.observe.telemetry import Heartbeat

__all__ = ["LoopLink", "int_or_none"]

log = logging.getLogger("guard.supervisor")


def int_or_none(value: Any) -> int | None:
    """A step or rank from a message: an int (a JSON number, finite, not a bool), else None."""
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value) else None


class LoopLink:
    """What securing may ask of the loop (``guard.secure.link.JobLink``), and the job state the loop keeps.

    Args:
        state: the run's state (shared with the watchdog and securing).
        settings: the loop's part of the settings (``RunSettings.watch``: ``check_every``, ``grace_s``).
        channel: the agent socket (``channel.conns``: fd -> connection, the agents connected now).
        watchdog: the step policy (its training ranks and newest step); paused once an outcome is recorded.
        escalation: the SIGTERM -> SIGKILL timer (``stop_job`` starts it).
        heartbeat: told of the outcome once it is recorded, or None.
        configured_node_rank: this machine's node rank from the guard's environment and the launcher's command
            (``guard.run.ranks.configured_node_rank``), or None.

    Attributes:
        job: the job's process tree once started (``JobProcess``), else None.
        stop_at: monotonic seconds of a scheduled stop (``stop``, SIGTERM), or None; stop_grace_s: its grace in
            seconds (None: ``--grace``).
        recheck: a decision was taken outside the timers: the loop runs them on its next turn (and clears it).
    """

    def __init__(self, state: RunState, settings: WatchSettings, *, channel: AgentChannel, watchdog: Watchdog,
                 escalation: Escalation, heartbeat: Heartbeat | None = None,
                 configured_node_rank: int | None = None) -> None:
        self.state = state
        self.settings = settings
        self.check_every = settings.check_every
        self.channel = channel
        self.agents = channel.conns
        self.watchdog = watchdog
        self.escalation = escalation
        self.heartbeat = heartbeat
        self.configured_node_rank = configured_node_rank
        self.job: JobProcess | None = None
        self.stop_at: float | None = None
        self.stop_grace_s: float | None = None
        self.recheck = False

    # -- the job -----------------------------------------------------------------------------------------------

    def job_running(self) -> bool:
        """The job's main process started and has not exited."""
        return self.job is not None and self.job.returncode is None

    def job_alive(self) -> bool:
        """A process of the job's tree still runs."""
        return self.job is not None and self.job.alive()

    def job_exit_code(self) -> int | None:
        """The job's exit code once it exited (negative: the signal), else None."""
        return self.job.returncode if self.job is not None else None

    def job_stopped(self) -> bool:
        """The guard stopped the job (``stop`` to the agents, SIGTERM)."""
        return self.escalation.started

    def signal_job(self, signum: int) -> None:
        """Send ``signum`` to every process of the job (nothing before it started)."""
        if self.job is not None:
            self.job.signal_all(signum)

    def stop_job(self, now: float, grace_s: float | None = None) -> None:
        """``stop`` to the agents, SIGTERM to the job's process group (and its escaped descendants) now; SIGKILL
        after ``grace_s`` seconds (None: ``--grace``). A stop already under way is not restarted."""
        self.recheck = True
        if self.escalation.start(now, grace_s) and self.job is not None:
            self.broadcast({"t": "stop"})
            self.job.signal_all(signal.SIGTERM)

    def stop_job_at(self, at: float, grace_s: float | None) -> None:
        """Stop the job (``stop``, SIGTERM, SIGKILL after ``grace_s``) at ``at`` (monotonic seconds) unless an
        earlier stop is set."""
        if self.job_alive() and (self.stop_at is None or at < self.stop_at):
            self.stop_at, self.stop_grace_s = at, grace_s
            self.recheck = True

    def kill_leftovers(self, clock: Callable[[], float]) -> None:
        """No process the guard started survives it: TERM, a bounded wait (``--grace``, at most 5 s), then KILL
        and at most 5 s more; then reap what is left. ``clock``: monotonic seconds. Blocks (the loop is over)."""
        job = self.job
        if job is None or job.proc is None:
            return
        job.poll()
        try:
            if job.alive():
                log.info("stopping what the job left running")
                job.signal_all(signal.SIGTERM)
                _wait_gone(job, clock, min(self.settings.grace_s, 5.0), 0.05)
            if job.alive():
                job.signal_all(signal.SIGKILL)
                _wait_gone(job, clock, 5.0, 0.02)
        finally:
            job.reap_orphans(final=True)

    # -- the agents --------------------------------------------------------------------------------------------

    def send(self, fd: int, message: Message) -> bool:
        """Send a command to one agent without blocking (see ``AgentChannel.send``); False if it was not sent."""
        return self.channel.send(fd, message)

    def broadcast(self, message: Message) -> int:
        """Send a command to every connected agent; returns how many got it."""
        return self.channel.broadcast(message)

    def agents_connected(self) -> int:
        """How many agents are connected now."""
        return len(self.agents)

    def world_size(self) -> int:
        """The largest world size an agent reported (1 without one)."""
        return max((int_or_none(c.info.get("world_size")) or 1 for c in self.agents.values()), default=1)

    def live_ranks(self) -> frozenset[int]:
        """The ranks of the agents connected now."""
        return frozenset(int(c.info["rank"]) for c in self.agents.values() if isinstance(c.info.get("rank"), int))

    def training_ranks(self) -> set[int]:
        """Ranks that reported training steps."""
        return self.watchdog.training_ranks()

    def newest_rank_step(self) -> int | None:
        """The highest step any rank reported, or None."""
        return self.watchdog.newest_rank_step()

    def rank_steps(self) -> dict[int, int]:
        """Each training rank's last reported step."""
        return self.watchdog.rank_steps()

    @property
    def node_rank(self) -> int | None:
        """This machine's node rank: from the agents (torchrun's ``GROUP_RANK``), else the configured one (the
        guard's environment and the launcher's command); None on a single machine that does not say."""
        if self.state.facts.node_rank is not None:
            return self.state.facts.node_rank
        return self.configured_node_rank

    @property
    def follows_node_0(self) -> bool:
        """On a machine other than node 0 whose ranks share torch.distributed's store: node 0's guard decides
        checkpoints (its rank 0 relays them through the store, see ``guard.inside.agent._dist``); this guard only
        waits."""
        return self.node_rank not in (None, 0) and any(c.info.get("store") for c in self.agents.values())

    # -- the outcome -------------------------------------------------------------------------------------------

    def record(self, outcome: Outcome) -> bool:
        """Record ``outcome`` as the run's unless one stands (the first one stands): the watches pause, the
        heartbeat is told, the loop runs its timers at once. Returns whether it was recorded."""
        if self.state.outcome is not None:
            return False
        self.recheck = True
        self.state.outcome = outcome
        self.watchdog.pause()
        if self.heartbeat is not None:
            self.heartbeat.on_outcome(outcome, self.state.progress, self.world_size())
        return True

    def decide(self, outcome: Outcome) -> None:
        """Record securing's outcome (a deadline, a signal) if none stands; securing itself stops the job."""
        self.record(outcome)

    def wake(self) -> None:
        """Run the timers on the loop's next turn."""
        self.recheck = True


def _wait_gone(job: JobProcess, clock: Callable[[], float], limit_s: float, every_s: float) -> None:
    end = clock() + limit_s
    while clock() < end and job.alive():
        time.sleep(every_s)
        job.poll()
