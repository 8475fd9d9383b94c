"""The supervisor's side of securing: the loop's hooks around one securing plan (``guard.secure.plan``).

The supervisor calls these hooks from its one loop (``tick``, ``on_signal``, ``on_checkpoint_saved``,
``on_decided``, ``on_taint``, ``on_job_exit`` ...); each turns what happened into ``guard.secure.events`` events
for ``Plan.on``, and ``actions.Actions`` carries out the answer. None blocks: pushes run in worker processes
(``guard.secure.worker``) that the plan polls and kills at ``secure_by``; every file system call runs on the file
system thread (``guard.secure.scans``), its answer handled on a later turn. ``Securing`` holds its parts, each with
its own state: ``intake.Intake`` (the job's saves, from the agents' messages to ``CheckpointSeen``),
``folder.Folder`` (the output folder, its scans, at most one in flight, and the waits for a fresh one:
``waits.ScanWaits``, ``FS_WAIT_S`` at most), ``peers.Peers`` (this node among the job's nodes) and
``actions.Actions``. Nothing here reads or writes the plan's state: ``finish`` fills the VERDICT's ``checkpoint=``,
``pushed=``, ``secured=`` and the exit code of a deadline or signal from ``Plan.report()`` through
``guard.secure.outcome.fill`` (``CONTRACT.md``, "Secured checkpoints").
"""

from __future__ import annotations

import logging
import math
import signal
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from guard.contract import RunResult
from guard.core.helpers import FS_HELPERS, Submitter
from guard.core.state import Message, Outcome
from guard.errors import GuardError
from guard.secure import budget, checkpoints, scans, worker
from guard.secure.actions import Actions
from guard.secure.asking import can_save, job_end
from guard.secure.cadence import PUSH_STALL_S, background_said
from guard.secure.events import (
    AlreadySecured,
    DeadlineMoved,
    DeadlineNear,
    DestinationKnown,
    Failure,
    JobExited,
    Pusher,
    ReadThrough,
    RunOver,
    SignalReceived,
    Tainted,
    Tick,
    TrainingStarted,
)
from guard.secure.folder import Folder
from guard.secure.intake import FILE_SETTLE_S, Intake
from guard.secure.link import EndTimeSource, JobLink
from guard.secure.meeting import RECORD_CUTOFF_S
from guard.secure.outcome import fill
from guard.secure.peers import Peers
from guard.secure.plan import Plan, State
from guard.secure.waits import Then

if TYPE_CHECKING:
    from guard.secure.securer import Securer

__all__ = ["FAILURE_REASONS", "Securing"]

log = logging.getLogger("guard.secure")

#: Outcomes after which the newest complete checkpoint saved before the failure is secured.
FAILURE_REASONS = ("non_finite_loss", "stalled", "crash", "oom", "killed", "incomplete")
SCAN_EVERY_S = 5.0  # how often the output folder is looked at for complete checkpoints
STABLE_FOR_S = checkpoints.STABLE_FOR_S  # the scans' settle rule (seconds)


