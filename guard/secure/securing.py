"""The supervisor's side of securing: a translator from the loop's events to the plan's, and the executor of the
actions the plan returns.

The supervisor calls these hooks from its one loop (``tick``, ``on_signal``, ``on_checkpoint_saved``,
``on_decided``, ``on_taint``, ``on_job_exit`` ...); each turns what happened into ``guard.secure.events`` events
for ``Plan.on`` and carries out the answer. None blocks: pushes run in worker processes (``guard.secure.worker``)
that the plan polls and kills at ``secure_by``. Nothing here reads or writes the plan's state: ``finish`` fills
the VERDICT's ``checkpoint=``, ``pushed=``, ``secured=`` and the exit code of a deadline or signal from
``Plan.report()`` through ``guard.secure.outcome.checkpoint_fields`` (``CONTRACT.md``, "Secured checkpoints").
"""

from __future__ import annotations

import logging
import math
import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from guard.contract import RunResult, signal_name
from guard.core.state import Message, Outcome, RunState, died_after_training, incomplete_reason
from guard.errors import GuardError
from guard.secure import budget, checkpoints, layout, worker
from guard.secure.events import (
    Action,
    AlreadySecured,
    CheckpointSeen,
    DeadlineMoved,
    DeadlineNear,
    Decide,
    DestinationKnown,
    Event,
    Failure,
    ForwardSignal,
    JobExited,
    MarkSuspect,
    OutputDirKnown,
    Pusher,
    RequestSave,
    RunOver,
    SignalReceived,
    StopJob,
    Tainted,
    Tick,
    TrainingStarted,
)
from guard.secure.outcome import Verdict, checkpoint_fields
from guard.secure.plan import Plan, State

if TYPE_CHECKING:
    from guard.secure.hub import Securer

__all__ = ["FAILURE_REASONS", "EndTimeSource", "JobLink", "Securing"]

log = logging.getLogger("guard.secure")

#: Outcomes after which the newest complete checkpoint saved before the failure is secured.
FAILURE_REASONS = ("non_finite_loss", "stalled", "crash", "oom", "killed", "incomplete")
SCAN_EVERY_S = 5.0  # how often the output folder is looked at for complete checkpoints
FILE_SETTLE_S = 1.0  # a torch.save'd file counts as a whole checkpoint after this long without another file


#: accelerate's ``ProjectConfiguration(automatic_checkpoint_naming=True)`` folder: N counts the saves
_SAVE_COUNT_RE = re.compile(r"(?:checkpoint|step)_[0-9]+")
#: Files at the top of a working folder that belong to a final model when the job wrote them (weights, configs,
#: tokenizer files): the final model pushed from a working folder is never its sources, data or logs.
_FINAL_MODEL_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".json", ".model", ".tiktoken")


class EndTimeSource(Protocol):
    """Where a changed end time of the allocation comes from (``guard.run.slurm.SlurmRefresher``)."""

    last_source: str

    def maybe_refresh(self, now_s: float | None = None) -> float | None:
        """A new end time (epoch seconds) when a refresh that finished since says so, else None; never blocks."""


