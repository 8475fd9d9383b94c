"""Starting the job: what the loop watches (its selector, the agent socket, the signal self-pipe) and the job's
process, before the loop's policies are built.

``stages.run_job`` starts the job as soon as its command and environment are known, and only then imports and
builds securing, the watchdog and telemetry: those imports (about 60 ms of the guard's CPU) run while the job's
interpreter starts on another core, instead of before it. Until the loop runs, the job's output is passed through
by ``guard.run.pipes.EarlyRelay`` on a thread of its own (its first line is not held back by the guard's
start-up), the agents' connections wait in the socket's backlog, and the signal handlers, installed before the job
starts, record a signal like any other.

This module imports only what starting needs (the channel, the process, the output pipes, the self-pipe), never the
policies.
"""

from __future__ import annotations

import logging
import selectors
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from guard.core.cgroup import CgroupMemory
from guard.core.masking import Masker
from guard.errors import SupervisorError
from guard.run.channel import AgentChannel, job_env
from guard.run.pipes import EarlyRelay, JobOutput
from guard.run.process import JobProcess, Spawner, cgroup_memory, set_subreaper
from guard.run.wakeup import LoopSignals

if TYPE_CHECKING:
    from guard.run.config import WatchSettings

__all__ = ["JobStart"]

log = logging.getLogger("guard.supervisor")


class JobStart:
    """The job's start: the loop's selector, the agent channel, the signal handlers, and the job's process.

    Built without side effects; ``begin()`` installs the handlers, opens the socket and starts the job (once).

    Args:
        command: the job's argv.
        environ: the job's environment before the agent's variables are added (``channel.job_env`` adds them).
        sanity_steps, check_every, grace_s: the agent's settings (``--sanity-steps``, ``--check-every``,
            ``--grace`` in seconds), passed in its environment.
        spawner: ``subprocess.Popen`` or a stand-in (tests inject faults here); default ``subprocess.Popen``.
        clock: monotonic seconds. wall: wall-clock seconds (``time.time``).
        masker: the secret masker of the job's output, which ``begin()`` passes through at once (``EarlyRelay``,
            to ``out_fd`` and ``err_fd``, default 1 and 2) until the loop takes it over (``hand_over``).

    Attributes:
        selector, channel, wakeup: what the loop watches (``wakeup``: ``LoopSignals``, its ``signals`` list).
        job: the job's process once ``begin()`` returned, else None.
        started_s: monotonic seconds just before the job was started (None before). started_wall_s: the same
            instant in wall-clock seconds: files written from then on are this run's.
        cgroup_start: the cgroup's memory figures just before the start (its ``oom_kill`` counter), or None.
        output: the job's output (``JobOutput``): the relay's until ``hand_over``, then the loop's.
    """

    def __init__(self, command: Sequence[str], environ: Mapping[str, str], *, sanity_steps: int, check_every: int,
                 grace_s: float, spawner: Spawner | None = None, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, masker: Masker, out_fd: int = 1, err_fd: int = 2) -> None:
        self.command = list(command)
        self.environ = dict(environ)
        self.sanity_steps, self.check_every, self.grace_s = sanity_steps, check_every, grace_s
        self.spawner: Spawner = spawner or subprocess.Popen
        self.clock, self.wall = clock, wall
        self.selector = selectors.DefaultSelector()
        self.channel = AgentChannel(self.selector)
        self.wakeup = LoopSignals()
        self.job: JobProcess | None = None
        self.started_s: float | None = None
        self.started_wall_s: float | None = None
        self.cgroup_start: CgroupMemory | None = None
        self.out_fd, self.err_fd = out_fd, err_fd
        self._relay_selector = selectors.DefaultSelector()  # the relay's, closed by it (or by close() if unused)
        self.output = JobOutput(self._relay_selector, masker, out_fd)
        self._relay: EarlyRelay | None = None
        self._relayed = False  # the relay was started (it owns its selector from then on)

    @classmethod
    def of(cls, command: Sequence[str], environ: Mapping[str, str], watch: WatchSettings, *,
           masker: Masker, spawner: Spawner | None = None, clock: Callable[[], float] = time.monotonic,
           out_fd: int = 1, err_fd: int = 2) -> JobStart:
        """The start of a job with the agent's settings taken from the loop's part of the settings (``watch``:
        ``sanity_steps``, ``check_every``, ``grace_s``)."""
        return cls(command, environ, sanity_steps=watch.sanity_steps, check_every=watch.check_every,
                   grace_s=watch.grace_s, spawner=spawner, clock=clock, masker=masker, out_fd=out_fd, err_fd=err_fd)

    def begin(self) -> JobProcess:
        """Install the loop's signal handlers, open the agent socket, start the job; returns it. A second call
        returns the same job.

        Raises:
            SupervisorError: the job could not be started (the command does not exist, is not executable, ...);
                the handlers and the socket are closed again.
        """
        if self.job is not None:
            return self.job
        self.wakeup.install()
        set_subreaper()
        sock_path = self.channel.open()
        self.selector.register(self.wakeup.read_fd, selectors.EVENT_READ, "wakeup")
        env = job_env(self.environ, sock_path, sanity_steps=self.sanity_steps, check_every=self.check_every,
                      grace_s=self.grace_s)
        job = JobProcess(self.command, env, spawner=self.spawner, clock=self.clock)
        self.cgroup_start = cgroup_memory()
        self.started_s, self.started_wall_s = self.clock(), self.wall()
        try:
            with self.wakeup.unmasked():  # the job gets the default signal mask, not the guard's
                job.start()
                self.wakeup.job_pid = job.pid
        except OSError as exc:
            self.close()
            raise SupervisorError(f"cannot start the job {self.command[0]!r}: {exc.strerror or exc}",
                                  hint="check the command and that it is executable and on PATH") from exc
        self.job = job
        self.output.add(job.stdout_fd, self.out_fd, label="stdout")
        self.output.add(job.stderr_fd, self.err_fd, label="stderr")
        self._relay = EarlyRelay(self.output, self._relay_selector, clock=self.clock).start()
        self._relayed = True
        log.info("job started: pid %d, command: %s", job.pid, " ".join(self.command))
        return job

    def hand_over(self) -> bool:
        """The loop takes the job's output over from the early relay: its pipes move to ``selector``. Returns
        whether the job wrote anything meanwhile (False once handed over already)."""
        relay, self._relay = self._relay, None
        return relay.hand_over(self.selector) if relay is not None else False

    def abort(self) -> None:
        """The loop will not run (the guard failed before it): SIGKILL the job's process group, reap it, close
        everything. Bounded: a process group that does not die is left to the subreaper's final reap."""
        job = self.job
        if job is not None and job.proc is not None and job.poll() is None:
            job.signal_all(signal.SIGKILL)
            try:
                job.proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                log.warning("the job (pid %d) did not exit within 2 s of SIGKILL", job.pid)
        self.close()

    def close(self) -> None:
        """Stop the early relay, close the agent socket, restore the signal handlers, close the selector."""
        relay, self._relay = self._relay, None
        if relay is not None:
            relay.stop()
        elif not self._relayed:
            self._relay_selector.close()  # the job never started
        self.channel.close()
        self.wakeup.close()
        self.selector.close()
