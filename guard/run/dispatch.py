"""The job's events to the policies: the agents' messages and what its output shows.

``Dispatch.on_message`` takes one agent message (``guard.protocol``, the table in ``docs/design.md``) and hands it
to the watchdog, securing, the heartbeat and ``RunState.facts``; ``after_output`` does the same for the losses,
exceptions and VERDICT lines parsed from the job's stdout and stderr (``guard.run.output.OutputEvents``). What the
policies return goes to the ``Executor``. Nothing here blocks.
"""

from __future__ import annotations

import logging
import math
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from guard.contract import ExitCode, signal_name
from guard.core.masking import Masker
from guard.core.state import Message, Outcome
from guard.run.channel import AgentConn
from guard.run.executor import Executor
from guard.run.joblink import LoopLink, int_or_none
from guard.run.output import OutputEvents
from guard.run.relay import relay_signal, relayed_signal
from guard.run.watchdog import SettingsCheck

if TYPE_CHECKING:
    from guard.observe.telemetry import Heartbeat
    from guard.secure.securing import Securing

__all__ = ["Dispatch"]

log = logging.getLogger("guard.supervisor")


class Dispatch:
    """Moves the job's events (agent messages, parsed output) to the policies.

    Args:
        link: the loop's job link (its ``state``, ``watchdog``, the agents).
        executor: carries out what the policies decide.
        clock: monotonic seconds.
        masker: masks the Trainer settings the heartbeat logs.
        settings_check: the Trainer-settings check (``training_args``, ``trainer_config``).
        read_agents: reads the agent messages already waiting on the socket, without blocking (before the
            output's losses are weighed: an agent may have said it sees the losses itself).
        securer: the securing flow, or None. heartbeat: the heartbeat and alerts, or None.
    """

    def __init__(self, link: LoopLink, executor: Executor, *, clock: Callable[[], float], masker: Masker,
                 settings_check: SettingsCheck, read_agents: Callable[[], None], securer: Securing | None = None,
                 heartbeat: Heartbeat | None = None) -> None:
        self.link = link
        self.state = link.state
        self.watchdog = link.watchdog
        self.executor = executor
        self.clock = clock
        self.masker = masker
        self.settings_check = settings_check
        self.read_agents = read_agents
        self.securer = securer
        self.heartbeat = heartbeat
        self.relayed = False  # another node's signal was handled here (``on_relayed``)
        self.relayed_at: float | None = None  # when (loop clock) a signal another node's guard received came here

    def on_signal(self, signum: int, now: float) -> None:
        """A signal the guard received (``signum``): securing takes SIGTERM/SIGINT/SIGUSR1 when it runs; else the
        first one is the outcome (``INTERRUPTED signal``, 128 + n), forwarded to the job, and the escalation to
        SIGKILL starts (``--grace``); one after an outcome stands kills the job now."""
        name = signal_name(signum)
        link = self.link
        if self.state.outcome is None and link.follows_node_0 and relay_signal(link, signum, now):
            self.executor.decide(Outcome("INTERRUPTED", "signal", 128 + signum, extra={"signal": name},
                                         hint="the job was stopped by a signal sent to the guard; rerun it"),
                                 stop=False)
            return
        if self.securer is not None and self.securer.on_signal(link, signum, now):
            return
        if self.state.outcome is None:
            log.warning("%s received: forwarding it to the job; SIGKILL in %.0fs if it keeps running", name,
                        link.settings.grace_s)
            self.executor.decide(Outcome("INTERRUPTED", "signal", 128 + signum, extra={"signal": name},
                                         hint="the job was stopped by a signal sent to the guard; rerun it"),
                                 stop=False)
            link.signal_job(signum)
            link.escalation.start(now)
        else:
            log.warning("%s received again: stopping the job now", name)
            link.signal_job(signal.SIGKILL)

    def on_relayed(self, message: Message, now: float) -> None:
        """Node ``origin``'s guard received a termination signal and every rank adopted its request to save and stop
        (``guard.run.relay``): handled as if this guard had received it, once, without asking the job again (it
        already saves at that step), and the job stopped at half the grace unless it ends first."""
        signum, origin = relayed_signal(message), message.get("origin")
        if self.relayed or origin == self.link.node_rank or self.state.outcome is not None:
            return
        if signum is None and message.get("trigger") == "deadline":
            self.on_relayed_deadline(message, now)
            return
        if signum is None:
            return
        self.relayed, self.relayed_at = True, now
        log.warning("%s on node %s: every rank saves at step %s and stops; handled here as if received",
                    signal_name(signum), origin, message.get("at_step"))
        if self.securer is not None:
            self.securer.peers.relayed = True  # the job already has its request: securing asks for no other step
            if self.securer.on_signal(self.link, signum, now):
                return
        self.executor.decide(Outcome("INTERRUPTED", "signal", 128 + signum, extra={"signal": signal_name(signum)},
                                     hint=f"node {origin} received {signal_name(signum)}; the job stopped on every "
                                          "node: rerun it"), stop=False)
        grace_s = self.link.settings.grace_s
        self.link.stop_job_at(now + grace_s / 2, grace_s / 2)

    def on_relayed_deadline(self, message: Message, now: float) -> None:
        """Node 0's guard asked every rank to save at one step and stop for its deadline, before this node's own
        request was due (node 0's margin includes the record's time): handled as this node's deadline, once, the
        job not asked again (it already saves at that step), and stopped at half the grace unless it ends first."""
        self.relayed = True
        log.warning("node 0's deadline: every rank saves at step %s and stops; handled here as this node's deadline",
                    message.get("at_step"))
        if self.securer is not None:
            self.securer.peers.relayed = True  # the job already has its request: securing asks for no other step
            if self.securer.on_relayed_deadline(self.link, now):
                return
        self.executor.decide(Outcome("TIMEOUT", "deadline", int(ExitCode.TIMEOUT_UNSECURED),
                                     hint="node 0's guard stopped the job at its deadline on every node"), stop=False)
        grace_s = self.link.settings.grace_s
        self.link.stop_job_at(now + grace_s / 2, grace_s / 2)

    def on_message(self, fd: int, conn: AgentConn, message: Message) -> None:
        """One message from the agent on ``fd`` (its connection ``conn``; ``conn.info`` holds its hello)."""
        kind = message["t"]
        now = self.clock()
        facts = self.state.facts
        rank = int_or_none(conn.info.get("rank"))
        if kind == "hello":
            conn.info = message
            facts.agents_seen += 1
            if facts.node_rank is None:
                facts.node_rank = int_or_none(message.get("node_rank"))
            hello_rank = int_or_none(message.get("rank"))
            if hello_rank is not None:
                facts.ranks_seen.add(hello_rank)
            if hello_rank is not None and isinstance(message.get("error_file"), str):
                facts.error_files[hello_rank] = message["error_file"]
            log.debug("agent connected: pid %s rank %s", message.get("pid"), message.get("rank"))
        elif kind == "step":
            loss = message.get("loss")
            value = float(loss) if isinstance(loss, (int, float)) else math.nan
            self.on_step(now, int_or_none(message.get("step")), value, finite=bool(message.get("finite", True)),
                         n=int(message.get("n", 1)), source="agent", rank=rank, agent=fd,
                         witness=str(message.get("source") or "loss"))
            if isinstance(message.get("skipped"), int):
                self.executor.carry_out(self.watchdog.on_skipped(message["skipped"], int_or_none(message.get("step")),
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
                self.securer.on_checkpoint_saved(self.link, message)
        elif kind == "file_saved":
            if len(facts.files_saved) < 1000:
                facts.files_saved.append(message)
            if self.securer is not None:
                self.securer.on_file_saved(self.link, {**message, "rank": conn.info.get("rank")})
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
                                          step=int_or_none(message.get("step")))
        elif kind == "count":  # the agent's step count, every 0.1 s while it moves (the VERDICT's step=)
            self.watchdog.on_count(rank, int_or_none(message.get("step")))
        elif kind == "relayed":  # another node's guard got a termination signal (guard/run/relay.py)
            self.on_relayed(message, now)
        elif kind == "run_id" and self.securer is not None:  # node 0's guard's, read from the job's store
            self.securer.peers.adopt_run_id(str(message.get("run_id") or ""))
        elif kind == "replay":  # CUDA-graph replays: steps without a loss, progress all the same
            self.watchdog.on_replay(now, rank)
        elif kind == "watching":
            facts.agent_watching = True
        elif kind == "train_intent":
            facts.train_intent.setdefault(str(message.get("what")), message.get("type") or True)
            state_bytes = message.get("state_bytes")
            if message.get("what") == "optimizer" and isinstance(state_bytes, int) and self.securer is not None:
                self.securer.on_model_size(state_bytes)
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

    def on_step(self, now: float, step: int | None, value: float, *, finite: bool, n: int = 1, source: str,
                rank: int | None = None, agent: int | None = None, witness: str = "loss") -> None:
        """One training step (``source``: ``agent`` or ``output``) with its loss ``value`` at ``now`` (monotonic
        seconds): the watchdog, securing's step times, the heartbeat; a loss read after an outcome taints the
        saves from that step on. ``witness``: what the agent found non-finite (``loss``, ``grad_norm``,
        ``weights``)."""
        seen = self.watchdog.on_step(now, step, value, finite=finite, n=n, source=source, rank=rank, agent=agent,
                                     live_ranks=self.link.live_ranks(), witness=witness)
        if seen.counted:
            if self.securer is not None:
                self.securer.on_step(self.link, now)
            if self.heartbeat is not None:
                self.heartbeat.on_step(now, self.state.progress.step, self.state.progress.loss)
                self.observe(now)
        if self.watchdog.nan_decide_at is not None:
            self.link.recheck = True
        if self.securer is not None and self.state.outcome is not None and not (finite and math.isfinite(value)):
            # decided before the loss was read (a deadline, a signal): the saves from this step on are suspect
            self.securer.on_taint(self.link, step if step is not None else (self.state.progress.step or 0) + n)
        self.executor.carry_out(seen.decisions, now)

    def observe(self, now: float) -> None:
        """Alerts (``guard.observe.alerts``): the watchdog's warnings and the securing plan, read, never waited on."""
        if self.heartbeat is not None:
            self.heartbeat.observe(now, self.state.progress, self.securer.plan if self.securer is not None else None)

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
            self.executor.carry_out([failed], self.clock())
            return
        self.link.send(fd, {"t": "ack"})

    # -- the job's output ----------------------------------------------------------------------------------------

    def after_output(self, now: float, events: OutputEvents) -> None:
        """What the job's output showed since the last call (``events``, emptied of its losses): losses (while no
        agent sees them), CUDA OOM, exceptions, the job's own VERDICT, the last stderr line, ranks' errors."""
        facts = self.state.facts
        if events.losses:
            losses, events.losses[:] = list(events.losses), []
            if self._output_decides():
                for step, value in losses:
                    self.on_step(now, step, value, finite=math.isfinite(value), source="output")
        facts.cuda_oom |= events.cuda_oom
        facts.last_exception = events.last_exception or facts.last_exception
        facts.root_exception = events.root_exception or facts.root_exception
        if events.job_verdicts:
            facts.job_verdict = events.job_verdicts[-1]
        facts.last_stderr_line = events.last_lines.get("stderr", facts.last_stderr_line)
        for rank, text in events.rank_exceptions.items():
            facts.rank_exceptions.setdefault(rank, text)
        for rank, code in events.rank_exits.items():
            facts.rank_exits.setdefault(rank, code)
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
        self.read_agents()
        return not agent_sees()
