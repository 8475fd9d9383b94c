"""The supervisor: starts the job with the agent inside and runs one event loop until it ends.

One thread, one ``select`` loop over: the job's stdout and stderr pipes, the agent socket (new connections and
messages), a self-pipe that signal handlers write to (``signal.set_wakeup_fd``; the handlers only append to a
list), and timers (stall, partial-line flush, deadline, grace escalation, memory sampling). Pushes to the
destination run in worker processes (``guard.secure.worker``) that the loop polls and kills at their deadline.

The run ends in a ``verdict.RunResult``; the job's failure is data, never an exception. The first decision the
guard takes (non-finite loss, stall, dry run done, deadline, signal) fixes the outcome; the job's exit after
the guard stopped it does not change it.
"""

from __future__ import annotations

import logging
import math
import os
import selectors
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from guard import protocol
from guard.run.channel import AgentChannel, AgentConn
from guard.run.config import Config
from guard.run.masking import Masker
from guard.run.helpers import HELPERS, Wakeup
from guard.run.output import LINES, OutputEvents, StreamFilter
from guard.run.process import JobProcess, cgroup_memory, default_signals, set_subreaper
from guard.run.ranks import RankWatch
from guard.run.timers import Escalation, StallWatch
from guard.run.writer import OutputWriter
from guard.contract import (
    EXIT_NON_FINITE,
    EXIT_PREFLIGHT,
    EXIT_STALLED,
    RunResult,
    signal_name,
)

__all__ = ["Outcome", "Supervisor"]

log = logging.getLogger("guard.supervisor")

PARTIAL_FLUSH_S = 0.1  # an unfinished line is written after this long without a newline
DRAIN_AFTER_EXIT_S = 2.0  # after the job exits, how long its leftover processes may keep its pipes open
SAMPLE_EVERY_S = 2.0  # job tree memory sampling
REAP_EVERY_S = 2.0  # orphans are reaped on SIGCHLD (at most twice a second) and at least this often
READ_BYTES = 1 << 16
WRITE_RETRY_S = 0.01  # while output waits for a paused reader: how often the loop tries again
EXPLODE_FACTOR = 100.0  # a finite loss this many times its early level (the median of the first steps) exploded
EARLY_STEPS = 5  # steps whose median is the loss's early level
NAN_SETTLE_S = 2.0  # with several ranks, how long to wait for the others' reports before naming the first NaN


def _grow_pipe(fd: int, size_bytes: int = 1 << 20) -> None:
    """Ask Linux for a 1 MiB pipe buffer (``F_SETPIPE_SZ``, ``fcntl(2)``): fewer wake-ups for chatty jobs."""
    try:
        import fcntl

        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), size_bytes)
    except (OSError, ImportError):
        pass  # above /proc/sys/fs/pipe-max-size, or not Linux: the default 64 KiB works too