class Securing:
    """Hooks for the supervisor's loop around one ``Plan``; each hook gets the loop as a :class:`JobLink`.

    Args:
        deadline: the job's deadline (``budget.resolve_deadline``); ``deadline_s`` None without a limit.
        estimator: the margin estimator (``--margin`` fixed, or measured).
        securer: a ``securer.Securer`` for the destination (its ``destination`` and ``token`` are what the workers
            use), or None (no destination yet: the Trainer's ``hub_model_id`` may provide one).
        securer_factory: builds a ``Securer`` from destination text (for the Trainer's ``hub_model_id``).
        output_dir: where the job writes checkpoints (``--output-dir``; else the Trainer's ``output_dir``).
        grace_s: ``--grace``. background: ``--background-push``. push_interval_s: ``--push-interval``, or None:
            from the destination and the measured push time (``cadence.background_interval_s``).
        final_window_s: ``--final-push-window`` (securing after a good end with no deadline).
        push_stall_s: ``--push-stall``: a push with no progress for this long is replaced by a newer checkpoint's
            (``cadence.PUSH_STALL_S`` by default; 0: off).
        refresher: a ``guard.run.slurm.SlurmRefresher`` (any ``EndTimeSource``) or None.
        wall: epoch seconds; clock: monotonic seconds.
        pusher_factory: builds the plan's pusher from (destination text, token); default ``worker.Pusher``.
        fs: where the file system calls run (default ``FS_HELPERS``' thread; tests pass one that runs them inline).
        stat: ``os.stat``-like callable for the scans and the saves' descriptions (default ``os.stat``): the seam
            through which tests make a scan block.
        run_id: this run's id (``SecureSettings.run_id``): it names the run's taint and suspect markers
            (``guard.secure.suspects``) and, many nodes, the nodes' parts at the destination; default: the
            securer's, else a new one.
        own_run_id: ``run_id`` is this node's own (no launcher or scheduler gave every node one): node 0's guard's,
            read from the job's store, replaces it (``peers.Peers.adopt_run_id``). run_id_taken: called with node 0's
            run id when it does (the output folder's probe moves to that run: ``SharingProbe.adopt``), or None.
        node_rank, nodes: this node's index and the job's node count (``SecureSettings``; default one node).
        shared: ``() -> bool | None``: whether the nodes share the output folder (``guard.secure.sharing``'s
            answer; None while unknown). Many nodes on folders of their own secure each node's part
            (``peers.Peers.parts_mode``). ``peers`` holds this node's part in the job (a :class:`peers.Peers`).

    Without ``output_dir`` the output folder is the one of the job's newest save (``layout.output_dir_of_save``),
    followed from save to save (never locked onto the first): the final model is pushed from there.
    """

    def __init__(self, *, deadline: budget.Deadline, estimator: budget.MarginEstimator, securer: Securer | None = None,
                 securer_factory: Callable[[str], Securer] | None = None, output_dir: str | None = None,
                 grace_s: float = 30.0, refresher: EndTimeSource | None = None,
                 wall: Callable[[], float] = time.time,
                 clock: Callable[[], float] = time.monotonic, background: bool = True,
                 push_interval_s: float | None = 600.0, final_window_s: float = 180.0,
                 pusher_factory: Callable[[str, str | None], Pusher] | None = None,
                 push_stall_s: float = PUSH_STALL_S,
                 fs: Submitter | None = None, stat: checkpoints.StatFn | None = None,
                 run_id: str | None = None, node_rank: int = 0, nodes: int = 1, own_run_id: bool = False,
                 run_id_taken: Callable[[str], None] | None = None,
                 shared: Callable[[], bool | None] = lambda: None) -> None:
        self.deadline = deadline
        self.estimator = estimator
        self.securer = securer
        self.securer_factory = securer_factory
        self.refresher = refresher
        self.wall, self.clock = wall, clock
        # this node among the job's nodes: parts mode, node 0's run id, the following of node 0's steps
        self.peers = peers = Peers(
            securer=lambda: self.securer, run_id=run_id or getattr(securer, "run_id", None) or uuid.uuid4().hex[:12],
            own_run_id=own_run_id, run_id_taken=run_id_taken, node_rank=node_rank, nodes=nodes, shared=shared,
            to_plan=lambda info, requested: self.intake.to_plan(self._link, info, self.clock(), requested),
            lookup=lambda step: self.folder.look_for_part(step), limit_s=self._listing_limit_s)
        self._pusher_factory: Callable[[str, str | None], Pusher] = pusher_factory or (
            lambda dest, token: worker.Pusher(dest, token, clock=clock, run_id=peers.dest_run_id,
                                              node_rank=peers.node_rank,
                                              nodes=lambda: peers.nodes if peers.parts_mode() else 1))
        self.disk = scans.Disk(stat) if stat is not None else scans.Disk()  # owned by the file system thread
        self.port = scans.Port(fs if fs is not None else FS_HELPERS)
        self._link: JobLink | None = None  # the loop, as the last hook got it (for answers handed back)
        # the job's saves, from the agents' messages to checkpoints
        self.intake = Intake(port=self.port, disk=self.disk, estimator=estimator, peers=peers, clock=clock, wall=wall,
                             output_dir=lambda: self.output_dir, saved_in=self._saved_in,
                             feed=lambda sup, event, now: self.actions.feed(sup, event, now),
                             known=lambda info: self.folder.known(info), check_node=self._check_node,
                             link=lambda: self._link, pump=self._pump)
        # the output folder (given or followed), its scans, the run's taint beside it
        self.folder = folder = Folder(output_dir, port=self.port, disk=self.disk, wall=wall, run_id=lambda: self.run_id,
                                      link=lambda: self._link, intake=self.intake, peers=peers,
                                      loose=lambda: not self.trainer_seen, found=self.intake.scan_found,
                                      feed=lambda event: self.actions.feed(self._link, event))
        self._final_window_s = final_window_s
        self.plan = Plan(clock=clock, pusher=self._make_pusher(securer), estimator=estimator,
                         deadline_at=self._to_clock(deadline.deadline_s), grace_s=grace_s, background=background,
                         push_interval_s=push_interval_s, final_output_dir=output_dir, final_window_s=final_window_s,
                         unchanged=folder.still_unchanged,
                         destination_kind=peers.cadence_kind(securer), stall_s=push_stall_s, nodes=peers.nodes)
        self.last_step_at: float | None = None
        self.trainer_seen = False
        self.next_scan = -math.inf
        self._training_seen = False
        # the plan's actions carried out (the loop's, the file system thread's, the output folder's)
        self.actions = Actions(self.plan, port=self.port, folder=folder, peers=peers, securer=lambda: self.securer,
                               clock=clock)
        if deadline.deadline_s is not None:
            log.info("deadline: %s (%s from now; %s)", time.strftime("%Y-%m-%d %H:%M:%S %Z",
                     time.localtime(deadline.deadline_s)),
                     budget.format_duration_s(round(deadline.deadline_s - wall())), deadline.source)
            estimator.margin_s()  # logs the starting margin
        if self.plan.has_pusher:
            every = background_said(peers.cadence_kind(securer), push_interval_s=push_interval_s, nodes=peers.nodes)
            log.info("background securing: %s", f"on, {every}" if background else "off (--background-push off)")

    # -- helpers ----------------------------------------------------------------------------------------------

    def _make_pusher(self, securer: Securer | None) -> Pusher | None:
        if securer is None:
            return None
        return self._pusher_factory(str(securer.destination), getattr(securer, "token", None))

    def _listing_limit_s(self) -> float:
        """The longest time between two of this node's listings for node 0's parts, whatever their backoff
        (``follow``): a quarter of the time left before the deadline's save is asked for (none without a
        deadline); 0 once securing has begun (the deadline's save, a signal) or another node's request to save and
        stop came, or the job's good end waits for node 0's part (``_end_follows``): from then on the listings come
        every ``LIST_EVERY_S`` (or the Hub's interval), as they always did, so that this node's part of the last
        step is in before the deadline (or the final window) less the record's time."""
        if self.plan.busy or self.peers.relayed or self.peers.end_awaits:
            return 0.0
        deadline_at = self._to_clock(self.deadline.deadline_s)
        if deadline_at is None:
            return math.inf
        return max(0.0, (deadline_at - self.estimator.margin_s() - self.clock()) / 4)

    # -- the file system thread's answers -------------------------------------------------------------------

    def _pump(self, sup: JobLink | None, now: float) -> None:
        """Hand back the file system calls that finished, then the holds that may go on (``waits.ScanWaits.pump``).
        Never waits."""
        if sup is not None:
            self._link = sup
        self.folder.waits.pump(now)

    def _hold(self, sup: JobLink, what: str, then: Then, now: float, *, final: bool = False,
              settle_at: float | None = None, stable_for_s: float = STABLE_FOR_S) -> None:
        """``then`` once a fresh scan answered, ``FS_WAIT_S`` at most (``waits.ScanWaits.hold``)."""
        self.folder.waits.hold(what, then, now, lambda: self.plan.secure_by, final=final, settle_at=settle_at,
                               stable_for_s=stable_for_s)
        self._pump(sup, now)

    def resumed_from(self, info: checkpoints.CheckpointInfo, *, destination: str | None, revision: str) -> None:
        """The run resumes from ``info`` (before the job starts): it is this run's newest checkpoint until the job
        reports a newer one. ``destination``: where it was fetched from, verified (the destination already holds
        it, at ``revision``); None for the output folder's own copy."""
        self.intake.latest_reported = info
        if destination is not None:
            self.actions.feed(None, AlreadySecured(info, destination, revision))

    def _to_clock(self, epoch_s: float | None) -> float | None:
        return None if epoch_s is None else self.clock() + (epoch_s - self.wall())

    def busy(self) -> bool:
        """Securing has started and is not finished, or a failure or the job's end waits for a scan (the supervisor
        keeps running until neither)."""
        return self.plan.busy or bool(self.folder.waits.holds) or bool(self.peers.end_awaits)

    def due_at(self, now: float) -> float:
        """The next time ``tick`` has work (monotonic seconds)."""
        due = [self.plan.due_at(now)]
        if self.intake.pending_file is not None:
            due.append(self.intake.pending_file[1] + FILE_SETTLE_S)
        if self.refresher is not None and self.plan.state is State.WATCHING:
            due.append(now + 60.0)
        if self._scanning():
            due.append(self.next_scan)
        if self.peers.follower is not None:
            due.append(self.peers.follower.due_at(now))
        held = self.folder.waits.due_at()
        if held is not None:
            due.append(held)
        return min(due)

    def _scanning(self) -> bool:
        return bool(self.output_dir) and self.plan.state in (State.WATCHING, State.AWAITING_SAVE, State.SECURING)

    def before_start(self, started_wall_s: float | None = None) -> None:
        """When the job starts: a complete checkpoint already in the output folder gives the margin a size.

        ``started_wall_s``: wall-clock seconds just before the job was started (``JobStart.started_wall_s``);
        default now. Files written from then on are this run's."""
        # this run's checkpoints: written from now on, or the one it resumed from (checkpoints.newest_complete)
        self.folder.started(self.wall() if started_wall_s is None else started_wall_s, self.intake.latest_reported)
        if not self.output_dir or self.intake.latest_reported is not None:
            return

        def sized(size_bytes: object, error: BaseException | None) -> None:
            if isinstance(size_bytes, int):
                self.estimator.observe_size(size_bytes)

        self.port.submit(self.disk.size_of_newest, self.output_dir, self.wall(), apply=sized)

    def _check_node(self, sup: JobLink) -> None:
        if self.peers.other_node_secures(sup, self.plan.has_pusher):
            self.actions.feed(sup, DestinationKnown(None))

    # -- hooks ------------------------------------------------------------------------------------------------

    def tick(self, sup: JobLink, now: float) -> None:
        self._pump(sup, now)
        self._check_node(sup)
        if self.refresher is not None and self.plan.state is State.WATCHING:
            end_s = self.refresher.maybe_refresh(self.wall())
            if end_s is not None:
                moved = self.deadline.refreshed(end_s, self.refresher.last_source or "scontrol EndTime")
                if moved.deadline_s != self.deadline.deadline_s:
                    log.info("deadline moved to %s (%s)", time.strftime("%H:%M:%S", time.localtime(moved.deadline_s)),
                             moved.source)
                    self.deadline = moved
                    self.actions.feed(sup, DeadlineMoved(self._to_clock(moved.deadline_s)), now)
        self._settle(sup, now)
        if self.peers.tick(now):  # the job's end waited for node 0's part: over
            self._job_exited(sup, now)
        if self.intake.reports.awaiting:
            self.intake.complete_reports(sup)  # a rank that trained on past a save without reporting it had no part
        if self._scanning() and now >= self.next_scan:
            self.next_scan = now + SCAN_EVERY_S
            if self.folder.waits.in_flight:  # never a second one: the first may be stuck in stat() on a hung mount
                log.debug("the scan of %s has not returned yet: none started", self.output_dir)
            else:
                self._scan(sup)
        if sup.state.progress.step is not None:
            self._training_started(sup, now)  # a step was seen: the deadline's request follows the margin
        if sup.job_running() and sup.state.outcome is None and self.plan.deadline_due(now):
            self._deadline_near(sup, now)
        self.actions.feed(sup, Tick(), now)

    def _training_started(self, sup: JobLink, now: float) -> None:
        if not self._training_seen:
            self._training_seen = True
            self.actions.feed(sup, TrainingStarted(), now)

    def _scan(self, sup: JobLink) -> None:
        """Look for a complete checkpoint in the output folder the job did not report
        (``checkpoints.newest_complete``, on the file system thread); its answer is handled when it comes."""
        self.folder.waits.request()
        self._pump(sup, self.clock())

    def _deadline_near(self, sup: JobLink, now: float) -> None:
        """Feed the plan the deadline's ``DeadlineNear`` (this node's own, or node 0's relayed)."""
        self.actions.feed(sup, DeadlineNear(can_save=can_save(sup), handles_term=sup.state.facts.handles_sigterm),
                   now)

    @property
    def run_id(self) -> str:
        """This run's id: node 0's guard's once adopted (``peers.Peers.adopt_run_id``)."""
        return self.peers.run_id

    def on_relayed_deadline(self, sup: JobLink, now: float) -> bool:
        """Many nodes: node 0's guard asked every rank to save and stop for its deadline (its margin is its own: its
        push moves the record), before this node's own deadline request was due: handled as this node's deadline,
        so that its part of that step is secured and its VERDICT says ``TIMEOUT`` as node 0's does. False when the
        plan is past watching (it decided already)."""
        if self.plan.state is not State.WATCHING or sup.state.outcome is not None:
            return False
        self._deadline_near(sup, now)
        return True

    def on_signal(self, sup: JobLink, signum: int, now: float) -> bool:
        """Feed a termination signal to the plan; False lets the supervisor handle it (no destination, or done)."""
        if signum == signal.SIGHUP or self.plan.state is State.DONE:
            return False
        if not self.plan.has_pusher and self.plan.state is State.WATCHING:
            return False
        if self.plan.state is State.WATCHING and sup.state.outcome is not None:
            return False
        self.actions.feed(sup, SignalReceived(signum, can_save=can_save(sup)), now)
        return True

    def on_model_size(self, size_bytes: int) -> None:
        """The job built its optimizer over ``size_bytes``' worth of weights and optimizer state (the agent's
        estimate): the checkpoint size the margin assumes until a save measures the real one (never over a size
        already known: the Trainer's estimate, a checkpoint on disk)."""
        if self.estimator.expect_size(size_bytes):
            log.debug("checkpoint size before the first save: about %.1f MB (the optimizer's weights and state)",
                      size_bytes / 1e6)

    def on_trainer_config(self, config: dict[str, Any]) -> None:
        """The Trainer's arguments: its ``output_dir``, and its ``hub_model_id`` as the destination when
        ``push_to_hub`` is on and ``--push-to`` gave none."""
        self.trainer_seen = True
        estimate = config.get("checkpoint_bytes_estimate")
        if isinstance(estimate, int) and self.estimator.expect_size(estimate):  # until a save measures it
            log.debug("checkpoint size before the first save: about %.1f MB (weights + AdamW state)", estimate / 1e6)
        if not self.folder.given and config.get("output_dir"):
            self.folder.given = True
            self.folder.new_folder(str(config["output_dir"]))
        if self.securer is None and config.get("push_to_hub") and config.get("hub_model_id") and self.securer_factory:
            try:
                self.securer = self.securer_factory(str(config["hub_model_id"]))
                if self.peers.nodes > 1:
                    self.securer.run_id = self.run_id  # node 0's, when taken already (Peers.adopt_run_id)
                self.actions.feed(None, DestinationKnown(self._make_pusher(self.securer),
                                                  kind=self.peers.cadence_kind(self.securer)))
                log.info("destination from the Trainer: %s (push_to_hub, hub_model_id)", self.securer.destination)
            except GuardError as exc:
                log.warning("cannot use the Trainer's hub_model_id as a destination: %s", exc.message)

    def on_step(self, sup: JobLink, now: float) -> None:
        """A training step of the primary rank (step times for the margin)."""
        self._training_started(sup, now)
        if self.last_step_at is not None:
            self.estimator.observe_step(now - self.last_step_at)
        self.last_step_at = now
        progress = sup.state.progress
        if progress.loss_source == "agent" and progress.step is not None:
            # this read was finite (only those are counted): the losses are read through the slowest rank's step
            steps = sup.rank_steps()
            self.actions.feed(sup, ReadThrough(min(steps.values()) if steps else progress.step), now)

    def on_file_saved(self, sup: JobLink, message: Message) -> None:
        """The agent saw ``torch.save`` write a file (``intake.Intake.on_file_saved``)."""
        self.intake.on_file_saved(sup, message)

    def _saved_in(self, folder: str) -> None:
        """Rank 0 saved with ``torch.save`` in ``folder``: the output folder follows the job's newest save, unless
        one was given (``--output-dir``, the Trainer's)."""
        if self.folder.given or folder == self.output_dir:
            return
        first = self.output_dir is None
        self.folder.new_folder(folder)
        log.log(logging.INFO if first else logging.DEBUG, "output folder: %s (where the job %s with torch.save)",
                self.output_dir, "saves" if first else "saved last")

    def _settle(self, sup: JobLink, now: float, *, force: bool = False) -> None:
        self.intake.settle(sup, now, force=force)

    def on_checkpoint_saved(self, sup: JobLink, message: Message) -> None:
        """The job reported a finished save (``intake.Intake.on_checkpoint_saved``)."""
        self.intake.on_checkpoint_saved(sup, message)

    def push_running(self) -> bool:
        """A push that ends the run (securing a failure, a deadline, a signal) is under way."""
        return self.plan.push_running()

    def on_decided(self, sup: JobLink, outcome: Outcome) -> None:
        """The supervisor decided a failure (non-finite loss, stall ...): secure what was saved before it."""
        if outcome.reason not in FAILURE_REASONS:
            return
        now = self.clock()
        self._pump(sup, now)
        self._settle(sup, now, force=True)
        bad = sup.state.progress.step if outcome.reason == "non_finite_loss" else None
        if bad is not None:
            witness = "grad_norm" if sup.state.progress.witness == "grad_norm" else "loss"
            self.actions.feed(sup, Tainted(bad, witness=witness))
        reason = outcome.reason

        def fail(link: JobLink | None, at: float) -> None:
            if link is not None:
                self._settle(link, at, force=True)
            self.actions.feed(link, Failure(reason, at=now), at)

        if reason == "non_finite_loss" and self.folder.fed:
            # at once, with the checkpoints known: the supervisor pauses the job while that push runs (a job told
            # to stop may save the non-finite weights over it); the fresh scan's answer follows as CheckpointSeen
            fail(sup, now)
            self._scan(sup)
        else:  # the newest checkpoint may be one saved since the last scan: wait for a fresh one (bounded)
            self._hold(sup, f"securing after the failure ({reason}) goes on", fail, now)

    def on_taint(self, sup: JobLink, step: int) -> None:
        """A non-finite loss from ``step`` on, heard after another outcome was decided (a deadline, a signal): the
        saves from then on are suspect whatever is under way."""
        self._settle(sup, self.clock(), force=True)
        self.actions.feed(sup, Tainted(step))

    def on_job_exit(self, sup: JobLink, now: float) -> None:
        """The job's main process exited: a failure secures what it saved, a finished training pushes the final
        model (a PASS, even after the deadline's request). With an output folder, after a final scan of it (the
        newest checkpoint, the final model files) on the file system thread, ``FS_WAIT_S`` at most."""
        self._pump(sup, now)
        self._settle(sup, now, force=True)
        if self.output_dir:
            settle_at = None
            code = sup.job_exit_code()
            gone = not sup.job_alive()  # no process of the job is left: nothing is still being written
            if self.plan.state in (State.SECURING, State.AWAITING_SAVE) and code != 0:
                # stopped while securing (a signal, the deadline): a save of a format the guard cannot check (or,
                # while some of its processes run, any save) may be too fresh for the scan's settle rule
                # (``checkpoints.newest_complete``'s 2 s) right now; scan again once it settled, within half of the
                # time left (the scan's answer now is taken at once all the same)
                settle_at = now + min(STABLE_FOR_S + 0.1, max(0.0, self.plan.secure_by - now) / 2)
            # exit 0, or no process of the job left: nothing writes any more, so a save made just before the exit
            # needs no settle time; the completion rules and the format checks judge it (a save cut short by a
            # kill fails them)
            self._hold(sup, "the job's end is handled", self._job_exited, now, final=True, settle_at=settle_at,
                       stable_for_s=0.0 if code == 0 or gone else STABLE_FOR_S)
        else:
            self._job_exited(sup, now)

    def _job_exited(self, link: JobLink | None, now: float) -> None:
        sup = link if link is not None else self._link
        assert sup is not None
        self._settle(sup, now, force=True)
        final_model = bool(self.folder.final_model)  # the exit's scan; unknown (no answer): none
        end = job_end(sup, watching=self.plan.state is State.WATCHING, final_model=final_model,
                      signalled=self.actions.signalled)
        if end.failure is not None:
            self.actions.feed(sup, Failure(end.failure), now)
            return
        ok, complete, outcome = end.ok, end.complete, sup.state.outcome
        if ok and outcome is None and self._end_follows(now):
            return
        self._check_node(sup)
        if ok and sup.node_rank not in (None, 0) and self.securer is not None:
            log.info("node %d: the guard of node 0 pushes the final model", sup.node_rank)
            self.peers.node_0_pushes_final = True
        has_final_model = not (ok and self.output_dir) or final_model
        self.actions.feed(sup, JobExited(ok=(ok and outcome is None) or complete, complete=complete,
                                         has_final_model=has_final_model, final_files=self.folder.final_files,
                                         final_by_node_0=self.peers.node_0_pushes_final and self.peers.parts_mode()),
                          now)

    def _end_follows(self, now: float) -> bool:
        """Whether the job's good end waits (once) for node 0's part of this node's last save
        (``peers.Peers.end_follows``), leaving this node's push and the record's move their time in the final
        window (``--final-push-window``), before any deadline."""
        def window_s() -> float:
            return max(self._final_window_s / 2,
                       self._final_window_s - self.estimator.secure_estimate_s() - RECORD_CUTOFF_S)

        return self.peers.end_follows(now, watching=self.plan.state is State.WATCHING,
                                      secure_by=self.plan.secure_by, window_s=window_s)

    # -- the verdict ------------------------------------------------------------------------------------------

    def finish(self, result: RunResult, *, step: int | None) -> None:
        """Fill the result's checkpoint fields, and its exit code for TIMEOUT/INTERRUPTED (75 when secured), from
        the plan's report (``outcome.fill``).

        Args:
            result: the run's result, changed in place.
            step: the job's last training step (the steps lost after the secured checkpoint), or None.
        """
        self.actions.feed(None, RunOver())
        report = self.plan.report()
        follower = self.peers.follower
        fill(result, report, step=step, output_dir=self.output_dir,
             destination_given=self.securer is not None or report.trigger == "signal",
             holds_files=self.folder.holds_files, follower=self.peers.follows_node_0,
             unled_step=follower.unled_step if follower is not None else None)

    @property
    def output_dir(self) -> str | None:
        """The run's output folder now (``folder.Folder.output_dir``), or None."""
        return self.folder.output_dir
