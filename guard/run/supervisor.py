"""The supervisor: starts the job with the agent inside and runs one event loop that moves events until it ends.

One thread, one ``select`` loop over: the job's stdout and stderr pipes (``guard.run.pipes``), the agent socket
(new connections and messages, ``guard.run.channel``), a self-pipe that signal handlers and the helper thread write
to (``signal.set_wakeup_fd``; the handlers only append to a list), and timers. The loop decides nothing itself:
it feeds the events to the policies and carries out what they return.

- ``guard.run.watchdog.Watchdog``: steps, losses, the sanity pass, non-finite losses, stalls, dry run;
- ``guard.secure.securing.Securing``: the deadline, signals and the checkpoints to secure (through the
  :class:`~guard.secure.securing.JobLink` this loop offers it);
- ``guard.observe.telemetry.Heartbeat``: the heartbeat line and the projection.

What they know lives in one ``guard.core.state.RunState``; the run ends in a ``RunResult`` built from it by
``guard.run.diagnose``; the job's failure is data, never an exception. The first decision (non-finite loss, stall,
dry run done, deadline, signal) fixes the outcome; the job's exit after the guard stopped it does not change it.
"""

from __future__ import annotations

import logging
import math
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from guard import protocol
from guard.contract import RunResult, signal_name
from guard.core.helpers import HELPERS, Wakeup
from guard.core.masking import Masker
from guard.core.state import Message, Outcome, RunState
from guard.run.channel import AgentChannel, AgentConn
from guard.run.config import Config
from guard.run.pipes import JobOutput
from guard.run.process import JobProcess, Spawner, cgroup_memory, default_signals, set_subreaper
from guard.run.ranks import configured_node_rank
from guard.run.timers import Escalation
from guard.run.watchdog import Decision, SettingsCheck, Watchdog
from guard.secure.worker import reap_killed

if TYPE_CHECKING:
    from guard.observe.telemetry import Heartbeat
    from guard.preflight._models import CheckResult
    from guard.secure.securing import Securing

__all__ = ["Outcome", "Supervisor"]

log = logging.getLogger("guard.supervisor")

DRAIN_AFTER_EXIT_S = 2.0  # after the job exits, how long its leftover processes may keep its pipes open
SAMPLE_EVERY_S = 2.0  # job tree memory sampling
REAP_EVERY_S = 2.0  # orphans are reaped on SIGCHLD (at most twice a second) and at least this often
WRITE_RETRY_S = 0.01  # while output waits for a paused reader: how often the loop tries again


def expected_primary(environ: Mapping[str, str], command: Sequence[str]) -> int | None:
    """The rank whose steps stand for the job's, known before any agent connects: with a launcher command
    (``torchrun``, ``accelerate launch``), this machine's first rank (``node_rank x procs per node``; rank 0 on node
    0); None for any other command (the lowest rank seen then stands)."""
    from guard.preflight.launch import parse_launch

    launch = parse_launch(command)
    if launch is None:
        return None
    node = configured_node_rank(environ, command) or 0
    procs = launch.procs_per_node
    if node == 0:
        return 0
    return node * procs if procs is not None else None


def _int_or_none(value: Any) -> int | None:
    """A step or rank from a message: an int (a JSON number), else None."""
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value) else None


