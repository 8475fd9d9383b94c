"""The supervisor: starts the job with the agent inside and runs one event loop that moves events until it ends.

One thread, one ``select`` loop over: the job's stdout and stderr pipes (``guard.run.pipes``), the agent socket
(new connections and messages, ``guard.run.channel``), a self-pipe that signal handlers and the helper thread write
to (``guard.run.wakeup``: ``signal.set_wakeup_fd``; the handlers only append to a list), and timers. The loop
decides nothing itself: ``guard.run.dispatch.Dispatch`` hands the job's events to the policies and
``guard.run.executor.Executor`` carries out what they return.

- ``guard.run.watchdog.Watchdog``: steps, losses, the sanity pass, non-finite losses, stalls, dry run;
- ``guard.secure.securing.Securing``: the deadline, signals and the checkpoints to secure (through the
  :class:`~guard.secure.link.JobLink` the loop offers it: ``guard.run.joblink.LoopLink``);
- ``guard.observe.telemetry.Heartbeat``: the heartbeat line and the projection.

What they know lives in one ``guard.core.state.RunState``; the run ends in a ``RunResult`` built from it by
``guard.run.diagnose``; the job's failure is data, never an exception. The first decision (non-finite loss, stall,
dry run done, deadline, signal) fixes the outcome; the job's exit after the guard stopped it does not change it.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from guard.contract import RunResult, signal_name
from guard.core.masking import Masker
from guard.core.state import Outcome, RunState
from guard.run.config import Config
from guard.run.dispatch import Dispatch
from guard.run.executor import Executor
from guard.run.joblink import LoopLink
from guard.run.process import AFTER_VERDICT, Spawner
from guard.run.ranks import configured_node_rank, expected_primary
from guard.run.start import JobStart
from guard.run.timers import Escalation
from guard.run.upkeep import Upkeep
from guard.run.wakeup import JobSignal
from guard.run.watchdog import SettingsCheck, Watchdog

if TYPE_CHECKING:
    from guard.observe.telemetry import Heartbeat
    from guard.preflight._models import CheckResult
    from guard.secure.securing import Securing

__all__ = ["Outcome", "Supervisor"]

log = logging.getLogger("guard.supervisor")

WRITE_RETRY_S = 0.01  # while output waits for a paused reader: how often the loop tries again
MIN_TURN_S = 0.02  # the shortest wait between two turns of the timers when a policy says "now" again
AGENT_ROUNDS_AT_EXIT = 20  # at the job's exit: selects (timeout 0) to read what its agents sent before it
#: The VERDICT is out at least this long before the platform's kill (the deadline, or the end of --grace after a
#: signal): the wait for the job's processes after SIGKILL ends then at the latest (seconds; at most a tenth of
#: --grace).
VERDICT_BEFORE_END_S = 1.0
#: SIGKILL reaches a job still running at the latest this long before the platform's kill (seconds; at most a fifth
#: of --grace), so that the wait after it fits before the VERDICT.
KILL_BEFORE_END_S = 2.5


class Supervisor:
    """Runs one job under the guard.

    Args:
        config: the resolved options: ``command`` (the job's argv), ``environ``; the loop reads its part of the
            settings (``settings.watch``), the result its own (``guard.run.diagnose.job_result``).
        masker: the secret masker applied to everything written.
        clock: monotonic seconds (injected for tests).
        spawner: ``subprocess.Popen``-like (injected for tests).
        trainer_config_check: called with the Trainer arguments the agent reports; returns preflight rows; a
            ``fail`` row stops the job (``FAIL preflight``).
        securer: the securing flow, or None.
        env_extra: variables added to the job's environment.
        heartbeat: heartbeat lines, the projection, trackio; or None.
        out_fd, err_fd: file descriptors for the job's stdout and stderr (default 1 and 2), for the start the
            supervisor makes (a ``start`` given has its own).
        start: the job's start (``guard.run.start.JobStart``), begun already when the caller started the job
            before building the policies; None: the supervisor makes one from ``config`` and begins it in ``run``.

    Attributes:
        job_start: the job's start (``JobStart``: the selector, the agent channel, the signal handlers, the job).
        state: what the policies know (progress, the job's facts, the outcome).
        watchdog: the policy of steps, losses and stalls.
        link: what securing sees of the loop (``LoopLink``: the job, the agents, the stop timers).
        executor: carries out decisions (``Executor``). dispatch: the job's events to the policies (``Dispatch``).
        wakeup: the signal handlers and the self-pipe (``LoopSignals``); signals: its list of signals received and
            not handled yet (the handlers append, the loop pops).
    """

    def __init__(
        self,
        config: Config,
        *,
        masker: Masker,
        clock: Callable[[], float] = time.monotonic,
        spawner: Spawner | None = None,
        trainer_config_check: Callable[[Mapping[str, Any]], list[CheckResult]] | None = None,
        securer: Securing | None = None,
        env_extra: Mapping[str, str] | None = None,
        heartbeat: Heartbeat | None = None,
        out_fd: int = 1,
        err_fd: int = 2,
        start: JobStart | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.securer = securer
        self.heartbeat = heartbeat
        self.settings = watch = config.settings.watch  # the loop's part of the settings
        self.job_start = start or JobStart.of(config.command, {**config.environ, **(env_extra or {})}, watch,
                                              masker=masker, spawner=spawner, clock=clock, out_fd=out_fd,
                                              err_fd=err_fd)
        self.started = self.job_start.started_s if self.job_start.started_s is not None else clock()
        self.state = RunState()
        self.watchdog = Watchdog.from_settings(self.state, self.started, watch,
                                               expected_primary=expected_primary(config.environ, config.command))
        self.escalation = Escalation(watch.grace_s)
        self._sel = self.job_start.selector
        self.output = self.job_start.output  # passed through by the early relay from the job's start, then here
        self.channel = self.job_start.channel
        self.link = LoopLink(self.state, watch, channel=self.channel, watchdog=self.watchdog,
                             escalation=self.escalation, heartbeat=heartbeat,
                             configured_node_rank=_node_rank(config))
        self.executor = Executor(self.link, clock=clock, masker=masker, securer=securer)
        self.dispatch = Dispatch(self.link, self.executor, clock=clock, masker=masker,
                                 settings_check=SettingsCheck(trainer_config_check), read_agents=self._read_agents,
                                 securer=securer, heartbeat=heartbeat)
        self.upkeep = Upkeep(self.link, started=self.started, securer=securer, heartbeat=heartbeat)
        self.wakeup = self.job_start.wakeup
        self.signals = self.wakeup.signals  # the handlers append, the loop pops
        self.job_signals: list[JobSignal] = []  # termination signals a process of the job sent to the guard
        self._signalled_at: float | None = None  # the first termination signal from outside (loop clock)

    def run(self) -> RunResult:
        """Run the job to its end; returns how it ended. Never raises for a failure of the job.

        Raises:
            SupervisorError: the job could not be started (the command does not exist, ...).
        """
        try:
            self._start()
            self._loop()
            self.output.finish()
            self.dispatch.after_output(self.clock(), self.output.events)
            self.output.drain()
        finally:
            self._teardown()
        result = self._result()
        if self.heartbeat is not None:
            from guard.observe.telemetry import close_with_verdict

            deadline_s = self.securer.deadline.deadline_s if self.securer is not None else None
            close_with_verdict(self.heartbeat, result, deadline_s)
        return result

    def _start(self) -> None:
        self.link.job = self.job_start.begin()  # a no-op when the caller began it
        if self.securer is not None:
            assert self.job_start.started_wall_s is not None
            self.securer.before_start(started_wall_s=self.job_start.started_wall_s)
        if self.job_start.hand_over():  # what the job wrote meanwhile counts as if the loop had read it now
            now = self.clock()
            self.watchdog.on_output(now)
            self.dispatch.after_output(now, self.output.events)

    def _teardown(self) -> None:
        self.executor.thaw()
        # what the job left running is stopped after the VERDICT (a process in D state can take long to go)
        AFTER_VERDICT.call(lambda: self.link.kill_leftovers(self.clock))
        self.output.close()
        self.job_start.close()

    def _loop(self) -> None:
        job, link = self.link.job, self.link
        assert job is not None
        due = self.clock()
        while True:
            now = self.clock()
            timeout = max(0.0, min(due - now, 1.0))
            if self.output.pump():
                timeout = min(timeout, WRITE_RETRY_S)
            busy = False  # anything but job output happened: run the timers and decisions now
            for key, _ in self._sel.select(timeout):
                if key.data == "pipe":
                    busy |= self._read_pipe(key.fd)
                else:
                    busy = True
                    self._on_ready(key.fd, key.data)
            now = self.clock()
            while self.signals:
                if self._signalled_at is None:
                    self._signalled_at = now  # the platform's SIGKILL follows --grace after its first signal
                self.dispatch.on_signal(self.signals.pop(0), now)
            while self.wakeup.from_job:
                self._on_job_signal(self.wakeup.from_job.pop(0))
            if job.poll() is not None and self.upkeep.job_exited(now):
                # what the agents sent before the exit comes first (a short job may have ended, its output read to
                # the end by the early relay, before the loop's first turn accepted its agent)
                self._read_agents(rounds=AGENT_ROUNDS_AT_EXIT)
                self._on_job_exit(now)
                busy = True
            if self.upkeep.reap(now, self.wakeup.child_exited):
                self.wakeup.child_exited = False
            if busy or link.recheck or now >= due:
                link.recheck = False
                self._timers(now)
                due = self._next_due(now)
                if due <= now:  # a policy left a passed time due (the tests check that none does): wait a little,
                    due = now + MIN_TURN_S  # never turn at once again (a busy loop on one core)
                if self.upkeep.done(now, self.output.open):
                    return
            elif self.output.partial_since:  # an unfinished line is written when it is due, like any timer: the
                due = min(due, self.output.due_at())  # timers do not run at every read that ends mid-line

    def _on_ready(self, fd: int, kind: str) -> None:
        if kind == "listen":
            self.channel.accept()
        elif kind == "agent":
            for conn, message in self.channel.receive(fd):
                self.dispatch.on_message(fd, conn, message)
        elif kind == "wakeup":
            self.wakeup.drain()

    def _read_agents(self, rounds: int = 3) -> None:
        """New agents and their messages already waiting, read now: at most ``rounds`` selects, each with timeout 0
        (never blocks; the default: accept, then read the hello)."""
        for _ in range(rounds):
            ready = [key for key, _ in self._sel.select(0) if key.data in ("listen", "agent")]
            if not ready:
                break
            for key in ready:
                self._on_ready(key.fd, key.data)

    def _next_due(self, now: float) -> float:
        link = self.link
        due = [self.watchdog.due_at(), self.output.due_at(), self.upkeep.due_at(),
               link.stop_at if link.stop_at is not None else math.inf, self._kill_by()]
        if self.securer is not None:
            due.append(self.securer.due_at(now))
        return min(due)

    def end_at(self) -> float:
        """The platform's kill in loop clock seconds (``math.inf``: none known): the deadline, or ``--grace`` after the
        first termination signal from outside, whichever is sooner. The VERDICT is out before it."""
        ends = [math.inf]
        deadline_s = self.securer.deadline.deadline_s if self.securer is not None else None
        if deadline_s is not None and self.securer is not None:
            ends.append(self.clock() + (deadline_s - self.securer.wall()))
        if self._signalled_at is not None:
            ends.append(self._signalled_at + self.settings.grace_s)
        return min(ends)

    def word_by_wall(self) -> float | None:
        """When node 0's guard has said its word on this run at the latest, and this guard must have said its own
        (wall-clock seconds, ``time.time``; None: no kill known): the platform's kill here (``end_at``), or ``--grace``
        after another node's signal relayed here, whichever is sooner (that node's guard ends within its own grace,
        which began before the relay reached this node)."""
        end = self.end_at()
        if self.dispatch.relayed_at is not None:
            end = min(end, self.dispatch.relayed_at + self.settings.grace_s)
        return None if math.isinf(end) else time.time() + (end - self.clock())

    def _kill_by(self) -> float:
        """When a job still running gets SIGKILL at the latest (``math.inf``: not due, or sent)."""
        job = self.link.job
        if job is None or job.killed_at is not None or job.returncode is not None or self.link.escalation.killed:
            return math.inf
        return self.end_at() - self._leads()[0]

    def _leads(self) -> tuple[float, float]:
        """How long before the platform's kill a running job gets SIGKILL, and the VERDICT is due (seconds):
        ``KILL_BEFORE_END_S`` and ``VERDICT_BEFORE_END_S``, less with a short --grace (a fifth and a tenth of it), so
        that a 3 s grace still gives the job most of it."""
        grace_s = self.settings.grace_s
        return min(KILL_BEFORE_END_S, 0.2 * grace_s), min(VERDICT_BEFORE_END_S, 0.1 * grace_s)

    def _bound_by_end(self, now: float) -> None:
        """Keep the end of the run before the platform's kill (``end_at``): SIGKILL a job still running shortly before
        it, and stop waiting for processes that outlive SIGKILL shortly before that (``_leads``)."""
        job, link = self.link.job, self.link
        assert job is not None
        end = self.end_at()
        if math.isinf(end):
            return
        kill_lead_s, verdict_lead_s = self._leads()
        job.abandon_by = end - verdict_lead_s
        if now >= end - kill_lead_s and job.killed_at is None and job.alive():
            log.warning("the platform's kill is %.1fs away and the job still runs: SIGKILL now", end - now)
            link.escalation.start(now)
            link.escalation.killed = True
            job.signal_all(signal.SIGKILL)

    def _timers(self, now: float) -> None:
        job, link = self.link.job, self.link
        assert job is not None
        self._bound_by_end(now)
        self.output.flush_partials(now)
        self.upkeep.run(now)
        self.executor.carry_out(self.watchdog.tick(now, link.live_ranks()), now)
        if link.stop_at is not None and now >= link.stop_at:
            link.stop_at = None
            if job.alive():
                link.stop_job(now, link.stop_grace_s)
        if self.securer is not None:
            self.securer.tick(link, now)
        self.dispatch.observe(now)
        self.executor.release(now)
        self.upkeep.stop_stragglers(now)

    def _read_pipe(self, fd: int) -> bool:
        """Pass one read of the job's output through; True at the end of the stream."""
        now = self.clock()
        read = self.output.read(fd, now)
        if read == "data":
            self.watchdog.on_output(now)
        if read != "none":
            self.dispatch.after_output(now, self.output.events)  # at the end too: the last, unterminated line counts
        return read == "eof"

    def _on_job_exit(self, now: float) -> None:
        code = self.link.job_exit_code()
        log.info("job exited: %s", f"signal {signal_name(-code)}" if code is not None and code < 0 else code)
        if self.securer is not None:
            self.securer.on_job_exit(self.link, now)

    def _on_job_signal(self, sent: JobSignal) -> None:
        """A termination signal a process of the job sent to the guard (a launcher's cleanup that signals its
        parent): not a stop from outside, so no ``INTERRUPTED`` and nothing forwarded; the job's own end decides the
        VERDICT, and its hint names the sender."""
        self.job_signals.append(sent)
        log.warning("%s from pid %d (%s), a process of the job itself: not a stop from outside, the job's end decides "
                    "the VERDICT", signal_name(sent.signum), sent.pid, sent.name or "?")

    def _result(self) -> RunResult:
        from guard.run.diagnose import JobExit, job_result

        job = self.link.job
        assert job is not None
        ended = JobExit.of(job, cgroup_start=self.job_start.cgroup_start, elapsed_s=self.clock() - self.started,
                           node_rank=self.link.node_rank)
        result = job_result(self.state, ended, self.config.settings, securer=self.securer)
        if self.job_signals:
            sent = self.job_signals[0]
            result.details["signals_from_job"] = [{"signal": signal_name(s.signum), "pid": s.pid, "name": s.name}
                                                  for s in self.job_signals]
            if result.status != "PASS":
                said = (f"a process of the job (pid {sent.pid}, {sent.name or '?'}) sent {signal_name(sent.signum)} "
                        "to the guard, its parent (a launcher's cleanup: kill 0, kill $PPID), so the job's failure "
                        "is its own")
                result.hint = f"{said}; {result.hint}" if result.hint else said
        return result


def _node_rank(config: Config) -> int | None:
    """This node's rank as the settings have it (``guard.run.nodes``: the launcher, Slurm, Kubernetes,
    ``--node-rank``), else as the guard's environment says (``NODE_RANK``, ``GROUP_RANK``), else None."""
    node = config.settings.secure.node
    if node.node_rank_source != "default":
        return node.node_rank
    return configured_node_rank(config.environ, config.command)
