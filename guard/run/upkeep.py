"""The loop's own timed chores, and when the run is over.

``Upkeep`` samples the job tree's memory, ticks the heartbeat, reaps orphans and killed securing workers, sends the
escalation's SIGKILL, stops leftover processes that hold the job's output open after it exited, and says when the
loop may end. It never blocks: a sample reads ``/proc``, a reap is ``waitpid(WNOHANG)``, a kill is a signal.
"""

from __future__ import annotations

import logging
import math
import signal
from typing import TYPE_CHECKING

from guard.run.joblink import LoopLink
from guard.run.process import JobProcess, cgroup_memory
from guard.secure.worker import reap_killed

if TYPE_CHECKING:
    from guard.observe.telemetry import Heartbeat
    from guard.secure.securing import Securing

__all__ = ["DRAIN_AFTER_EXIT_S", "Upkeep"]

log = logging.getLogger("guard.supervisor")

DRAIN_AFTER_EXIT_S = 2.0  # after the job exits, how long its leftover processes may keep its pipes open
SAMPLE_EVERY_S = 2.0  # job tree memory sampling
#: The first sample, after the job started: not while the job's interpreter starts (psutil's import and its scan of
#: /proc took the CPU the job's start needed: time to the first line +0.02-0.1 s on 2 busy cores).
FIRST_SAMPLE_S = 0.5
REAP_EVERY_S = 2.0  # orphans are reaped on SIGCHLD (at most twice a second) and at least this often
REAP_GAP_S = 0.5  # the shortest time between two reaps
#: After the drain, how long the loop still waits for processes that outlived the job's exit before it ends.
DONE_AFTER_DRAIN_S = 0.5


class Upkeep:
    """The loop's timed chores on the job (``run``), their next time (``due_at``) and the end of the run (``done``).

    Args:
        link: the loop's job link (``link.job``: the job's process tree, set once started; the escalation).
        started: monotonic seconds when the run began.
        securer: the securing flow (the run does not end while it is busy), or None.
        heartbeat: the heartbeat, ticked when due, or None.

    Attributes:
        exited_at: monotonic seconds when the loop saw the job's exit, or None.
    """

    def __init__(self, link: LoopLink, *, started: float, securer: Securing | None = None,
                 heartbeat: Heartbeat | None = None) -> None:
        self.link = link
        self.securer = securer
        self.heartbeat = heartbeat
        self.exited_at: float | None = None
        self.next_sample = started + FIRST_SAMPLE_S
        self.next_reap = started
        self.last_run = -math.inf  # when ``run`` last ran: a chore timed at or before it is done

    @property
    def job(self) -> JobProcess:
        job = self.link.job
        assert job is not None, "the job is started before the loop runs"
        return job

    def job_exited(self, now: float) -> bool:
        """Record the job's exit when the loop first sees it (``now``: monotonic seconds); True that first time."""
        if self.exited_at is not None:
            return False
        self.exited_at = now
        return True

    def reap(self, now: float, child_exited: bool) -> bool:
        """Reap the job's orphans and the securing workers killed earlier (a kill never waits for the child to die)
        when a child exited (``child_exited``: SIGCHLD was seen) or pids wait, at most every 0.5 s, and at least
        every 2 s. Returns whether it reaped (the caller clears its SIGCHLD flag)."""
        job = self.job
        if not (((child_exited or job.zombies_pending) and now >= self.next_reap)
                or now >= self.next_reap + REAP_EVERY_S):
            return False
        self.next_reap = now + REAP_GAP_S
        job.reap_orphans()
        reap_killed()
        return True

    def due_at(self) -> float:
        """Monotonic seconds of the next chore (inf: none). Never a time already passed at the last ``run`` (the
        drain's end, the wait after it, giving up on SIGKILL's survivors): while securing keeps the loop going after
        the job exited, a passed time would make every turn of the loop due at once, a busy loop on one core."""
        own = [self.job.abandon_at()]
        if self.exited_at is not None:
            own += [self.exited_at + DRAIN_AFTER_EXIT_S, self.exited_at + DRAIN_AFTER_EXIT_S + DONE_AFTER_DRAIN_S]
        due = [self.next_sample, self.link.escalation.due_at(), *(t for t in own if t > self.last_run)]
        if self.heartbeat is not None:
            due.append(self.heartbeat.due_at())
        return min(due)

    def run(self, now: float) -> None:
        """The memory sample and the heartbeat when due (``now``: monotonic seconds)."""
        job = self.job
        self.last_run = now
        if now >= self.next_sample:  # no more samples once the job exited
            if job.returncode is None:
                job.sample()
            self.next_sample = now + SAMPLE_EVERY_S if job.returncode is None else math.inf
        if self.heartbeat is not None and now >= self.heartbeat.due_at():
            from guard.observe.telemetry import Snapshot

            running = job.returncode is None
            self.heartbeat.tick(now, Snapshot(tree_rss_bytes=(job.last_rss_bytes or None) if running else None,
                                              cgroup=cgroup_memory()))

    def stop_stragglers(self, now: float) -> None:
        """SIGKILL once the escalation's grace is over; stop processes that still hold the job's output open
        ``DRAIN_AFTER_EXIT_S`` after it exited (not while securing)."""
        job, link = self.job, self.link
        escalation = link.escalation
        if escalation.kill_due(now) and job.alive():  # a job that ended within its grace gets no SIGKILL, nor the line
            log.warning("the job did not end within %.0fs of SIGTERM (%s): SIGKILL", escalation.grace_s,
                        "--grace" if escalation.grace_s == link.settings.grace_s else "the time left")
            job.signal_all(signal.SIGKILL)
        drained = self.exited_at is not None and now >= self.exited_at + DRAIN_AFTER_EXIT_S
        if drained and job.alive() and not escalation.started and not self.securing():
            log.info("the job exited but left processes holding its output open: stopping them")
            link.stop_job(now)

    def securing(self) -> bool:
        """Securing is still under way (the run does not end)."""
        return self.securer is not None and self.securer.busy()

    def done(self, now: float, output_open: bool) -> bool:
        """The loop may end: securing is over and the job ended, its output closed or drained, or it was abandoned
        (SIGKILL and a bounded wait: the VERDICT names the survivors). ``output_open``: a pipe is still open."""
        job = self.job
        if self.securing():
            return False
        if job.abandoned():
            return True
        if job.returncode is None:
            return False
        if not output_open:
            return True
        # Leftover processes keep the pipes open: wait for the drain period, then for the escalation.
        exited_at = self.exited_at if self.exited_at is not None else now
        if now < exited_at + DRAIN_AFTER_EXIT_S:
            return False
        return not job.alive() and now >= exited_at + DRAIN_AFTER_EXIT_S + DONE_AFTER_DRAIN_S