class Supervisor:
    """Runs one job under the guard.

    Args:
        config: the resolved options (``config.command`` is the job's argv).
        masker: the secret masker applied to everything written.
        clock: monotonic seconds (injected for tests).
        spawner: ``subprocess.Popen``-like (injected for tests).
        trainer_config_check: called with the Trainer arguments the agent reports; returns preflight rows; a
            ``fail`` row stops the job (``FAIL preflight``).
        securer: the securing flow, or None.
        env_extra: variables added to the job's environment.
        heartbeat: heartbeat lines, the projection, trackio; or None.
        out_fd, err_fd: file descriptors for the job's stdout and stderr (default 1 and 2).

    Attributes:
        state: what the policies know (progress, the job's facts, the outcome).
        watchdog: the policy of steps, losses and stalls.
        job: the job's process tree once started.
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
    ) -> None:
        self.config = config
        self.masker = masker
        self.clock = clock
        self.spawner = spawner
        self.securer = securer
        self.env_extra = dict(env_extra or {})
        self.heartbeat = heartbeat
        self.out_fd, self.err_fd = out_fd, err_fd
        self.started = clock()
        self.state = RunState()
        self.settings = watch = config.settings.watch  # the loop's part of the settings
        self.watchdog = Watchdog(self.state, self.started, sanity_steps=watch.sanity_steps,
                                 stall_timeout_s=watch.stall_timeout_s, dry_run=watch.dry_run,
                                 max_skipped_steps=watch.max_skipped_steps,
                                 loss_rise_factor=watch.loss_rise_factor, loss_rise_steps=watch.loss_rise_steps,
                                 expected_primary=expected_primary(config.environ, config.command))
        self.settings_check = SettingsCheck(trainer_config_check)
        self.check_every = watch.check_every
        self.escalation = Escalation(watch.grace_s)
        self._sel = selectors.DefaultSelector()
        self.output = JobOutput(self._sel, masker, out_fd)
        self.channel = AgentChannel(self._sel)
        self.agents = self.channel.conns  # fd -> AgentConn
        self.signals: list[int] = []
        self.job: JobProcess | None = None
        self.exited_at: float | None = None
        self.next_sample = self.started
        self.stop_at: float | None = None  # a scheduled SIGTERM (the job may end on its own before)
        self.frozen = False  # SIGSTOPped while a failure's checkpoint is secured; SIGCONT + stop when that is over
        self.stop_grace_s: float | None = None
        self._child_exited = False  # SIGCHLD seen: orphans may need reaping
        self._next_reap = self.started
        self._recheck = False  # a decision was taken outside the timers: re-run them at once
        self._wakeup_notify: Wakeup | None = None
        self._wakeup_r = self._wakeup_w = -1
        self._old_handlers: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}
        self._old_wakeup = -1
        self.cgroup_start = cgroup_memory()

    @property
    def outcome(self) -> Outcome | None:
        """The guard's decision (``state.outcome``)."""
        return self.state.outcome

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
            self.output.finish()
            self._after_output(self.clock())
            self.output.drain()
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

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:  # only sets a flag; the loop acts
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
        self.job = JobProcess(self.config.command, env, spawner=self.spawner or subprocess.Popen)
        if self.securer is not None:
            self.securer.before_start()
        try:
            self.job.start()
        except OSError as exc:
            raise SupervisorError(f"cannot start the job {self.config.command[0]!r}: {exc.strerror or exc}",
                                  hint="check the command and that it is executable and on PATH") from exc
        log.info("job started: pid %d, command: %s", self.job.pid, " ".join(self.config.command))
        self.output.add(self.job.stdout_fd, self.out_fd, label="stdout")
        self.output.add(self.job.stderr_fd, self.err_fd, label="stderr")

    def _job_env(self, sock_path: str) -> dict[str, str]:
        env = dict(self.config.environ)
        env.update(self.env_extra)
        site_dir = str(Path(__file__).resolve().parent.parent / "inside" / "_site")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (site_dir, env.get("PYTHONPATH", "")) if p)
        env[protocol.ENV_SOCKET] = sock_path
        env[protocol.ENV_SANITY_STEPS] = str(self.settings.sanity_steps)
        env[protocol.ENV_CHECK_EVERY] = str(self.check_every)
        # Not PYTHONUNBUFFERED: the agent flushes a Python job's stdout every 0.1 s instead (see guard.inside.agent).
        # torchrun waits TORCH_ELASTIC_SHUTDOWN_TIMEOUT (default 30 s) between its SIGTERM and SIGKILL to the
        # workers (torch/distributed/run.py, --shutdown-timeout): fit it to --grace.
        env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(max(1, int(self.settings.grace_s))))
        return env

    def _teardown(self) -> None:
        if self.frozen and self.job is not None:
            self.job.signal_all(signal.SIGCONT)
        if self.job is not None and self.job.proc is not None:
            self._kill_leftovers(self.job)
        self.channel.close()
        if self._wakeup_notify is not None:
            self._wakeup_notify.close()
            if HELPERS.notify is self._wakeup_notify:
                HELPERS.notify = None
        self.output.close()
        if self._old_wakeup != -2:
            signal.set_wakeup_fd(self._old_wakeup)
            for signum, handler in self._old_handlers.items():
                signal.signal(signum, handler)
        for fd in (self._wakeup_r, self._wakeup_w):
            if fd >= 0:
                os.close(fd)
        self._sel.close()

    def _kill_leftovers(self, job: JobProcess) -> None:
        """No process the guard started survives it: TERM, a bounded wait, then KILL; then reap what is left."""
        job.poll()
        try:
            if job.alive():
                log.info("stopping what the job left running")
                job.signal_all(signal.SIGTERM)
                self._wait_gone(job, min(self.settings.grace_s, 5.0), 0.05)
            if job.alive():
                job.signal_all(signal.SIGKILL)
                self._wait_gone(job, 5.0, 0.02)
        finally:
            job.reap_orphans(final=True)

    def _wait_gone(self, job: JobProcess, limit_s: float, every_s: float) -> None:
        end = self.clock() + limit_s
        while self.clock() < end and job.alive():
            time.sleep(every_s)
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
                reap_killed()  # securing workers killed earlier (a kill never waits for the child to die)
            if busy or self._recheck or now >= due or self.output.partial_since:
                self._recheck = False
                self._timers(now)
                due = self._next_due(now)
                if self._done(now):
                    return

    def _on_ready(self, fd: int, kind: str) -> None:
        if kind == "listen":
            self.channel.accept()
        elif kind == "agent":
            for conn, message in self.channel.receive(fd):
                self._on_message(fd, conn, message)
        elif kind == "wakeup":
            try:
                while os.read(self._wakeup_r, 512):
                    pass
            except OSError:  # BlockingIOError included: drained
                pass

    def _next_due(self, now: float) -> float:
        due = [self.watchdog.due_at(), self.escalation.due_at(), self.next_sample, self.output.due_at(),
               self.stop_at if self.stop_at is not None else math.inf]
        if self.job is not None:
            due.append(self.job.abandon_at())
        if self.exited_at is not None:
            due.append(self.exited_at + DRAIN_AFTER_EXIT_S)
        if self.securer is not None:
            due.append(self.securer.due_at(now))
        if self.heartbeat is not None:
            due.append(self.heartbeat.due_at())
        return min(due)

    def _timers(self, now: float) -> None:
        job = self.job
        assert job is not None
        self.output.flush_partials(now)
        if now >= self.next_sample and job.returncode is None:
            job.sample()
            self.next_sample = now + SAMPLE_EVERY_S
        if self.heartbeat is not None and now >= self.heartbeat.due_at():
            from guard.observe.telemetry import Snapshot

            running = job.returncode is None
            self.heartbeat.tick(now, Snapshot(tree_rss_bytes=(job.last_rss_bytes or None) if running else None,
                                              cgroup=cgroup_memory()))
        self._carry_out(self.watchdog.tick(now, self._live_ranks()), now)
        if self.stop_at is not None and now >= self.stop_at:
            self.stop_at = None
            if job.alive():
                self._stop_job(now, self.stop_grace_s)
        if self.securer is not None:
            self.securer.tick(self, now)
        self._observe(now)
        if self.frozen and not self._securing():
            self.frozen = False
            if self.job is not None:
                self.job.signal_all(signal.SIGCONT)
            if job.alive():
                self._stop_job(now)
        if self.escalation.kill_due(now):
            log.warning("the job did not end within %.0fs of SIGTERM (%s): SIGKILL", self.escalation.grace_s,
                        "--grace" if self.escalation.grace_s == self.settings.grace_s else "the time left")
            job.signal_all(signal.SIGKILL)
        drained = self.exited_at is not None and now >= self.exited_at + DRAIN_AFTER_EXIT_S
        if drained and job.alive() and not self.escalation.started and not self._securing():
            log.info("the job exited but left processes holding its output open: stopping them")
            self._stop_job(now)

    def _observe(self, now: float) -> None:
        """Alerts (``guard.observe.alerts``): the watchdog's warnings and the securing plan, read, never waited on."""
        if self.heartbeat is not None:
            self.heartbeat.observe(now, self.state.progress, self.securer.plan if self.securer is not None else None)

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
        if not self.output.open:
            return True
        # Leftover processes keep the pipes open: wait for the drain period, then for the escalation.
        exited_at = self.exited_at if self.exited_at is not None else now
        if now < exited_at + DRAIN_AFTER_EXIT_S:
            return False
        return not job.alive() and now >= exited_at + DRAIN_AFTER_EXIT_S + 0.5

    # ------------------------------------------------------------------------------------------------------------
    # Output
    # ------------------------------------------------------------------------------------------------------------

    def _read_pipe(self, fd: int) -> bool:
        """Pass one read of the job's output through; True at the end of the stream."""
        now = self.clock()
        read = self.output.read(fd, now)
        if read == "data":
            self.watchdog.on_output(now)
        if read != "none":
            self._after_output(now)  # at the end too: the last, unterminated line counts
        return read == "eof"

    def _after_output(self, now: float) -> None:
        events, facts = self.output.events, self.state.facts
        if events.losses:
            losses, events.losses[:] = list(events.losses), []
            if self._output_decides():
                for step, value in losses:
                    self._on_step(now, step, value, finite=math.isfinite(value), source="output")
        facts.cuda_oom |= events.cuda_oom
        facts.last_exception = events.last_exception or facts.last_exception
        facts.root_exception = events.root_exception or facts.root_exception
        if events.job_verdicts:
            facts.job_verdict = events.job_verdicts[-1]
        facts.last_stderr_line = events.last_lines.get("stderr", facts.last_stderr_line)
        for rank, text in events.rank_exceptions.items():
            facts.rank_exceptions.setdefault(rank, text)
        for pid, how in events.worker_deaths.items():
            if facts.worker_deaths.get(pid) is None:
                facts.worker_deaths[pid] = how

    def _output_decides(self) -> bool:
        """Losses parsed from the output count only while no agent sees the losses itself: once an agent has
        hooked torch (or a Trainer, or reported a step), a number the job prints (``best loss: inf`` before the
        first step) must not decide. Jobs with no agent (not Python) and Python jobs without torch (JAX, numpy)
        keep the output's losses. Agent messages not read yet are read first (the agent says so when torch is
        imported, before the script can print a loss)."""
        def agent_sees() -> bool:
            return self.state.progress.loss_source == "agent" or self.state.facts.agent_watching

        if agent_sees():
            return False
        for _ in range(3):  # accept, then read the hello; bounded, never blocks (timeout 0)
            ready = [key for key, _ in self._sel.select(0) if key.data in ("listen", "agent")]
            if not ready:
                break
            for key in ready:
                self._on_ready(key.fd, key.data)
        return not agent_sees()

    # ------------------------------------------------------------------------------------------------------------
    # Agent messages
    # ------------------------------------------------------------------------------------------------------------

    def send(self, fd: int, message: Message) -> bool:
        """Send a command to one agent without blocking (see ``AgentChannel.send``)."""
        return self.channel.send(fd, message)

    def broadcast(self, message: Message) -> int:
        """Send a command to every connected agent; returns how many got it."""
        return self.channel.broadcast(message)

    def _on_message(self, fd: int, conn: AgentConn, message: Message) -> None:
        kind = message["t"]
        now = self.clock()
        facts = self.state.facts
        rank = _int_or_none(conn.info.get("rank"))
        if kind == "hello":
            conn.info = message
            facts.agents_seen += 1
            if facts.node_rank is None:
                facts.node_rank = _int_or_none(message.get("node_rank"))
            hello_rank = _int_or_none(message.get("rank"))
            if hello_rank is not None and isinstance(message.get("error_file"), str):
                facts.error_files[hello_rank] = message["error_file"]
            log.debug("agent connected: pid %s rank %s", message.get("pid"), message.get("rank"))
        elif kind == "step":
            loss = message.get("loss")
            value = float(loss) if isinstance(loss, (int, float)) else math.nan
            self._on_step(now, _int_or_none(message.get("step")), value, finite=bool(message.get("finite", True)),
                          n=int(message.get("n", 1)), source="agent", rank=rank, agent=fd)
            if isinstance(message.get("skipped"), int):
                self._carry_out(self.watchdog.on_skipped(message["skipped"], _int_or_none(message.get("step")),
                                                         rank), now)
        elif kind == "trainer_config":
            self._on_trainer_config(fd, message.get("config") or {})
        elif kind == "training_args":  # built before the job's data work: check now, answer ack or stop
            self._check_settings(fd, message.get("config") or {})
        elif kind == "checkpoint_saved":
            message = {**message, "rank": conn.info.get("rank")}
            facts.checkpoints.append(message)
            if self.heartbeat is not None and message.get("zero", True) and message.get("path"):
                self.heartbeat.on_save(str(message["path"]))
            if self.securer is not None:
                self.securer.on_checkpoint_saved(self, message)
        elif kind == "file_saved":
            if len(facts.files_saved) < 1000:
                facts.files_saved.append(message)
            if self.securer is not None:
                self.securer.on_file_saved(self, {**message, "rank": conn.info.get("rank")})
        elif kind == "api":
            facts.api_used.add(str(message.get("name")))
        elif kind == "exception":
            facts.on_exception(message, rank)
        elif kind == "push_result":
            facts.trainer_push = message
            if not message.get("ok"):
                log.error("the Trainer's background push to the Hub failed: %s", message.get("error"))
        elif kind == "dist":
            conn.info.update(store=bool(message.get("store")), global_rank=message.get("global_rank"),
                             world_size=message.get("world_size"))
        elif kind == "progress":
            begun = message.get("begun")
            self.watchdog.on_stack_answer(rank, begun if isinstance(begun, int) else None,
                                          str(message["where"]) if message.get("where") else None,
                                          step=_int_or_none(message.get("step")))
        elif kind == "replay":  # CUDA-graph replays: steps without a loss, progress all the same
            self.watchdog.on_replay(now, rank)
        elif kind == "watching":
            facts.agent_watching = True
        elif kind == "train_intent":
            facts.train_intent.setdefault(str(message.get("what")), message.get("type") or True)
        elif kind == "empty_loader" and facts.empty_loader is None:
            facts.empty_loader = message
            log.warning("the job iterated a DataLoader with no batch (%s samples, batch_size %s, drop_last %s)",
                        message.get("samples"), message.get("batch_size"), message.get("drop_last"))
        elif kind == "train_end":
            log.debug("training ended at step %s of %s", message.get("step"), message.get("max_steps"))
            facts.on_train_end(message, rank)
            self.watchdog.on_train_end(rank)
        elif kind == "train_error" and facts.on_train_error(message):
            log.warning("Trainer.train() raised %s at step %s of %s", message.get("root") or message.get("exc_type"),
                        message.get("step"), message.get("max_steps"))

    def _on_step(self, now: float, step: int | None, value: float, *, finite: bool, n: int = 1, source: str,
                 rank: int | None = None, agent: int | None = None) -> None:
        seen = self.watchdog.on_step(now, step, value, finite=finite, n=n, source=source, rank=rank, agent=agent,
                                     live_ranks=self._live_ranks())
        if seen.counted:
            if self.securer is not None:
                self.securer.on_step(self, now)
            if self.heartbeat is not None:
                self.heartbeat.on_step(now, self.state.progress.step, self.state.progress.loss)
                self._observe(now)
        if self.watchdog.nan_decide_at is not None:
            self._recheck = True
        if self.securer is not None and self.state.outcome is not None and not (finite and math.isfinite(value)):
            # decided before the loss was read (a deadline, a signal): the saves from this step on are suspect
            self.securer.on_taint(self, step if step is not None else (self.state.progress.step or 0) + n)
        self._carry_out(seen.decisions, now)

    def _live_ranks(self) -> frozenset[int]:
        return frozenset(int(c.info["rank"]) for c in self.agents.values() if isinstance(c.info.get("rank"), int))

    def _on_trainer_config(self, fd: int, config: dict[str, Any]) -> None:
        facts = self.state.facts
        if facts.trainer_config is None:
            facts.trainer_config = config
            log.info("Trainer: output_dir=%s save_strategy=%s push_to_hub=%s hub_model_id=%s max_steps=%s",
                     config.get("output_dir"), config.get("save_strategy"), config.get("push_to_hub"),
                     config.get("hub_model_id"), config.get("max_steps"))
            if self.securer is not None:
                self.securer.on_trainer_config(config)
            if self.heartbeat is not None:
                from guard.observe.telemetry import follow_trainer

                follow_trainer(self.heartbeat, config, self.masker)
        self._check_settings(fd, config)

    def _check_settings(self, fd: int, config: dict[str, Any]) -> None:
        """Run the Trainer-settings checks; a ``fail`` ends the job as ``preflight``, else the agent gets ``ack``."""
        failed = self.settings_check.on_arguments(config)
        if failed is not None and self.state.outcome is None:
            self._carry_out([failed], self.clock())
            return
        self.send(fd, {"t": "ack"})

    # ------------------------------------------------------------------------------------------------------------
    # Decisions, signals, exit
    # ------------------------------------------------------------------------------------------------------------

    def _carry_out(self, decisions: list[Decision], now: float) -> None:
        for decision in decisions:
            if self.state.outcome is not None:
                return
            if decision.dump_stacks:
                self.broadcast({"t": "dump"})
                if self.job is not None:
                    from guard.observe.stacks import dump_stacks

                    HELPERS.submit(dump_stacks, self.job, self.masker)  # py-spy (up to 8 x 5 s) off the loop
            self._decide(decision.outcome, stop=decision.stop)
            if decision.stop_in_s is not None:
                self.stop_at = now + decision.stop_in_s  # the agents print their stacks first

    def _decide(self, outcome: Outcome, *, stop: bool = True, secure: bool = True) -> None:
        if self.state.outcome is not None:
            return
        self._recheck = True
        self.state.outcome = outcome
        self.watchdog.pause()
        if self.heartbeat is not None:
            self.heartbeat.on_outcome(outcome, self.state.progress, self.world_size())
        if stop and secure and self.securer is not None and outcome.reason == "non_finite_loss" and self.job_alive():
            # Secure first, then stop: a job told to stop (or training on) may save again over the good checkpoint
            # (a loop's SIGTERM handler rewriting ckpt.pt with the NaN weights). Frozen with SIGSTOP meanwhile,
            # thawed and stopped once securing is over (bounded by its secure_by: --grace).
            self.securer.on_decided(self, outcome)
            if self.securer.push_running():
                log.info("pausing the job (SIGSTOP) while the checkpoint saved before the non-finite loss is secured")
                self.frozen = True
                if self.job is not None:
                    self.job.signal_all(signal.SIGSTOP)
            else:
                self._stop_job(self.clock())
            return
        if stop:
            self._stop_job(self.clock())
        if secure and self.securer is not None:
            self.securer.on_decided(self, outcome)  # a failure secures what was saved before it

    def _stop_job(self, now: float, grace_s: float | None = None) -> None:
        """``stop`` to the agents, SIGTERM to the job's process group (and its escaped descendants); SIGKILL after
        the grace."""
        self._recheck = True
        if self.escalation.start(now, grace_s) and self.job is not None:
            self.broadcast({"t": "stop"})
            self.job.signal_all(signal.SIGTERM)

    def _handle_signals(self, now: float) -> None:
        while self.signals:
            signum = self.signals.pop(0)
            name = signal_name(signum)
            if self.securer is not None and self.securer.on_signal(self, signum, now):
                continue
            if self.state.outcome is None:
                log.warning("%s received: forwarding it to the job; SIGKILL in %.0fs if it keeps running", name,
                            self.settings.grace_s)
                self._decide(Outcome("INTERRUPTED", "signal", 128 + signum, extra={"signal": name},
                                     hint="the job was stopped by a signal sent to the guard; rerun it"), stop=False)
                self.signal_job(signum)
                self.escalation.start(now)
            else:
                log.warning("%s received again: stopping the job now", name)
                self.signal_job(signal.SIGKILL)

    def _on_job_exit(self, now: float) -> None:
        code = self.job_exit_code()
        log.info("job exited: %s", f"signal {signal_name(-code)}" if code is not None and code < 0 else code)
        if self.securer is not None:
            self.securer.on_job_exit(self, now)

    # ------------------------------------------------------------------------------------------------------------
    # What securing asks of the loop (guard.secure.securing.JobLink)
    # ------------------------------------------------------------------------------------------------------------

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

    def agents_connected(self) -> int:
        """How many agents are connected now."""
        return len(self.agents)

    def world_size(self) -> int:
        """The largest world size an agent reported (1 without one)."""
        return max((_int_or_none(c.info.get("world_size")) or 1 for c in self.agents.values()), default=1)

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
        """This machine's node rank: from the agents (torchrun's ``GROUP_RANK``), else from the guard's environment
        and the launcher's command (``ranks.configured_node_rank``); None on a single machine that does not say."""
        if self.state.facts.node_rank is not None:
            return self.state.facts.node_rank
        return configured_node_rank(self.config.environ, self.config.command)

    @property
    def follows_node_0(self) -> bool:
        """On a machine other than node 0 whose ranks share torch.distributed's store: node 0's guard decides
        checkpoints (its rank 0 relays them through the store, see ``guard.inside.agent._dist``); this guard only
        waits."""
        return self.node_rank not in (None, 0) and any(c.info.get("store") for c in self.agents.values())

    def signal_job(self, signum: int) -> None:
        """Send ``signum`` to every process of the job."""
        if self.job is not None:
            self.job.signal_all(signum)

    def stop_job_at(self, at: float, grace_s: float | None) -> None:
        """Stop the job (``stop``, SIGTERM, SIGKILL after ``grace_s``) at ``at`` unless an earlier stop is set."""
        if self.job_alive() and (self.stop_at is None or at < self.stop_at):
            self.stop_at, self.stop_grace_s = at, grace_s
            self._recheck = True

    def decide(self, outcome: Outcome) -> None:
        """Record securing's outcome (a deadline, a signal) if none stands; securing itself stops the job."""
        self._decide(outcome, stop=False, secure=False)

    def wake(self) -> None:
        """Run the timers on the loop's next turn."""
        self._recheck = True

    # ------------------------------------------------------------------------------------------------------------
    # Result
    # ------------------------------------------------------------------------------------------------------------

    def _result(self) -> RunResult:
        from guard.run.diagnose import JobExit, job_result

        assert self.job is not None
        job = self.job
        ended = JobExit(returncode=job.returncode, status_lost=job.status_lost, peak_rss_bytes=job.peak_rss_bytes,
                        last_rss_bytes=job.last_rss_bytes, survivors=list(job.survivors_left),
                        peak_rss_by_pid=dict(job.peak_rss_by_pid),
                        orphans_reaped=job.reaped, cgroup_start=self.cgroup_start,
                        elapsed_s=self.clock() - self.started, node_rank=self.node_rank)
        return job_result(self.state, ended, self.config, securer=self.securer)