@dataclass
class Outcome:
    """What the guard decided (before the job's exit is known)."""

    status: str
    reason: str
    exit_code: int | None = None
    hint: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Supervisor:
    """Runs one job under the guard.

    Args:
        config: the resolved options (``config.command`` is the job's argv).
        masker: the secret masker applied to everything written.
        clock: monotonic seconds (injected for tests).
        spawner: ``subprocess.Popen``-like (injected for tests).
        trainer_config_check: called with the Trainer arguments the agent reports; returns preflight rows
            (objects with ``name``, ``status``, ``seen``, ``hint``); a ``fail`` row stops the job.
        securer: the securing flow (``guard.secure.securing.Securing``) or None.
        heartbeat: ``guard.observe.telemetry.Heartbeat`` (heartbeat lines, the projection, trackio) or None.
        out, err: file descriptors for the job's stdout and stderr (default 1 and 2).
    """

    def __init__(
        self,
        config: Config,
        *,
        masker: Masker,
        clock: Callable[[], float] = time.monotonic,
        spawner: Any = None,
        trainer_config_check: Callable[[Mapping[str, Any]], list[Any]] | None = None,
        securer: Any = None,
        env_extra: Mapping[str, str] | None = None,
        heartbeat: Any = None,
        out_fd: int = 1,
        err_fd: int = 2,
    ) -> None:
        self.config = config
        self.masker = masker
        self.clock = clock
        self.spawner = spawner
        self.trainer_config_check = trainer_config_check
        self.securer = securer
        self.env_extra = dict(env_extra or {})
        self.heartbeat = heartbeat  # guard.observe.telemetry.Heartbeat or None
        self.out_fd, self.err_fd = out_fd, err_fd
        self.started = clock()
        self.outcome: Outcome | None = None
        self.escalation = Escalation(config.grace_s)
        self.stall = StallWatch(config.stall_timeout_s, self.started)
        self.events = OutputEvents()
        self.filters: dict[int, StreamFilter] = {}
        self.targets: dict[int, int] = {}
        self.partial_since: dict[int, float] = {}
        self._sel = selectors.DefaultSelector()
        self.channel = AgentChannel(self._sel)
        self.agents = self.channel.conns  # fd -> AgentConn
        self.step: int | None = None
        self.loss: float | None = None
        self.sanity: list[float] = []
        self.sanity_done = False
        self.loss_source: str | None = None
        self.primary_agent: int | None = None
        self.ranks = RankWatch(config.stall_timeout_s)  # the primary rank, and every rank's last step time
        self.rank_progress: dict[int, tuple[int, float]] = self.ranks.last_step  # rank -> (last step, when)
        self.seen_node_rank: int | None = None
        self.agents_seen = 0  # agents that said hello (connections close when their process ends)
        self.rank_begun: dict[int, int] = {}  # rank -> steps begun, from the answers to a stack dump
        self.last_exception: str | None = None
        self.early_losses: list[float] = []  # the first EARLY_STEPS finite losses (the explosion check's level)
        self.exploded: dict[str, Any] | None = None  # step, loss, early: the loss exploded while staying finite
        self.nan_reports: list[tuple[int, int, float, int]] = []  # (step, rank or -1, loss, n), non-finite
        self.nan_decide_at: float | None = None
        self.root_exception: str | None = None  # the innermost error behind the last one (chain, DataLoader worker)
        self.train_error: dict[str, Any] | None = None  # Trainer.train() raised (the script may have swallowed it)
        self.train_end: dict[str, Any] | None = None  # Trainer.train() ended: step, max_steps, stopped
        self.agent_watching = False  # an agent hooked torch (or a Trainer): it sees the real losses
        self.hang_where: str | None = None  # where the main thread waits, when the job looked hung
        self.cuda_oom = False
        self.trainer_config: dict[str, Any] | None = None
        self._settings_logged: set[tuple[str, str]] = set()  # setting-check rows already logged
        self.trainer_push: dict[str, Any] | None = None
        self.checkpoints: list[dict[str, Any]] = []
        self.api_used: set[str] = set()  # the guard API calls the job's agents reported (``api`` messages)
        self.signals: list[int] = []
        self.job: JobProcess | None = None
        self.exited_at: float | None = None
        self.next_sample = self.started
        self.stop_at: float | None = None  # a scheduled SIGTERM (the job may end on its own before)
        self.stop_grace_s: float | None = None
        self._child_exited = False  # SIGCHLD seen: orphans may need reaping
        self._next_reap = self.started
        self._recheck = False  # a decision was taken outside the timers: re-run them at once
        self._closed_out = False
        self.writers: dict[int, OutputWriter] = {}  # target fd -> non-blocking writer (guard.run.writer)
        self._paused_pipes: list[int] = []  # a writer is full: these pipes of the job are not read (backpressure)
        self._wakeup_notify: Wakeup | None = None
        self._wakeup_r = self._wakeup_w = -1
        self._old_handlers: dict[int, Any] = {}
        self._old_wakeup = -1
        self.cgroup_start = cgroup_memory()

    # ------------------------------------------------------------------------------------------------------------
    # Set-up and tear-down
    # ------------------------------------------------------------------------------------------------------------

    def run(self) -> RunResult:
        """Run the job to its end; returns how it ended. Never raises for a failure of the job.

        Raises:
            SupervisorError: the job could not be started (the command does not exist, ...).
        """
        self._install_signals()
        try:
            self._start()
            self._loop()
            self._finish_output()
        finally:
            self._teardown()
        result = self._result()
        if self.heartbeat is not None:
            from guard.observe.telemetry import close_with_verdict

            deadline_s = self.securer.deadline.deadline_s if self.securer is not None else None
            close_with_verdict(self.heartbeat, result, deadline_s)
        return result

    def _install_signals(self) -> None:
        self._wakeup_r, self._wakeup_w = os.pipe()
        os.set_blocking(self._wakeup_r, False)
        os.set_blocking(self._wakeup_w, False)
        try:
            self._old_wakeup = signal.set_wakeup_fd(self._wakeup_w, warn_on_full_buffer=False)
        except ValueError:  # not the main thread: no signal handling (documented)
            self._old_wakeup = -2
            return
        for signum in (*default_signals(), signal.SIGCHLD):
            self._old_handlers[signum] = signal.signal(signum, self._on_signal)
        self._wakeup_notify = Wakeup(self._wakeup_w)  # a helper call finished: the loop turns at once
        HELPERS.notify = self._wakeup_notify

    def _on_signal(self, signum: int, frame: Any) -> None:  # only sets a flag; the loop acts
        if signum == signal.SIGCHLD:
            self._child_exited = True
        else:
            self.signals.append(signum)

    def _start(self) -> None:
        from guard.errors import SupervisorError

        set_subreaper()
        sock_path = self.channel.open()
        self._sel.register(self._wakeup_r, selectors.EVENT_READ, "wakeup")
        env = self._job_env(sock_path)
        self.job = JobProcess(self.config.command, env, **({"spawner": self.spawner} if self.spawner else {}))
        from guard.secure.worker import RUNNING

        self.job.exclude_pids = RUNNING  # securing workers are the guard's, not the job's
        if self.securer is not None and self.securer.output_dir and self.securer.latest_reported is None:
            found = None
            try:
                from guard.secure.checkpoints import newest_complete

                found = newest_complete(self.securer.output_dir, now_s=time.time())
            except OSError:
                pass
            if found is not None:
                self.securer.estimator.observe_size(found.size_bytes)
        try:
            self.job.start()
        except OSError as exc:
            raise SupervisorError(f"cannot start the job {self.config.command[0]!r}: {exc.strerror or exc}",
                                  hint="check the command and that it is executable and on PATH") from exc
        log.info("job started: pid %d, command: %s", self.job.pid, " ".join(self.config.command))
        parse_output = True
        for fd, target in ((self.job.stdout_fd, self.out_fd), (self.job.stderr_fd, self.err_fd)):
            _grow_pipe(fd)
            self.filters[fd] = StreamFilter(self.masker, parse_losses=parse_output, events=self.events)
            self.targets[fd] = target
            self._sel.register(fd, selectors.EVENT_READ, "pipe")

    def _job_env(self, sock_path: str) -> dict[str, str]:
        env = dict(self.config.environ)
        env.update(self.env_extra)
        site_dir = str(Path(__file__).resolve().parent.parent / "inside" / "_site")
        pkg_root = str(Path(__file__).resolve().parent.parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (site_dir, env.get("PYTHONPATH", "")) if p)
        env[protocol.ENV_SOCKET] = sock_path
        env[protocol.ENV_SANITY_STEPS] = str(self.config.sanity_steps)
        env[protocol.ENV_CHECK_EVERY] = str(self.config.check_every)
        env[protocol.ENV_PKG_ROOT] = pkg_root
        # Not PYTHONUNBUFFERED: the agent flushes a Python job's stdout every 0.1 s instead (see guard.inside.agent).
        # torchrun waits TORCH_ELASTIC_SHUTDOWN_TIMEOUT (default 30 s) between its SIGTERM and SIGKILL to the
        # workers (torch/distributed/run.py, --shutdown-timeout): fit it to --grace.
        env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(max(1, int(self.config.grace_s))))
        return env

    def _teardown(self) -> None:
        if self.job is not None and self.job.proc is not None:
            self._kill_leftovers()
        self.channel.close()
        if self._wakeup_notify is not None:
            self._wakeup_notify.close()
            if HELPERS.notify is self._wakeup_notify:
                HELPERS.notify = None
        for writer in self.writers.values():
            writer.close(timeout_s=0)  # what is left was written by _finish_output; this puts the flags back
        if self._old_wakeup != -2:
            signal.set_wakeup_fd(self._old_wakeup)
            for signum, handler in self._old_handlers.items():
                signal.signal(signum, handler)
        for fd in (self._wakeup_r, self._wakeup_w):
            if fd >= 0:
                os.close(fd)
        self._sel.close()

    def _kill_leftovers(self) -> None:
        """No process the guard started survives it: TERM, a bounded wait, then KILL; then reap what is left."""
        job = self.job
        assert job is not None
        job.poll()
        try:
            self._stop_leftovers(job)
        finally:
            job.reap_orphans(final=True)

    def _stop_leftovers(self, job: JobProcess) -> None:
        if not job.alive():
            return
        log.info("stopping what the job left running")
        job.signal_all(signal.SIGTERM)
        deadline = self.clock() + min(self.config.grace_s, 5.0)
        while self.clock() < deadline and job.alive():
            time.sleep(0.05)
            job.poll()
        if job.alive():
            job.signal_all(signal.SIGKILL)
            end = self.clock() + 5.0
            while self.clock() < end and job.alive():
                time.sleep(0.02)
                job.poll()

    # ------------------------------------------------------------------------------------------------------------
    # The loop
    # ------------------------------------------------------------------------------------------------------------

    def _loop(self) -> None:
        job = self.job
        assert job is not None
        due = self.clock()
        while True:
            now = self.clock()
            timeout = max(0.0, min(due - now, 1.0))
            if self._pump_writers():
                timeout = min(timeout, WRITE_RETRY_S)
            busy = False  # anything but job output happened: run the timers and decisions now
            for key, _ in self._sel.select(timeout):
                kind = key.data
                if kind == "pipe":
                    busy |= self._read_pipe(key.fd)
                else:
                    busy = True
                    if kind == "listen":
                        self.channel.accept()
                    elif kind == "agent":
                        self._read_agent(key.fd)
                    elif kind == "wakeup":
                        self._drain_wakeup()
            now = self.clock()
            if self.signals:
                self._handle_signals(now)
            if job.poll() is not None and self.exited_at is None:
                self.exited_at = now
                self._on_job_exit(now)
                busy = True
            if ((self._child_exited or job.zombies_pending) and now >= self._next_reap) \
                    or now >= self._next_reap + REAP_EVERY_S:
                self._child_exited = False
                self._next_reap = now + 0.5
                job.reap_orphans()
            if busy or self._recheck or now >= due or self.partial_since:
                self._recheck = False
                self._timers(now)
                due = self._next_due(now)
                if self._done(now):
                    return

    def _next_due(self, now: float) -> float:
        due = [self.stall.due_at(), self.ranks.due_at(), self.escalation.due_at(), self.next_sample,
               self.stop_at or math.inf, self.nan_decide_at or math.inf]
        if self.job is not None:
            due.append(self.job.abandon_at())
        due += [since + PARTIAL_FLUSH_S for since in self.partial_since.values()]
        if self.exited_at is not None:
            due.append(self.exited_at + DRAIN_AFTER_EXIT_S)
        if self.securer is not None:
            due.append(self.securer.due_at(now))
        if self.heartbeat is not None:
            due.append(self.heartbeat.due_at())
        return min(due)

    def _timers(self, now: float) -> None:
        for fd, since in list(self.partial_since.items()):
            if now - since >= PARTIAL_FLUSH_S:
                self._write(self.targets[fd], self.filters[fd].flush_partial())
                if self.filters[fd].pending:
                    self.partial_since[fd] = now
                else:
                    del self.partial_since[fd]
        if now >= self.next_sample and self.job is not None and self.job.returncode is None:
            self.job.sample()
            self.next_sample = now + SAMPLE_EVERY_S
        if self.heartbeat is not None and now >= self.heartbeat.due_at():
            from guard.observe.telemetry import Snapshot

            running = self.job is not None and self.job.returncode is None
            self.heartbeat.tick(now, Snapshot(
                tree_rss_bytes=(self.job.last_rss_bytes or None) if running and self.job else None,
                cgroup=cgroup_memory()))
        if self.outcome is None and self._non_finite_settled(now):
            self._decide_non_finite()
        stalled_rank = self.ranks.stalled_rank(now) if self.outcome is None and not self.stall.paused else None
        if stalled_rank is not None:
            silent = self.ranks.silent_for_s(stalled_rank, now)
            log.error("rank %d: no training step for %.0fs (--stall-timeout %.0fs) while the other ranks go on",
                      stalled_rank, silent, self.config.stall_timeout_s)
            self.broadcast({"t": "dump"})
            self._dump_stacks()
            self._decide(Outcome("FAIL", "stalled", EXIT_STALLED, extra={"rank": stalled_rank}, hint=(
                f"rank {stalled_rank} made no training step for {silent:.0f}s while the others went on: look at "
                "its stack above (stopped, I/O, a DataLoader worker); raise --stall-timeout if a step can take "
                "that long")), stop=False)
            self.stop_at = now + 1.0  # give the agents a moment to print their stacks
        if self.stall.expired(now) and self.outcome is None:
            silent = self.stall.silent_for_s(now)
            what = "no training step" if self.stall.first_step_seen else "no output and no training step"
            if self.train_end is not None:
                what = f"no progress since training ended at step {self.train_end.get('step')}"
            log.error("%s for %.0fs (--stall-timeout %.0fs): the job looks hung", what, silent,
                      self.config.stall_timeout_s)
            stuck = self.stuck_rank()
            extra = {"rank": stuck} if stuck is not None else {}
            if stuck is not None:
                log.error("rank %d reported the fewest steps (%d); asking every rank how far it got",
                          stuck, self.rank_progress[stuck][0])
            self.broadcast({"t": "dump"})
            self._dump_stacks()
            self._decide(Outcome("FAIL", "stalled", EXIT_STALLED, extra=extra, hint=(
                f"{what} for {silent:.0f}s: look at the stacks above for where it waits (a collective, a "
                "DataLoader worker, I/O); raise --stall-timeout if a step or the first output can take that long")),
                stop=False)
            self.stop_at = now + 1.0  # give the agents a moment to print their stacks
        if self.stop_at is not None and now >= self.stop_at:
            self.stop_at = None
            if self.job is not None and self.job.alive():
                self._stop_job(now, self.stop_grace_s)
        if self.securer is not None:
            self.securer.tick(self, now)
        if self.escalation.kill_due(now) and self.job is not None:
            log.warning("the job ignored SIGTERM for %.0fs (--grace): SIGKILL", self.escalation.grace_s)
            self.job.signal_all(signal.SIGKILL)
        if self.exited_at is not None and now >= self.exited_at + DRAIN_AFTER_EXIT_S and self.job is not None:
            if self.job.alive() and not self.escalation.started and not self._securing():
                log.info("the job exited but left processes holding its output open: stopping them")
                self._stop_job(now)

    def stuck_rank(self) -> int | None:
        """With several ranks: the one that fell behind (lowest step, then the oldest report); else None."""
        if len(self.rank_progress) < 2:
            return None
        steps = {rank: step for rank, (step, _) in self.rank_progress.items()}
        if len(set(steps.values())) == 1:
            return min(self.rank_progress, key=lambda r: self.rank_progress[r][1])
        return min(steps, key=lambda r: (steps[r], r))

    @property
    def follows_node_0(self) -> bool:
        """On a machine other than node 0 whose ranks share torch.distributed's store: node 0's guard decides
        checkpoints (its rank 0 relays them through the store, see ``guard.inside.agent._dist``); this guard only waits."""
        return self.node_rank not in (None, 0) and any(c.info.get("store") for c in self.agents.values())

    @property
    def job_answers_checkpoints(self) -> bool:
        """Whether the job can answer a checkpoint request: it runs a Trainer (the agent's callback saves on
        request) or its script called ``guard.should_checkpoint()``/``checkpoint_saved()``. False means asking it
        only wastes time: forward signals at once and secure what it saved itself."""
        return self.trainer_config is not None or bool(self.api_used & {"should_checkpoint", "checkpoint_saved"})

    def training_ranks(self) -> set[int]:
        """Ranks that reported training steps."""
        return set(self.rank_progress)

    @property
    def node_rank(self) -> int | None:
        """This machine's node rank: from the agents (torchrun's ``GROUP_RANK``), else the guard's environment
        (``NODE_RANK``, ``GROUP_RANK``, Slurm's ``SLURM_NODEID``); None on a single machine that does not say."""
        if self.seen_node_rank is not None:
            return self.seen_node_rank
        for name in ("NODE_RANK", "GROUP_RANK", "SLURM_NODEID"):
            value = self.config.environ.get(name, "")
            if value.isdigit():
                return int(value)
        from guard.preflight.launch import parse_launch

        launch = parse_launch(self.config.command)  # torchrun --node-rank N / accelerate launch --machine_rank N
        for option in ("--node-rank", "--node_rank", "--machine-rank", "--machine_rank"):
            value = launch.values.get(option, "") if launch is not None else ""
            if value.isdigit():
                return int(value)
        return None

    def _securing(self) -> bool:
        return self.securer is not None and self.securer.busy()

    def _done(self, now: float) -> bool:
        job = self.job
        assert job is not None
        if self._securing():
            return False
        if job.abandoned():  # SIGKILL plus a bounded wait: the verdict names the survivors (JobProcess)
            return True
        if job.returncode is None:
            return False
        pipes_open = bool(self._paused_pipes) or any(key.data == "pipe" for key in self._sel.get_map().values())
        if not pipes_open:
            return True
        # Leftover processes keep the pipes open: wait for the drain period, then for the escalation.
        if now < (self.exited_at or now) + DRAIN_AFTER_EXIT_S:
            return False
        return not job.alive() and now >= (self.exited_at or now) + DRAIN_AFTER_EXIT_S + 0.5

    # ------------------------------------------------------------------------------------------------------------
    # Output
    # ------------------------------------------------------------------------------------------------------------

    def _read_pipe(self, fd: int) -> bool:
        """Pass one read of the job's output through; True at the end of the stream."""
        try:
            data = os.read(fd, READ_BYTES)
        except BlockingIOError:
            return False
        except OSError:
            data = b""
        flt = self.filters[fd]
        now = self.clock()
        if not data:
            self._write(self.targets[fd], flt.close())
            self._sel.unregister(fd)
            self.partial_since.pop(fd, None)
            self._after_output(now)  # the last, unterminated line counts too
            return True
        self.stall.output(now)
        self._write(self.targets[fd], flt.feed(data))
        if flt.pending:
            self.partial_since.setdefault(fd, now)
        else:
            self.partial_since.pop(fd, None)
        self._after_output(now)
        return False

    def _after_output(self, now: float) -> None:
        events = self.events
        if events.losses:
            losses, events.losses[:] = list(events.losses), []
            if self._output_decides():
                for step, value in losses:
                    self._on_step(now, step, value, math.isfinite(value), 1, "output", None)
        if events.cuda_oom:
            self.cuda_oom = True
        if events.last_exception:
            self.last_exception = events.last_exception
        if events.root_exception:
            self.root_exception = events.root_exception

    def _output_decides(self) -> bool:
        """Losses parsed from the output count only while no agent sees the losses itself: once an agent has
        hooked torch (or a Trainer, or reported a step), a number the job prints (``best loss: inf`` before the
        first step) must not decide. Jobs with no agent (not Python) and Python jobs without torch (JAX, numpy)
        keep the output's losses. Agent messages not read yet are read first (the agent says so when torch is
        imported, before the script can print a loss)."""
        if self.loss_source == "agent" or self.agent_watching:
            return False
        for _ in range(3):  # accept, then read the hello; bounded, never blocks (timeout 0)
            events = [key for key, _ in self._sel.select(0) if key.data in ("listen", "agent")]
            if not events:
                break
            for key in events:
                if key.data == "listen":
                    self.channel.accept()
                else:
                    self._read_agent(key.fd)
        return not self.agent_watching and self.loss_source != "agent"

    def _write(self, fd: int, data: bytes) -> None:
        if not data or (fd == self.out_fd and self._closed_out):
            return
        LINES.wrote(fd, data)
        writer = self.writers.get(fd)
        if writer is None:
            writer = self.writers[fd] = OutputWriter(fd)
        writer.write(data)  # never blocks: a paused reader fills the writer's buffer (guard.run.writer)
        if writer.broken and fd == self.out_fd:
            self._closed_out = True

    def _pump_writers(self) -> bool:
        """Write what the guard's outputs take now; stop reading the job's pipes while a buffer is full, read
        them again once it drained. True while something is still buffered."""
        pending = False
        full = False
        for writer in self.writers.values():
            if not writer.pump():
                pending = True
            full |= writer.full
        if full and not self._paused_pipes:
            self._paused_pipes = [key.fd for key in self._sel.get_map().values() if key.data == "pipe"]
            for fd in self._paused_pipes:
                self._sel.unregister(fd)
        elif not full and self._paused_pipes:
            for fd in self._paused_pipes:
                self._sel.register(fd, selectors.EVENT_READ, "pipe")
            self._paused_pipes = []
        return pending

    def _finish_output(self) -> None:
        for fd, flt in self.filters.items():
            self._write(self.targets[fd], flt.close())
        self._after_output(self.clock())
        for writer in self.writers.values():
            writer.close()  # the run is over: wait for the reader (the VERDICT comes after this output)

    # ------------------------------------------------------------------------------------------------------------
    # Agent channel
    # ------------------------------------------------------------------------------------------------------------

    def _read_agent(self, fd: int) -> None:
        for conn, message in self.channel.receive(fd):
            self._on_message(fd, conn, message)

    def send(self, fd: int, message: dict[str, Any]) -> bool:
        """Send a command to one agent without blocking (see ``AgentChannel.send``)."""
        return self.channel.send(fd, message)

    def broadcast(self, message: dict[str, Any]) -> int:
        """Send a command to every connected agent; returns how many got it."""
        return self.channel.broadcast(message)

    def _on_message(self, fd: int, conn: AgentConn, message: dict[str, Any]) -> None:
        kind = message["t"]
        now = self.clock()
        if kind == "hello":
            conn.info = message
            self.agents_seen += 1
            if message.get("node_rank") is not None and self.seen_node_rank is None:
                self.seen_node_rank = int(message["node_rank"])
            log.debug("agent connected: pid %s rank %s", message.get("pid"), message.get("rank"))
        elif kind == "step":
            loss = message.get("loss")
            value = float(loss) if isinstance(loss, (int, float)) else math.nan
            self._on_step(now, message.get("step"), value, bool(message.get("finite", True)),
                          int(message.get("n", 1)), "agent", fd)
            if isinstance(message.get("skipped"), int):
                self._on_skipped(message["skipped"], message.get("step"), conn.info.get("rank"))
        elif kind == "trainer_config":
            self._on_trainer_config(fd, message.get("config") or {})
        elif kind == "training_args":  # built before the job's data work: check now, answer ack or stop
            self._check_settings(fd, message.get("config") or {})
        elif kind == "checkpoint_saved":
            message = {**message, "rank": conn.info.get("rank")}
            self.checkpoints.append(message)
            if self.heartbeat is not None and message.get("zero", True) and message.get("path"):
                self.heartbeat.on_save(str(message["path"]))
            if self.securer is not None:
                self.securer.on_checkpoint_saved(self, message)
        elif kind == "file_saved":
            if self.securer is not None and hasattr(self.securer, "on_file_saved"):
                self.securer.on_file_saved(self, {**message, "rank": conn.info.get("rank")})
        elif kind == "api":
            self.api_used.add(str(message.get("name")))
        elif kind == "exception":
            self.last_exception = f"{message.get('exc_type')}: {message.get('message')}"
            if message.get("root"):
                self.root_exception = str(message["root"])
            if "OutOfMemoryError" in str(message.get("exc_type")):
                self.cuda_oom = True
        elif kind == "push_result":
            self.trainer_push = message
            if not message.get("ok"):
                log.error("the Trainer's background push to the Hub failed: %s", message.get("error"))
        elif kind == "dist":
            conn.info.update(store=bool(message.get("store")), global_rank=message.get("global_rank"),
                             world_size=message.get("world_size"))
        elif kind == "progress":
            self._on_progress(conn, message)
        elif kind == "replay":  # CUDA-graph replays: steps without a loss, progress all the same
            self.stall.step(now)
            if conn.info.get("rank") is not None:
                self.ranks.alive(int(conn.info["rank"]), now)
        elif kind == "watching":
            self.agent_watching = True
        elif kind == "train_end":
            log.debug("training ended at step %s of %s", message.get("step"), message.get("max_steps"))
            if self.train_end is None or conn.info.get("rank") in (None, 0):
                self.train_end = message
            if conn.info.get("rank") is not None:
                self.ranks.finished(int(conn.info["rank"]))
        elif kind == "train_error":
            if self.train_error is None:
                self.train_error = message
                log.warning("Trainer.train() raised %s at step %s of %s", message.get("root") or
                            message.get("exc_type"), message.get("step"), message.get("max_steps"))

    def _on_progress(self, conn: AgentConn, message: dict[str, Any]) -> None:
        """A rank's answer to a stack dump: how many steps it has begun. Names the rank that holds up the rest."""
        rank = conn.info.get("rank")
        if message.get("where") and rank in (None, 0) and self.outcome is not None \
                and self.outcome.reason == "stalled" and self.hang_where is None:
            self._name_hang(str(message["where"]))
        if rank is None or not isinstance(message.get("begun"), int):
            return
        self.rank_begun[int(rank)] = message["begun"]
        if self.outcome is None or self.outcome.reason != "stalled" or len(self.rank_begun) < 2:
            return
        fewest = min(self.rank_begun.values())
        behind = [r for r, n in self.rank_begun.items() if n == fewest]
        if len(behind) == 1 and self.outcome.extra.get("rank") != behind[0]:
            self.outcome.extra["rank"] = behind[0]
            log.error("rank %d has begun fewer steps (%d) than the others: it is the one stuck; the others wait "
                      "for it in a collective", behind[0], fewest)

    def _name_hang(self, where: str) -> None:
        """The stalled verdict's hint names where the main thread waits (from the agent's stack answer); after
        ``Trainer.train()`` returned, the hang is not in training: say so."""
        assert self.outcome is not None
        self.hang_where = where
        if self.train_end is not None:
            log.error("training ended at step %s; since then the job waits in %s", self.train_end.get("step"), where)
            self.outcome.hint = (f"training ended at step {self.train_end.get('step')} (Trainer.train() returned), "
                                 f"then the job hung in {where}: that call never returned (a push, an upload, a "
                                 "collective or a thread join after training); see the stacks above")
        else:
            log.error("the job's main thread waits in %s", where)
            self.outcome.hint = f"the main thread waits in {where}; {self.outcome.hint}"

    def _on_trainer_config(self, fd: int, config: dict[str, Any]) -> None:
        if self.trainer_config is None:
            self.trainer_config = config
            log.info("Trainer: output_dir=%s save_strategy=%s push_to_hub=%s hub_model_id=%s max_steps=%s",
                     config.get("output_dir"), config.get("save_strategy"), config.get("push_to_hub"),
                     config.get("hub_model_id"), config.get("max_steps"))
            if self.securer is not None:
                self.securer.on_trainer_config(self, config)
            if self.heartbeat is not None:
                from guard.observe.telemetry import follow_trainer

                follow_trainer(self.heartbeat, config, self.masker)
        self._check_settings(fd, config)

    def _check_settings(self, fd: int, config: dict[str, Any]) -> None:
        """Run the Trainer-settings checks; a ``fail`` ends the job as ``preflight``, else the agent gets ``ack``."""
        rows = self.trainer_config_check(config) if self.trainer_config_check else []
        failed = next((row for row in rows if row.status == "fail"), None)
        for row in rows:
            if row.status in ("fail", "warn") and (row.status, row.seen) not in self._settings_logged:
                self._settings_logged.add((row.status, row.seen))
                log.log(logging.ERROR if row.status == "fail" else logging.WARNING, "preflight %s %s: %s%s",
                        row.name, row.status, row.seen, f" (hint: {row.hint})" if row.hint else "")
        if failed is not None and self.outcome is None:
            self._decide(Outcome("FAIL", "preflight", EXIT_PREFLIGHT, hint=failed.hint,
                                 extra={"check": failed.name}), stop=True)
            return
        self.send(fd, {"t": "ack"})

    # ------------------------------------------------------------------------------------------------------------
    # Steps, the sanity pass, the watch
    # ------------------------------------------------------------------------------------------------------------

    def _on_step(self, now: float, step: Any, value: float, finite: bool, n: int, source: str,
                 fd: int | None) -> None:
        if source == "agent" and self.loss_source != "agent":
            if self.loss_source == "output":
                log.info("losses now come from the agent inside the job (output parsing off)")
                self.sanity, self.sanity_done = [], False
            self.loss_source = "agent"
        elif self.loss_source is None:
            self.loss_source = source
            log.info("reading losses from the job's output (no agent step seen)")
        rank = self.agents[fd].info.get("rank") if fd is not None and fd in self.agents else None
        if not finite or not math.isfinite(value):
            if not math.isnan(value) and math.isfinite(value):
                value = math.nan  # never a finite loss on a non_finite_loss verdict
            self._non_finite(now, step, value, n, rank)
            return
        if rank is not None:  # step and loss come from the lowest rank; the others were checked for NaN above
            if not self.ranks.on_step(int(rank), int(step) if step is not None else None, now):
                return
        else:  # agents without a rank (several plain processes): the first one's
            if self.primary_agent is None and fd is not None:
                self.primary_agent = fd
            if fd is not None and fd != self.primary_agent:
                return
        self.step = int(step) if step is not None else (self.step or 0) + n
        self.loss = value
        self._check_explosion(value)
        self.stall.step(now)
        if self.securer is not None:
            self.securer.on_step(self, now)
        if self.heartbeat is not None:
            self.heartbeat.on_step(now, self.step, value)
        if not self.sanity_done:
            self.sanity.append(value)
            if len(self.sanity) >= self.config.sanity_steps:
                self._sanity_passed()

    def _check_explosion(self, value: float) -> None:
        """Name, once, a finite loss that exploded against its early level (in the spirit of Lightning's loss
        spike detection): ``EXPLODE_FACTOR`` times the median of the first ``EARLY_STEPS`` losses."""
        if len(self.early_losses) < EARLY_STEPS:
            self.early_losses.append(value)
            return
        if self.exploded is not None:
            return
        early = sorted(self.early_losses)[len(self.early_losses) // 2]
        if abs(value) > EXPLODE_FACTOR * max(abs(early), 1e-6):
            self.exploded = {"step": self.step, "loss": value, "early": early}
            log.warning("the loss exploded: %.6g at step %s, %.0fx its early level %.4g (the median of the first %d "
                        "steps): the run is diverging; lower the learning rate, add warmup or clip gradients",
                        value, self.step, abs(value) / max(abs(early), 1e-6), early, EARLY_STEPS)

    def _on_skipped(self, skipped: int, step: Any, rank: Any) -> None:
        """A GradScaler skipped ``skipped`` optimizer steps in a row (inf/NaN gradients): past
        ``--max-skipped-steps`` the fp16 loss scale is collapsing and nothing is learned."""
        limit = int(self.config.values.get("max_skipped_steps") or 0)
        if self.outcome is not None or not limit or skipped < limit:
            return
        log.error("the GradScaler skipped the last %d optimizer steps (inf/NaN gradients; --max-skipped-steps %d)%s",
                  skipped, limit, f" on rank {rank}" if rank is not None else "")
        if isinstance(step, int):
            self.step = step
        self.loss = None  # the loss itself is finite: no loss= on a non_finite_loss verdict
        extra = {"rank": rank} if rank is not None else {}
        self._decide(Outcome("FAIL", "non_finite_loss", EXIT_NON_FINITE, extra=extra, hint=(
            f"fp16 overflow: the loss scale kept collapsing and the last {skipped} optimizer steps were all skipped "
            "(gradients inf/NaN), so nothing was learned: prefer bf16 over fp16, lower the learning rate or add "
            "warmup, clip gradients, and look for a layer whose activations overflow fp16")))

    def _non_finite(self, now: float, step: Any, value: float, n: int, rank: int | None) -> None:
        """A non-finite loss. With several ranks, the first one to report is not always the one where it
        happened first (a NaN on rank 1 reaches rank 0 through the gradient all-reduce one step later, and rank 0's
        message may arrive first): wait until every rank has reported that far (at most ``NAN_SETTLE_S``), then
        name the earliest step and its rank."""
        if self.outcome is not None:
            return
        at = int(step) if step is not None else (self.step or 0) + n
        self.nan_reports.append((at, rank if rank is not None else -1, value, n))
        ranks = self._live_ranks()
        if len(ranks) < 2:
            self._decide_non_finite()
            return
        if self.nan_decide_at is None:
            self.nan_decide_at = now + NAN_SETTLE_S
        self._recheck = True

    def _live_ranks(self) -> set[int]:
        return {int(c.info["rank"]) for c in self.agents.values() if isinstance(c.info.get("rank"), int)}

    def _non_finite_settled(self, now: float) -> bool:
        if self.nan_decide_at is None:
            return False
        if now >= self.nan_decide_at:
            return True
        first = min(at for at, _, _, _ in self.nan_reports)
        bad = {r for _, r, _, _ in self.nan_reports}
        return all(r in bad or self.rank_progress.get(r, (-1, 0.0))[0] >= first for r in self._live_ranks())

    def _decide_non_finite(self) -> None:
        at, rank_or_none, value, n = min(self.nan_reports, key=lambda r: (r[0], r[1]))
        rank = None if rank_or_none < 0 else rank_or_none
        self.nan_decide_at = None
        self.step, self.loss = at, value
        where = f"step {at}" if n == 1 else f"steps {at - n + 1}..{at}"
        phase = "sanity pass" if not self.sanity_done else "training"
        log.error("non-finite loss %s at %s (%s)%s", value, where, phase, f" on rank {rank}" if rank is not None else "")
        extra = {"rank": rank} if rank is not None else {}
        batches = f"the batch of step {at}" if n == 1 else f"the batches of {where}"
        hint = ("lower the learning rate or add warmup, clip gradients (max_grad_norm), prefer bf16 over fp16, "
                f"and check {batches} for empty or corrupt inputs")
        self._decide(Outcome("FAIL", "non_finite_loss", EXIT_NON_FINITE, extra=extra, hint=hint))

    def _sanity_passed(self) -> None:
        self.sanity_done = True
        text = " ".join(f"{v:.4g}" for v in self.sanity)
        log.info("sanity pass: the first %d losses are finite: %s", len(self.sanity), text or "(0 steps asked)")
        if self.config.dry_run and self.outcome is None:
            log.info("--dry-run: stopping the job after the sanity pass")
            self._decide(Outcome("PASS", "dry_run", 0), stop=True)

    # ------------------------------------------------------------------------------------------------------------
    # Decisions, signals, exit
    # ------------------------------------------------------------------------------------------------------------

    def _decide(self, outcome: Outcome, *, stop: bool = True) -> None:
        if self.outcome is not None:
            return
        self._recheck = True
        self.outcome = outcome
        self.stall.pause()
        self.ranks.pause()
        if stop:
            self._stop_job(self.clock())
        if self.securer is not None:
            self.securer.on_decided(self, outcome)  # a failure secures what was saved before it

    def _stop_job(self, now: float, grace_s: float | None = None) -> None:
        """SIGTERM to the job's process group (and its escaped descendants); SIGKILL after the grace."""
        self._recheck = True
        if self.escalation.start(now, grace_s) and self.job is not None:
            self.broadcast({"t": "stop"})
            self.job.signal_all(signal.SIGTERM)

    def _drain_wakeup(self) -> None:
        try:
            while os.read(self._wakeup_r, 512):
                pass
        except (BlockingIOError, OSError):
            pass

    def _handle_signals(self, now: float) -> None:
        while self.signals:
            signum = self.signals.pop(0)
            name = signal_name(signum)
            if self.securer is not None and self.securer.on_signal(self, signum, now):
                continue
            if self.outcome is None:
                log.warning("%s received: forwarding it to the job; SIGKILL in %.0fs if it keeps running", name,
                            self.config.grace_s)
                self._decide(Outcome("INTERRUPTED", "signal", 128 + signum, extra={"signal": name},
                                     hint="the job was stopped by a signal sent to the guard; rerun it"), stop=False)
                if self.job is not None:
                    self.job.signal_all(signum)
                self.escalation.start(now)
            else:
                log.warning("%s received again: stopping the job now", name)
                if self.job is not None:
                    self.job.signal_all(signal.SIGKILL)

    def _on_job_exit(self, now: float) -> None:
        code = self.job.returncode if self.job else None
        log.info("job exited: %s", f"signal {signal_name(-code)}" if code is not None and code < 0 else code)
        if self.securer is not None:
            self.securer.on_job_exit(self, now)

    def _dump_stacks(self) -> None:
        """Log the Python stacks of the job's processes (py-spy when installed)."""
        if self.job is None:
            return
        from guard.observe.stacks import dump_stacks

        HELPERS.submit(dump_stacks, self.job, self.masker)  # py-spy (up to 8 x 5 s) on the helper thread

    # ------------------------------------------------------------------------------------------------------------
    # Result
    # ------------------------------------------------------------------------------------------------------------

    def _result(self) -> RunResult:
        from guard.run.diagnose import job_result

        return job_result(self)