class JobLink(Protocol):
    """What securing needs from the supervisor's loop (``guard.run.supervisor.Supervisor`` offers it; tests offer
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


class Securing:
    """Hooks for the supervisor's loop around one ``Plan``; each hook gets the loop as a :class:`JobLink`.

    Args:
        deadline: the job's deadline (``budget.resolve_deadline``); ``deadline_s`` None without a limit.
        estimator: the margin estimator (``--margin`` fixed, or measured).
        securer: a ``hub.Securer`` for the destination (its ``destination`` and ``token`` are what the workers
            use), or None (no destination yet: the Trainer's ``hub_model_id`` may provide one).
        securer_factory: builds a ``Securer`` from destination text (for the Trainer's ``hub_model_id``).
        output_dir: where the job writes checkpoints (``--output-dir``; else the Trainer's ``output_dir``).
        grace_s: ``--grace``. background: ``--background-push``. push_interval_s: ``--push-interval``.
        final_window_s: ``--final-push-window`` (securing after a good end with no deadline).
        refresher: a ``guard.run.slurm.SlurmRefresher`` (any ``EndTimeSource``) or None.
        wall: epoch seconds; clock: monotonic seconds.
        pusher_factory: builds the plan's pusher from (destination text, token); default ``worker.Pusher``.
    """

    def __init__(self, *, deadline: budget.Deadline, estimator: budget.MarginEstimator, securer: Securer | None = None,
                 securer_factory: Callable[[str], Securer] | None = None, output_dir: str | None = None,
                 grace_s: float = 30.0, refresher: EndTimeSource | None = None,
                 wall: Callable[[], float] = time.time,
                 clock: Callable[[], float] = time.monotonic, background: bool = True,
                 push_interval_s: float = 600.0, final_window_s: float = 180.0,
                 pusher_factory: Callable[[str, str | None], Pusher] | None = None) -> None:
        self.deadline = deadline
        self.estimator = estimator
        self.securer = securer
        self.securer_factory = securer_factory
        self.output_dir = output_dir
        self.refresher = refresher
        self.wall, self.clock = wall, clock
        self._pusher_factory: Callable[[str, str | None], Pusher] = pusher_factory or (
            lambda dest, token: worker.Pusher(dest, token, clock=clock))
        self.plan = Plan(clock=clock, pusher=self._make_pusher(securer), estimator=estimator,
                         deadline_at=self._to_clock(deadline.deadline_s), grace_s=grace_s, background=background,
                         push_interval_s=push_interval_s, final_output_dir=output_dir, final_window_s=final_window_s)
        self.latest_reported: checkpoints.CheckpointInfo | None = None
        self.last_step_at: float | None = None
        self.saved_ranks: dict[int | None, set[int]] = {}  # step -> ranks whose part of that save is done
        self.reported_paths: set[str] = set()  # folders the job said it finished: no mtime rule for them
        self.saved_files = checkpoints.SavedFiles()  # torch.save calls the agent saw return
        #: accelerate's ``save_state`` folders -> the agent's step at the last ``torch.save`` into each (its
        #: optimizer.bin, scheduler.bin, ...): automatic ``checkpoint_N`` counts saves, and a script's own ``step_N``
        #: may not go on from the resumed step (accelerate's complete_nlp_example after a resume mid-epoch)
        self.save_count_steps: dict[Path, int] = {}
        self.trainer_seen = False
        self.pending_file: tuple[checkpoints.CheckpointInfo, float] | None = None  # a save that may still grow
        self.follower = False
        self.next_scan = -math.inf
        self._seen: set[tuple[str, str]] = set()
        self._node_checked = False
        self._save_logged = False
        self._training_seen = False
        self._signalled = False  # a signal was forwarded to the job: its end is no finished training
        self.started_s: float | None = None  # the job's start (epoch s): older checkpoints are an earlier run's
        self.resumed_paths: set[str] = set()
        if deadline.deadline_s is not None:
            log.info("deadline: %s (%s from now; %s)", time.strftime("%Y-%m-%d %H:%M:%S %Z",
                     time.localtime(deadline.deadline_s)),
                     budget.format_duration_s(round(deadline.deadline_s - wall())), deadline.source)
            estimator.margin_s()  # logs the starting margin
        if self.plan.has_pusher:
            every = (f"at most one push every {budget.format_duration_s(push_interval_s)}" if push_interval_s > 0
                     else "every complete save")
            log.info("background securing: %s", f"on, {every}" if background else "off (--background-push off)")

    # -- helpers ----------------------------------------------------------------------------------------------

    def _make_pusher(self, securer: Securer | None) -> Pusher | None:
        if securer is None:
            return None
        return self._pusher_factory(str(securer.destination), getattr(securer, "token", None))

    def _feed(self, sup: JobLink | None, event: Event, now: float | None = None) -> None:
        """One event to the plan; its actions carried out (``sup`` None: only actions that need no loop)."""
        actions = self.plan.on(event)
        if actions:
            self._carry_out(sup, actions, self.clock() if now is None else now)

    def already_secured(self, info: checkpoints.CheckpointInfo, *, destination: str, revision: str) -> None:
        """The destination already holds ``info`` (the checkpoint a resumed run was fetched from)."""
        self._feed(None, AlreadySecured(info, destination, revision))

    def _to_clock(self, epoch_s: float | None) -> float | None:
        return None if epoch_s is None else self.clock() + (epoch_s - self.wall())

    def busy(self) -> bool:
        """Securing has started and is not finished (the supervisor keeps running until it is)."""
        return self.plan.busy

    def due_at(self, now: float) -> float:
        """The next time ``tick`` has work (monotonic seconds)."""
        due = [self.plan.due_at(now)]
        if self.pending_file is not None:
            due.append(self.pending_file[1] + FILE_SETTLE_S)
        if self.refresher is not None and self.plan.state is State.WATCHING:
            due.append(now + 60.0)
        if self._scanning():
            due.append(self.next_scan)
        return min(due)

    def _scanning(self) -> bool:
        return bool(self.output_dir) and self.plan.state in (State.WATCHING, State.AWAITING_SAVE, State.SECURING)

    def before_start(self) -> None:
        """Before the job starts: a complete checkpoint already in the output folder gives the margin a size."""
        # this run's checkpoints: written from now on, or the one it resumed from (checkpoints.newest_complete)
        self.started_s = self.wall()
        self.resumed_paths = {str(self.latest_reported.path)} if self.latest_reported is not None else set()
        if not self.output_dir or self.latest_reported is not None:
            return
        try:
            found = checkpoints.newest_complete(self.output_dir, now_s=self.wall())
        except OSError:
            return
        if found is not None:
            self.estimator.observe_size(found.size_bytes)

    def _can_save(self, sup: JobLink) -> bool:
        """The job can answer a checkpoint request: a Trainer, or a script that reported a save itself or called
        ``guard.should_checkpoint()`` (``JobFacts.answers_checkpoints``)."""
        if not sup.job_running() or not sup.agents_connected():
            return False
        step = sup.state.progress.step
        # Too early to tell: a Trainer reports itself at on_train_begin, a loop calls should_checkpoint() after its
        # first step's backward (which the agent reports first). Ask; the wait is bounded.
        return step is None or step < 3 or sup.state.facts.answers_checkpoints

    def _check_node(self, sup: JobLink) -> None:
        if self._node_checked or not self.plan.has_pusher:
            return
        node = sup.node_rank
        if node not in (None, 0):
            log.info("node %d: the guard of node 0 secures checkpoints; this one does not push", node)
            self._feed(sup, DestinationKnown(None))
            self._node_checked = True
        elif node == 0:
            self._node_checked = True
        # None: not known yet (the launcher's own agent says hello before the ranks do): asked again next time

    def _carry_out(self, sup: JobLink | None, actions: list[Action], now: float) -> None:
        for action in actions:
            if isinstance(action, MarkSuspect):
                checkpoints.mark_suspect(action.path, step=action.step, first_non_finite_step=action.first_bad_step)
                continue
            if sup is None:
                continue
            if isinstance(action, Decide):
                extra = {"signal": signal_name(action.signum)} if action.signum is not None else {}
                sup.decide(Outcome(action.status, action.reason, extra=extra))
            elif isinstance(action, RequestSave):
                self._request_save(sup)
            elif isinstance(action, StopJob):
                sup.stop_job_at(max(now, action.at), action.grace_s)
            elif isinstance(action, ForwardSignal):
                self._signalled = True
                sup.signal_job(action.signum)

    def _request_save(self, sup: JobLink) -> None:
        if sup.follows_node_0:
            self.follower = True
            log.info("node %s: node 0's guard asks for the checkpoint (through the job's store); waiting for the "
                     "job to save and end", sup.node_rank)
            return
        request: dict[str, Any] = {"t": "checkpoint", "stop": True}
        ranks = sup.training_ranks()
        world_size = sup.world_size()
        if len(ranks) > 1 or world_size > 1:
            # Collective saves (DDP, FSDP, DeepSpeed) deadlock unless every rank saves at the same step: name a step
            # ahead of every rank (the supervisor hears of steps every --check-every steps at most). Before the first
            # step no rank has reported one: count from 0.
            every = sup.check_every
            ahead = (sup.newest_rank_step() or 0) + 2 * every + 2
            request["at_step"] = ahead
            log.info("%d ranks: each saves at step %d", max(len(ranks), world_size), ahead)
        sup.broadcast(request)

    # -- hooks ------------------------------------------------------------------------------------------------

    def tick(self, sup: JobLink, now: float) -> None:
        self._check_node(sup)
        if self.refresher is not None and self.plan.state is State.WATCHING:
            end_s = self.refresher.maybe_refresh(self.wall())
            if end_s is not None:
                moved = self.deadline.refreshed(end_s, self.refresher.last_source or "scontrol EndTime")
                if moved.deadline_s != self.deadline.deadline_s:
                    log.info("deadline moved to %s (%s)", time.strftime("%H:%M:%S", time.localtime(moved.deadline_s)),
                             moved.source)
                    self.deadline = moved
                    self._feed(sup, DeadlineMoved(self._to_clock(moved.deadline_s)), now)
        self._settle(sup, now)
        if self._scanning() and now >= self.next_scan:
            self.next_scan = now + SCAN_EVERY_S
            self._scan(sup)
        if sup.state.progress.step is not None:
            self._training_started(sup, now)  # a step was seen: the deadline's request follows the margin
        if sup.job_running() and sup.state.outcome is None and self.plan.deadline_due(now):
            self._feed(sup, DeadlineNear(can_save=self._can_save(sup), handles_term=sup.state.facts.handles_sigterm),
                       now)
        self._feed(sup, Tick(), now)

    def _training_started(self, sup: JobLink, now: float) -> None:
        if not self._training_seen:
            self._training_seen = True
            self._feed(sup, TrainingStarted(), now)

    def _scan(self, sup: JobLink, *, stable_for_s: float | None = None) -> None:
        """A complete checkpoint in the output folder the job did not report (``checkpoints.newest_complete``)."""
        try:
            found = checkpoints.newest_complete(self.output_dir or "", now_s=self.wall(), seen=self._seen,
                                                stable_for_s=2.0 if stable_for_s is None else stable_for_s,
                                                steps={str(p): s for p, s in self.save_count_steps.items()},
                                                reported=self.reported_paths, loose=not self.trainer_seen,
                                                since_s=self.started_s, resumed=self.resumed_paths)
        except OSError:
            return
        if found is not None and (self.latest_reported is None or (found.step or -1) > (self.latest_reported.step
                                                                                      or -1)):
            self.estimator.observe_size(found.size_bytes)
            self._feed(sup, CheckpointSeen(found))

    def on_signal(self, sup: JobLink, signum: int, now: float) -> bool:
        """Feed a termination signal to the plan; False lets the supervisor handle it (no destination, or done)."""
        if signum == signal.SIGHUP or self.plan.state is State.DONE:
            return False
        if not self.plan.has_pusher and self.plan.state is State.WATCHING:
            return False
        if self.plan.state is State.WATCHING and sup.state.outcome is not None:
            return False
        self._feed(sup, SignalReceived(signum, can_save=self._can_save(sup)), now)
        return True

    def on_trainer_config(self, config: dict[str, Any]) -> None:
        """The Trainer's arguments: its ``output_dir``, and its ``hub_model_id`` as the destination when
        ``push_to_hub`` is on and ``--push-to`` gave none."""
        self.trainer_seen = True
        estimate = config.get("checkpoint_bytes_estimate")
        if isinstance(estimate, int) and estimate > 0 and not self.estimator.size_hint_bytes:
            self.estimator.size_hint_bytes = float(estimate)  # until the first save measures the real size
            log.debug("checkpoint size before the first save: about %.1f MB (weights + AdamW state)", estimate / 1e6)
        if self.output_dir is None and config.get("output_dir"):
            self.output_dir = str(config["output_dir"])
            self._feed(None, OutputDirKnown(self.output_dir))
        if self.securer is None and config.get("push_to_hub") and config.get("hub_model_id") and self.securer_factory:
            try:
                self.securer = self.securer_factory(str(config["hub_model_id"]))
                self._feed(None, DestinationKnown(self._make_pusher(self.securer)))
                log.info("destination from the Trainer: %s (push_to_hub, hub_model_id)", self.securer.destination)
            except GuardError as exc:
                log.warning("cannot use the Trainer's hub_model_id as a destination: %s", exc.message)

    def on_step(self, sup: JobLink, now: float) -> None:
        """A training step of the primary rank (step times for the margin)."""
        self._training_started(sup, now)
        if self.last_step_at is not None:
            self.estimator.observe_step(now - self.last_step_at)
        self.last_step_at = now

    def on_file_saved(self, sup: JobLink, message: Message) -> None:
        """The agent saw ``torch.save`` write a file (a loop that may never use the guard's API): complete (the call
        returned), with the agent's step at the save; the files of one save form one checkpoint."""
        path = message.get("path")
        if not path:
            return
        where = Path(str(path))
        step = message.get("step")
        if _SAVE_COUNT_RE.fullmatch(where.parent.name) and isinstance(step, int) and message.get("rank") in (None, 0):
            self.save_count_steps[where.parent.resolve()] = step
        learnt = layout.output_dir_of_save(where) if self.output_dir is None else None
        if learnt is not None:
            self.output_dir = str(learnt)
            self._feed(sup, OutputDirKnown(self.output_dir))
            log.info("output folder: %s (where the job saves with torch.save)", self.output_dir)
        if self.output_dir is None or not where.resolve().is_relative_to(Path(self.output_dir).resolve()):
            return
        info = self.saved_files.add(where, message.get("step"))
        if info is None:
            return
        if message.get("save_s"):
            self.estimator.observe_save(float(message["save_s"]), info.size_bytes)
        else:
            self.estimator.observe_size(info.size_bytes)
        if message.get("rank") not in (None, 0):
            return  # another rank's shard: rank 0's save names the checkpoint
        # A loop may save model.pt, then optim.pt: the set is taken once the job trains on (a later step) or a
        # moment passes without another file (see _settle).
        self.pending_file = (info, self.clock())
        sup.wake()

    def _settle(self, sup: JobLink, now: float, *, force: bool = False) -> None:
        if self.pending_file is None:
            return
        info, at = self.pending_file
        step = sup.state.progress.step
        stepped_on = step is not None and info.step is not None and step > info.step
        if not (force or now - at >= FILE_SETTLE_S or stepped_on):
            return
        self.pending_file = None
        self.latest_reported = info
        log.info("the job saved %s (step %s, %.1f MB)", info.path, info.step, info.size_bytes / 1e6)
        self._check_node(sup)
        self._feed(sup, CheckpointSeen(info), now)

    def on_checkpoint_saved(self, sup: JobLink, message: Message) -> None:
        """The job reported a finished save (``checkpoint_saved``, with the sender's ``rank``)."""
        try:
            path = str(layout.check_reported_path(message.get("path"), output_dir=self.output_dir))
        except GuardError as exc:
            log.warning("%s (hint: %s)", exc.message, exc.hint)
            return
        self.reported_paths.add(path)
        rank = message.get("rank")
        if rank is not None:
            self.saved_ranks.setdefault(message.get("step"), set()).add(int(rank))
        if message.get("zero", True):
            try:
                saved = checkpoints.describe(path, step=message.get("step"))
            except GuardError as exc:
                log.warning("%s", exc.message)
                return
            if message.get("save_s"):
                self.estimator.observe_save(float(message["save_s"]), saved.size_bytes)
            else:
                self.estimator.observe_size(saved.size_bytes)
            self.latest_reported = saved
            # The first save at INFO; later ones are counted in the heartbeat (``saves=``), their detail at DEBUG.
            first, self._save_logged = not self._save_logged, True
            log.log(logging.INFO if first else logging.DEBUG, "checkpoint saved by the job: %s (step %s, %.1f MB)%s",
                    saved.path, saved.step, saved.size_bytes / 1e6,
                    "; later saves are counted in the heartbeat" if first else "")
        latest = self.latest_reported
        if latest is None:
            return
        info = latest
        missing = sup.training_ranks() - self.saved_ranks.get(info.step, set())
        if missing and len(sup.training_ranks()) > 1:  # the push waits for every rank's part of the save
            log.info("checkpoint %s: waiting for rank(s) %s to finish their part", info.step,
                     ",".join(map(str, sorted(missing))))
            return
        self._check_node(sup)
        self._feed(sup, CheckpointSeen(info))

    def push_running(self) -> bool:
        """A push that ends the run (securing a failure, a deadline, a signal) is under way."""
        return self.plan.push_running()

    def on_decided(self, sup: JobLink, outcome: Outcome) -> None:
        """The supervisor decided a failure (non-finite loss, stall ...): secure what was saved before it."""
        if outcome.reason not in FAILURE_REASONS:
            return
        self._settle(sup, self.clock(), force=True)
        if self.output_dir:
            self._scan(sup)
        bad = sup.state.progress.step if outcome.reason == "non_finite_loss" else None
        if bad is not None:
            self._feed(sup, Tainted(bad))
        self._feed(sup, Failure(outcome.reason))

    def on_taint(self, sup: JobLink, step: int) -> None:
        """A non-finite loss from ``step`` on, heard after another outcome was decided (a deadline, a signal): the
        saves from then on are suspect whatever is under way."""
        self._settle(sup, self.clock(), force=True)
        self._feed(sup, Tainted(step))

    def _training_complete(self, sup: JobLink) -> bool:
        """The job trained to its end: a Trainer reached ``max_steps``/its epochs (or ended with no stop asked
        for), a loop ended with no stop delivered to it (no checkpoint request served, no SIGTERM, no signal)."""
        facts = sup.state.facts
        end = facts.train_end
        if end is not None:
            step, max_steps = end.get("step"), end.get("max_steps")
            reached = isinstance(step, int) and isinstance(max_steps, int) and 0 < max_steps <= step
            return reached or not end.get("stopped")
        if facts.trainer_config is not None:
            return False  # a Trainer that never said how training ended
        answered = any(message.get("requested") for message in facts.checkpoints)  # saved on the guard's request
        return not (answered or "stop_served" in facts.api_used or self._signalled or sup.job_stopped())

    def on_job_exit(self, sup: JobLink, now: float) -> None:
        """The job's main process exited: a failure secures what it saved, a finished training pushes the final
        model (a PASS, even after the deadline's request)."""
        self._settle(sup, now, force=True)
        code = sup.job_exit_code()
        outcome = sup.state.outcome
        if self.output_dir and self.plan.state is not State.DONE:
            # exit 0: nothing writes any more, so a save made just before the exit needs no settle time (the
            # completion rules and the format checks still apply); else a save cut short may look settled
            self._scan(sup, stable_for_s=0.0 if code == 0 else None)
        from guard.secure.hub import holds_final_model  # lazily: the hub module is needed only at the end

        final_files = self._final_files()
        completed = died_after_training(sup.state.facts, code,
                                        lambda: holds_final_model(self.output_dir, final_files)) is not None
        if self.plan.state is State.WATCHING and outcome is None and code is not None and code != 0 \
                and not completed:
            self._feed(sup, Failure("crash" if code > 0 else "killed"), now)
            return
        # an exit 0 that is not a finished run: a failure, not a final push
        if self.plan.state is State.WATCHING and outcome is None and code == 0 \
                and incomplete_reason(sup.state.facts, sup.state.progress) is not None:
            self._feed(sup, Failure("incomplete"), now)
            return
        ok = (code == 0 or completed) and (outcome is None or outcome.reason == "deadline")
        complete = ok and incomplete_reason(sup.state.facts, sup.state.progress) is None \
            and self._training_complete(sup)
        self._check_node(sup)
        if ok and sup.node_rank not in (None, 0) and self.securer is not None:
            log.info("node %d: the guard of node 0 pushes the final model", sup.node_rank)
        has_final_model = not (ok and self.output_dir) or holds_final_model(self.output_dir, final_files)
        self._feed(sup, JobExited(ok=(ok and outcome is None) or complete, complete=complete,
                                  has_final_model=has_final_model, final_files=final_files), now)

    def _final_files(self) -> tuple[str, ...] | None:
        """The files of the output folder that are the final model: all of them (None), unless the folder is not
        the job's own (the working folder, from ``--save model.pt``; one above it): then only the files the job
        saved at its top (``torch.save``) and the model, config and tokenizer files written there since it started
        (a Trainer's ``save_model`` with ``--output_dir .``), never its sources, data and logs."""
        if not self.output_dir or layout.is_plausible_output_dir(self.output_dir):
            return None
        names = set(self.saved_files.names_in(self.output_dir))
        since = self.started_s if self.started_s is not None else math.inf
        try:
            with os.scandir(self.output_dir) as entries:
                for entry in entries:
                    if (entry.name.endswith(_FINAL_MODEL_SUFFIXES) or entry.name in ("vocab.txt", "merges.txt")) \
                            and not entry.name.startswith((".", "_")) \
                            and entry.is_file(follow_symlinks=False) and entry.stat().st_mtime >= since:
                        names.add(entry.name)
        except OSError:
            pass
        return tuple(sorted(names))

    # -- the verdict ------------------------------------------------------------------------------------------

    def finish(self, result: RunResult, *, step: int | None) -> None:
        """Fill the result's checkpoint fields, and its exit code for TIMEOUT/INTERRUPTED (75 when secured), from
        the plan's report (``outcome.checkpoint_fields``).

        Args:
            result: the run's result, changed in place.
            step: the job's last training step (the steps lost after the secured checkpoint), or None.
        """
        self._feed(None, RunOver())
        report = self.plan.report()
        nothing = layout.nothing_found_hint(output_dir=self.output_dir,
                                            destination_given=self.securer is not None or report.trigger == "signal")
        fields = checkpoint_fields(report, Verdict(result.status, result.reason, result.exit_code, result.hint,
                                                   result.extra.get("signal")),
                                   step=step, nothing_found_hint=nothing, follower=self.follower)
        verdict = fields.verdict
        result.status, result.reason, result.exit_code, result.hint = (verdict.status, verdict.reason,
                                                                       verdict.exit_code, verdict.hint)
        if verdict.signal is not None:
            result.extra["signal"] = verdict.signal
        elif verdict.status == "PASS":
            result.extra.pop("signal", None)
        result.extra.update(fields.extra)
        result.details.update(fields.details)

    @property
    def output_folder(self) -> Path | None:
        return Path(self.output_dir) if self.output_dir else None
