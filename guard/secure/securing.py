"""The supervisor's side of securing: a translator from the loop's events to the plan's, and the executor of the
actions the plan returns.

The supervisor calls these hooks from its one loop (``tick``, ``on_signal``, ``on_checkpoint_saved``,
``on_decided``, ``on_taint``, ``on_job_exit`` ...); each turns what happened into ``guard.secure.events`` events
for ``Plan.on`` and carries out the answer. None blocks: pushes run in worker processes (``guard.secure.worker``)
that the plan polls and kills at ``secure_by``; every file system call (the output folder's scans, the description
of a reported save, the files ``torch.save`` wrote, the rewrite checks, the final model's listing, the suspect
markers) runs on the file system thread (``guard.secure.scans``), its answer handled on a later turn. At most one
scan is in flight; a failure and the job's end wait for a fresh scan ``FS_WAIT_S`` at most, then go on without it.
Nothing here reads or writes the plan's state: ``finish`` fills the VERDICT's ``checkpoint=``, ``pushed=``,
``secured=`` and the exit code of a deadline or signal from ``Plan.report()`` through
``guard.secure.outcome.checkpoint_fields`` (``CONTRACT.md``, "Secured checkpoints").
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from guard.contract import RunResult, signal_name
from guard.core.durations import step_text
from guard.core.helpers import FS_HELPERS, Submitter
from guard.core.state import Message, Outcome, RunState, died_after_training, incomplete_reason
from guard.errors import GuardError
from guard.secure import budget, checkpoints, layout, scans, snapshots, suspects, worker
from guard.secure.cadence import PUSH_STALL_S, PUSH_TIME_FACTOR, background_interval_s, listing_interval_s
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
    LookedOlder,
    LookOlder,
    MarkSuspect,
    OutputDirKnown,
    Pusher,
    ReadThrough,
    RecordTaint,
    ReleaseKept,
    RequestSave,
    RunOver,
    SignalReceived,
    StopJob,
    Tainted,
    Tick,
    TrainingStarted,
)
from guard.secure.follow import LIST_EVERY_S, Follower
from guard.secure.meeting import RECORD_CUTOFF_S
from guard.secure.outcome import Verdict, checkpoint_fields, leader_missing
from guard.secure.plan import Plan, State

if TYPE_CHECKING:
    from guard.secure.securer import Securer

__all__ = ["FAILURE_REASONS", "FS_WAIT_S", "EndTimeSource", "JobLink", "Securing"]

log = logging.getLogger("guard.secure")

#: Outcomes after which the newest complete checkpoint saved before the failure is secured.
FAILURE_REASONS = ("non_finite_loss", "stalled", "crash", "oom", "killed", "incomplete")
SCAN_EVERY_S = 5.0  # how often the output folder is looked at for complete checkpoints
FILE_SETTLE_S = 1.0  # a torch.save'd file counts as a whole checkpoint after this long without another file
STABLE_FOR_S = checkpoints.STABLE_FOR_S  # the scans' settle rule (seconds)
FS_WAIT_S = 5.0  # how long a failure or the job's end waits for a fresh scan of the output folder (a hung mount)
LIST_BOUND_S = 5.0  # many nodes: one listing of the destination's parts takes this long at most
KNOWN_CHECKED = 16  # how many of the newest checkpoints fed to the plan each scan checks for a rewrite




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


@dataclass
class _Hold:
    """A hook's work that waits for the answer of scan number ``after``, or until ``until`` (clock seconds)."""

    after: int
    until: float
    what: str
    then: Callable[[JobLink | None, float], None]
    settle_at: float | None = None  # then a fresh scan is asked for (the job's last files settled), and waited for
    final: bool = False


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
            read from the job's store, replaces it (``adopt_run_id``). run_id_taken: called with node 0's run id
            when it does (the output folder's probe moves to that run: ``SharingProbe.adopt``), or None.
        node_rank, nodes: this node's index and the job's node count (``SecureSettings``; default one node).
        shared: ``() -> bool | None``: whether the nodes share the output folder (``guard.secure.sharing``'s
            answer; None while unknown). Many nodes on folders of their own secure each node's part (``parts_mode``).

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
        self.output_dir = output_dir
        self._output_given = output_dir is not None  # else the folder follows the job's saves
        self.run_id: str = run_id or getattr(securer, "run_id", None) or uuid.uuid4().hex[:12]
        self.own_run_id, self._run_id_taken = own_run_id, run_id_taken
        self._run_id_conflict_logged = False
        self._folders: list[str] = [output_dir] if output_dir else []  # every output folder of this run
        self._tainted_at: tuple[int, float] | None = None  # (first non-finite step, wall time heard)
        self.refresher = refresher
        self.wall, self.clock = wall, clock
        self.node_rank, self.nodes, self.shared = node_rank, max(1, nodes), shared
        self._pusher_factory: Callable[[str, str | None], Pusher] = pusher_factory or (
            lambda dest, token: worker.Pusher(dest, token, clock=clock, run_id=lambda: self._dest_run_id(),
                                              node_rank=self.node_rank,
                                              nodes=lambda: self.nodes if self.parts_mode() else 1))
        self.disk = scans.Disk(stat) if stat is not None else scans.Disk()  # owned by the file system thread
        self.port = scans.Port(fs if fs is not None else FS_HELPERS)
        self._link: JobLink | None = None  # the loop, as the last hook got it (for answers handed back)
        self._fed: list[checkpoints.CheckpointInfo] = []  # checkpoints fed to the plan, oldest first
        self._unchanged: dict[tuple[str, int | None, float], bool] = {}  # the last scan's rewrite checks
        self._scan_in_flight = False
        self._rescan: bool | None = None  # a scan is wanted once the one in flight returns (True: a final one)
        self._scans_asked = self._scans_done = 0
        self._holds: list[_Hold] = []
        self._pumping = False
        self._final_model: bool | None = None  # the output folder holds final model files (the exit's scan)
        self._holds_files: bool | None = None  # it holds any file (the exit's scan), for the VERDICT's hint
        self._final_files_found: tuple[str, ...] | None = None  # the final model's files when not the whole folder
        self._final_window_s = final_window_s
        self._end_awaits: bool | None = None  # the job's end waits for node 0's part (follow.Follower.end); once
        self.plan = Plan(clock=clock, pusher=self._make_pusher(securer), estimator=estimator,
                         deadline_at=self._to_clock(deadline.deadline_s), grace_s=grace_s, background=background,
                         push_interval_s=push_interval_s, final_output_dir=output_dir, final_window_s=final_window_s,
                         unchanged=self._still_unchanged,
                         destination_kind=self._cadence_kind(securer), stall_s=push_stall_s, nodes=self.nodes)
        self.latest_reported: checkpoints.CheckpointInfo | None = None
        self.last_step_at: float | None = None
        self.saved_ranks: dict[str, set[int]] = {}  # checkpoint path -> ranks that reported their part of it
        self.saving_ranks: set[int] = set()  # ranks that reported their parts of earlier complete checkpoints
        # reported by some ranks, not yet by every one (None: the world's process zero has not reported it yet)
        self.awaiting: dict[str, checkpoints.CheckpointInfo | None] = {}
        self._awaiting_logged: set[tuple[str, str]] = set()
        self._requested: dict[str, bool | None] = {}  # path -> the save answered the guard's request (rank 0's word)
        self.reported_paths: set[str] = set()  # folders every rank said it finished: no mtime rule for them
        self.trainer_seen = False
        self.pending_file: tuple[checkpoints.CheckpointInfo, float] | None = None  # a save that may still grow
        self.follower = False
        self._follower: Follower | None = None  # many nodes, not node 0: its parts follow node 0's steps
        self.node_0_secures = False  # another node's guard: node 0's secures the run's checkpoints and final model
        self.node_0_pushes_final = False  # another node's guard, its job ended well: node 0's pushes the final model
        self.next_scan = -math.inf
        self._node_checked = False
        self._save_logged = False
        self._training_seen = False
        self._signalled = False  # a signal was forwarded to the job: its end is no finished training
        self.relayed = False  # many nodes: every rank already has another node's request (guard/run/relay.py)
        self.started_s: float | None = None  # the job's start (epoch s): older checkpoints are an earlier run's
        self.resumed_paths: set[str] = set()
        self._not_finite: set[str] = set()  # paths (files and their folders) the agent saw saved with a bad tensor
        if deadline.deadline_s is not None:
            log.info("deadline: %s (%s from now; %s)", time.strftime("%Y-%m-%d %H:%M:%S %Z",
                     time.localtime(deadline.deadline_s)),
                     budget.format_duration_s(round(deadline.deadline_s - wall())), deadline.source)
            estimator.margin_s()  # logs the starting margin
        if self.plan.has_pusher:
            cadence = self._cadence_kind(securer)
            if push_interval_s is None and cadence in ("hub", "hub-parts"):
                least_s = background_interval_s(str(cadence), nodes=self.nodes)
                every = (f"at most one push every {budget.format_duration_s(least_s)}, longer "
                         f"when a push takes more than 1/{PUSH_TIME_FACTOR:.0f} of that (the Hub's commit rate limit)")
            elif push_interval_s:
                every = f"at most one push every {budget.format_duration_s(push_interval_s)}"
            else:
                every = "every complete save"
            log.info("background securing: %s", f"on, {every}" if background else "off (--background-push off)")

    # -- helpers ----------------------------------------------------------------------------------------------

    @staticmethod
    def _kind(securer: Securer | None) -> str | None:
        """``"folder"`` or ``"hub"``: where ``securer`` pushes, or None."""
        kind = getattr(getattr(securer, "destination", None), "kind", None)
        return kind if isinstance(kind, str) else None

    def _cadence_kind(self, securer: Securer | None) -> str | None:
        """The destination kind the background cadence follows (``cadence.background_interval_s``): ``"parts"``
        when many nodes secure their own parts of each checkpoint at S3 (every node pushes every complete save, so
        that all push the same steps); at a Hub repo ``"hub-parts"`` on node 0 (under its commit rate limit, each
        push being every node's commits and the record's) and ``"parts"`` on the others, which push only the steps
        node 0 put (``guard.secure.follow``): under an interval of their own, a part fed between two of node 0's
        pushes waited for the next one, and at the deadline for the save the job was asked for, past its time
        (node 1 held step 240 from 26.4 s to 2.3 s before its deadline); else the destination's."""
        kind = self._kind(securer)
        if kind == "hub" and self.nodes > 1 and self.shared() is not True:
            return "hub-parts" if self.node_rank == 0 else "parts"
        return "parts" if kind == "s3" and self.nodes > 1 else kind

    def _make_pusher(self, securer: Securer | None) -> Pusher | None:
        if securer is None:
            return None
        return self._pusher_factory(str(securer.destination), getattr(securer, "token", None))

    def _feed(self, sup: JobLink | None, event: Event, now: float | None = None) -> None:
        """One event to the plan; its actions carried out (``sup`` None: only actions that need no loop)."""
        actions = self.plan.on(event)
        if actions:
            self._carry_out(sup, actions, self.clock() if now is None else now)

    def _seen_checkpoint(self, sup: JobLink | None, info: checkpoints.CheckpointInfo, now: float | None = None, *,
                         requested: bool | None = None) -> None:
        """``CheckpointSeen(info, requested=...)`` to the plan; ``info`` is checked for a rewrite by the scans from
        now on."""
        if self.parts_mode() and self.node_rank != 0:
            if not info.part:
                log.debug("node %d: %s is whole on this node's disk: node 0's guard secures its own copy",
                          self.node_rank, info.path)
                return
            follower = self._following()
            if follower is not None:  # to the plan once node 0 put its part of that step (guard.secure.follow)
                follower.hold(info, requested)
                return
        self._to_plan(sup, info, now, requested)

    def _to_plan(self, sup: JobLink | None, info: checkpoints.CheckpointInfo, now: float | None,
                 requested: bool | None) -> None:
        self._fed.append(info)
        del self._fed[:-KNOWN_CHECKED]
        bad = self._not_finite
        finite = False if bad and (str(info.path) in bad or any(str(info.folder / rel) in bad for rel in info.files)) \
            else None
        self._feed(sup, CheckpointSeen(info, requested=requested, finite=finite), now)

    def _following(self) -> Follower | None:
        """This node's :class:`follow.Follower` (made on first use) when its store keeps node parts, else None."""
        if self._follower is None and self.securer is not None:
            securer = self.securer

            def list_steps() -> dict[int, set[int]]:  # on the destination's thread
                from guard.secure.dest.base import PartsStore

                store = securer.store
                if not isinstance(store, PartsStore):
                    return {}
                return store.part_steps(run_id=securer.run_id, deadline=time.monotonic() + LIST_BOUND_S)

            every_s = listing_interval_s(self._kind(securer) or "folder", nodes=self.nodes, least_s=LIST_EVERY_S)
            if every_s > LIST_EVERY_S:
                log.info("node %d lists %s for node 0's parts every %.1fs at most (the Hub's API rate limit, shared "
                         "by %d following nodes)", self.node_rank, securer.destination, every_s, self.nodes - 1)
            self._follower = Follower(list_steps, lambda info, requested: self._to_plan(
                self._link, info, self.clock(), requested), lookup=self._look_for_part, every_s=every_s,
                limit_s=self._listing_limit_s)
        return self._follower

    def _listing_limit_s(self) -> float:
        """The longest time between two of this node's listings for node 0's parts, whatever their backoff
        (``follow``): a quarter of the time left before the deadline's save is asked for (none without a
        deadline); 0 once securing has begun (the deadline's save, a signal) or another node's request to save and
        stop came, or the job's good end waits for node 0's part (``_end_follows``): from then on the listings come
        every ``LIST_EVERY_S`` (or the Hub's interval), as they always did, so that this node's part of the last
        step is in before the deadline (or the final window) less the record's time."""
        if self.plan.busy or self.relayed or self._end_awaits:
            return 0.0
        deadline_at = self._to_clock(self.deadline.deadline_s)
        if deadline_at is None:
            return math.inf
        return max(0.0, (deadline_at - self.estimator.margin_s() - self.clock()) / 4)

    def _still_unchanged(self, info: checkpoints.CheckpointInfo) -> bool:
        """The plan's ``unchanged``, answered on the loop without a stat: False when a checkpoint fed later shares
        a file with ``info`` and is newer (``ckpt.pt`` saved again in place), else the last scan's rewrite check
        (``checkpoints.rewritten_after``, on the file system thread), else True (not checked yet: a push of a
        rewritten file after a non-finite loss is refused by the push itself)."""
        files = {(info.folder, rel) for rel in info.files}
        for later in self._fed:
            if later.newest_mtime_s > info.newest_mtime_s + 1e-3 and files & {(later.folder, r) for r in later.files}:
                return False
        return self._unchanged.get(scans.key(info), True)

    # -- the file system thread's answers -------------------------------------------------------------------

    def _pump(self, sup: JobLink | None, now: float) -> None:
        """Hand back the file system calls that finished (in order), then the holds whose scan answered or whose
        wait is over. Never waits."""
        if sup is not None:
            self._link = sup
        if self._pumping:
            return  # an answer's own events: the loop outside goes on draining
        self._pumping = True
        try:
            self.port.drain()
            self._release(self._link, now)
        finally:
            self._pumping = False

    def _request_scan(self, *, final: bool = False, stable_for_s: float = STABLE_FOR_S) -> int:
        """Scan the output folder on the file system thread unless a scan is in flight (then one follows it);
        returns the number of the scan whose answer is fresh (``_scans_done`` reaches it)."""
        if not self.output_dir:
            return self._scans_done
        if self._scan_in_flight:
            self._rescan = bool(self._rescan) or final
            return self._scans_asked + 1
        self._scans_asked += 1
        number = self._scans_asked
        self._scan_in_flight = True
        self.port.submit(self.disk.scan, self._scan_asked(self.output_dir, final, stable_for_s),
                         apply=lambda value, error: self._scanned(number, value, error))
        return number

    def _scan_asked(self, output_dir: str, final: bool = False, stable_for_s: float = STABLE_FOR_S) -> scans.ScanAsked:
        """What a scan of ``output_dir`` needs from the loop (``scans.ScanAsked``)."""
        link = self._link
        waiting = tuple((path, self._waiting_reason(link, path, info)) for path, info in self.awaiting.items()) \
            if link is not None else ()
        if link is not None and link.job_exit_code() is not None and not link.job_alive():
            stable_for_s = 0.0  # the job's processes are gone: nothing is still being written, formats decide
        return scans.ScanAsked(output_dir, self.wall(), loose=not self.trainer_seen, since_s=self.started_s,
                               resumed=frozenset(self.resumed_paths), known=tuple(self._fed), final=final,
                               reported=frozenset(self.reported_paths),
                               world_size=link.world_size() if link is not None else 1, waiting=waiting,
                               stable_for_s=stable_for_s, run_id=self.run_id, parts=self.parts_mode())

    def _look_for_part(self, step: int) -> None:
        """Many nodes: look for this node's part of ``step`` (node 0 put its own) on the file system thread; found,
        it goes to the follower (``guard.secure.follow``)."""
        follower = self._follower
        if not self.output_dir or follower is None:
            return

        def found(value: object, error: BaseException | None) -> None:
            if isinstance(value, checkpoints.CheckpointInfo):
                follower.hold(value)

        self.port.submit(self.disk.part_at, self._scan_asked(self.output_dir), step, apply=found)

    def _look_older(self, action: LookOlder, now: float) -> None:
        """``LookOlder`` on the file system thread (``scans.Disk.older``); its answer goes to the plan as
        ``LookedOlder`` (None: none found, or a save the agent saw non-finite). Many nodes: none (a node's part
        is secured with the other nodes' parts of its step)."""
        def answer(value: object, error: BaseException | None) -> None:
            info = value if isinstance(value, checkpoints.CheckpointInfo) else None
            if error is not None:
                log.info("the look for a good checkpoint before step %d ended: %r", action.before_step, error)
            if info is not None and ({str(info.path)} | {str(info.folder / rel) for rel in info.files}) \
                    & self._not_finite:
                info = None
            if info is not None:
                self._fed.append(info)  # checked for a rewrite by the scans from now on
            self._feed(self._link, LookedOlder(info))

        if not self.output_dir or self.parts_mode():
            self.port.submit(lambda: None, apply=answer)
            return
        self.port.submit(self.disk.older, self._scan_asked(self.output_dir), action.before_step,
                         max(0.0, action.until - now), apply=answer)

    def _scanned(self, number: int, value: object, error: BaseException | None) -> None:
        """A scan's answer (on the loop): a complete checkpoint the job did not report becomes ``CheckpointSeen``."""
        self._scan_in_flight = False
        self._scans_done = number
        if error is not None and not isinstance(error, OSError):
            log.warning("the scan of %s failed: %r", self.output_dir, error)
        if isinstance(value, scans.ScanFound):
            self._unchanged.update(value.unchanged)
            if value.final_model is not None:
                self._final_model = value.final_model
            if value.holds_files is not None:
                self._holds_files = value.holds_files
            if value.final_model is not None:
                self._final_files_found = value.final_files
            for old, new in value.renamed:  # a save the agent saw non-finite stays so under its final name
                if old in self._not_finite:
                    self._not_finite.add(new)
            for followed in value.followed:  # saves under a temporary name, now under their own
                self._taken(followed)
            found = value.found
            if found is not None and (self.latest_reported is None or (found.step or -1) > (self.latest_reported.step
                                                                                          or -1)):
                self.awaiting.pop(str(found.path), None)  # complete by its layout (every rank's part is there)
                self.estimator.observe_size(found.size_bytes)
                self._seen_checkpoint(self._link, found)
        if self._rescan is not None:
            final, self._rescan = self._rescan, None
            self._request_scan(final=final)

    def _hold(self, sup: JobLink, what: str, then: Callable[[JobLink | None, float], None], now: float, *,
              final: bool = False, settle_at: float | None = None, stable_for_s: float = STABLE_FOR_S) -> None:
        """Run ``then`` once a scan started from now answered, or ``FS_WAIT_S`` from now (before ``secure_by``);
        with ``settle_at`` (clock seconds), once a second scan asked for at that time answered too."""
        after = self._request_scan(final=final, stable_for_s=stable_for_s)
        # FS_WAIT_S at most in all, the settle scan's wait included (a hung mount answers neither)
        self._holds.append(_Hold(after, min(now + FS_WAIT_S, max(now, self.plan.secure_by)), what, then,
                                 settle_at=settle_at, final=final))
        self._pump(sup, now)

    def _release(self, sup: JobLink | None, now: float) -> None:
        while self._holds:
            hold = self._holds[0]
            answered = self._scans_done >= hold.after
            if hold.settle_at is not None and now < hold.until:
                if now < hold.settle_at:
                    return
                self._holds[0] = dataclasses.replace(hold, after=self._request_scan(final=hold.final),
                                                     settle_at=None)
                continue
            if not answered and now < hold.until:
                return
            self._holds.pop(0)
            if not answered:
                log.warning("the output folder %s did not answer within %.0fs (a hung file system?): %s without "
                            "its scan", self.output_dir, FS_WAIT_S, hold.what)
            hold.then(sup, now)

    def resumed_from(self, info: checkpoints.CheckpointInfo, *, destination: str | None, revision: str) -> None:
        """The run resumes from ``info`` (before the job starts): it is this run's newest checkpoint until the job
        reports a newer one. ``destination``: where it was fetched from, verified (the destination already holds
        it, at ``revision``); None for the output folder's own copy."""
        self.latest_reported = info
        if destination is not None:
            self._feed(None, AlreadySecured(info, destination, revision))

    def _to_clock(self, epoch_s: float | None) -> float | None:
        return None if epoch_s is None else self.clock() + (epoch_s - self.wall())

    def busy(self) -> bool:
        """Securing has started and is not finished, or a failure or the job's end waits for a scan (the supervisor
        keeps running until neither)."""
        return self.plan.busy or bool(self._holds) or bool(self._end_awaits)

    def due_at(self, now: float) -> float:
        """The next time ``tick`` has work (monotonic seconds)."""
        due = [self.plan.due_at(now)]
        if self.pending_file is not None:
            due.append(self.pending_file[1] + FILE_SETTLE_S)
        if self.refresher is not None and self.plan.state is State.WATCHING:
            due.append(now + 60.0)
        if self._scanning():
            due.append(self.next_scan)
        if self._follower is not None:
            due.append(self._follower.due_at(now))
        if self._holds:
            hold = self._holds[0]
            due.append(hold.until if hold.settle_at is None else hold.settle_at)
        return min(due)

    def _scanning(self) -> bool:
        return bool(self.output_dir) and self.plan.state in (State.WATCHING, State.AWAITING_SAVE, State.SECURING)

    def before_start(self, started_wall_s: float | None = None) -> None:
        """When the job starts: a complete checkpoint already in the output folder gives the margin a size.

        ``started_wall_s``: wall-clock seconds just before the job was started (``JobStart.started_wall_s``);
        default now. Files written from then on are this run's."""
        # this run's checkpoints: written from now on, or the one it resumed from (checkpoints.newest_complete)
        self.started_s = self.wall() if started_wall_s is None else started_wall_s
        self.resumed_paths = {str(self.latest_reported.path)} if self.latest_reported is not None else set()
        for folder in self._folders:  # what other runs write here from now on is not theirs
            self.port.submit(scans.Disk.close_taints, folder, self.run_id, self.started_s)
        if not self.output_dir or self.latest_reported is not None:
            return

        def sized(size_bytes: object, error: BaseException | None) -> None:
            if isinstance(size_bytes, int):
                self.estimator.observe_size(size_bytes)

        self.port.submit(self.disk.size_of_newest, self.output_dir, self.wall(), apply=sized)

    def _can_save(self, sup: JobLink) -> bool:
        """The job can answer a checkpoint request: a Trainer, or a script that reported a save itself or called
        ``guard.should_checkpoint()`` (``JobFacts.answers_checkpoints``)."""
        if not sup.job_running() or not sup.agents_connected():
            return False
        step = sup.state.progress.step
        # Too early to tell: a Trainer reports itself at on_train_begin, a loop calls should_checkpoint() after its
        # first step's backward (which the agent reports first). Ask; the wait is bounded.
        return step is None or step < 3 or sup.state.facts.answers_checkpoints

    def parts_mode(self) -> bool:
        """Every node secures its own part of each checkpoint, the record moving once all are in
        (``securer.Securer``'s many-node push): many nodes, an output folder not known to be shared, and a destination
        whose store keeps node parts (a folder, S3, a Hub repo). Otherwise node 0's guard secures the checkpoints
        alone."""
        kind = getattr(getattr(self.securer, "destination", None), "kind", None)
        return self.nodes > 1 and kind in ("s3", "folder", "hub") and self.shared() is not True

    def _check_node(self, sup: JobLink) -> None:
        if self._node_checked or not self.plan.has_pusher or self.parts_mode():
            return
        node = sup.node_rank
        if node not in (None, 0):
            log.info("node %d: the guard of node 0 secures checkpoints; this one does not push", node)
            self.node_0_secures = True
            self._feed(sup, DestinationKnown(None))
            self._node_checked = True
        elif node == 0:
            self._node_checked = True
        # None: not known yet (the launcher's own agent says hello before the ranks do): asked again next time

    def _carry_out(self, sup: JobLink | None, actions: list[Action], now: float) -> None:
        for action in actions:
            if isinstance(action, MarkSuspect):
                self.port.submit(scans.Disk.mark_suspect, action.path, action.step, action.first_bad_step,
                                 self.run_id)
                continue
            if isinstance(action, ReleaseKept):
                if self.securer is not None:  # on the port: removing a folder is disk work
                    self.port.submit(self.securer.release_kept)
                continue
            if isinstance(action, RecordTaint):
                self._tainted_at = (action.first_bad_step, self.wall())
                self._record_taint(tuple(self._folders))
                continue
            if isinstance(action, LookOlder):
                self._look_older(action, now)
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
        # --- many nodes (guard/run/relay.py): another node's signal already asked every rank for one step ---
        if self.relayed:
            log.info("the job already saves at the step another node's guard asked for (a signal there); waiting "
                     "for that save")
            return
        # --- end many nodes ---
        if sup.follows_node_0:
            self.follower = True
            log.info("node %s: node 0's guard asks for the checkpoint (through the job's store); waiting for the "
                     "job to save and end", sup.node_rank)
            return
        request: dict[str, Any] = {"t": "checkpoint", "stop": True}
        report = self.plan.report()
        if report.trigger == "deadline":  # the other nodes' guards take it as their deadline (guard/run/relay.py)
            request["trigger"] = "deadline"
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
        if report.trigger == "signal" and report.signum is not None:
            # many nodes: the other nodes' agents adopt this request through the job's store; with the signal named
            # they tell their guards (``relayed``), which then say INTERRUPTED too, not PASS for a job that stopped
            request.update(origin=sup.node_rank, signal=signal_name(report.signum))
        sup.broadcast(request)

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
                    self._feed(sup, DeadlineMoved(self._to_clock(moved.deadline_s)), now)
        self._settle(sup, now)
        if self._follower is not None:
            self._follower.tick(now)
            if self._end_awaits and not self._follower.waiting(now):
                self._end_awaits = False
                self._job_exited(sup, now)
        if self.awaiting:
            self._complete_reports(sup)  # a rank that trained on past a save without reporting it had no part
        if self._scanning() and now >= self.next_scan:
            self.next_scan = now + SCAN_EVERY_S
            if self._scan_in_flight:  # never a second one: the first may be stuck in stat() on a hung mount
                log.debug("the scan of %s has not returned yet: none started", self.output_dir)
            else:
                self._scan(sup)
        if sup.state.progress.step is not None:
            self._training_started(sup, now)  # a step was seen: the deadline's request follows the margin
        if sup.job_running() and sup.state.outcome is None and self.plan.deadline_due(now):
            self._deadline_near(sup, now)
        self._feed(sup, Tick(), now)

    def _training_started(self, sup: JobLink, now: float) -> None:
        if not self._training_seen:
            self._training_seen = True
            self._feed(sup, TrainingStarted(), now)

    def _scan(self, sup: JobLink) -> None:
        """Look for a complete checkpoint in the output folder the job did not report
        (``checkpoints.newest_complete``, on the file system thread); its answer is handled when it comes."""
        self._request_scan()
        self._pump(sup, self.clock())

    def _deadline_near(self, sup: JobLink, now: float) -> None:
        """Feed the plan the deadline's ``DeadlineNear`` (this node's own, or node 0's relayed)."""
        self._feed(sup, DeadlineNear(can_save=self._can_save(sup), handles_term=sup.state.facts.handles_sigterm),
                   now)

    def _dest_run_id(self) -> str | None:
        """The run id this node's parts go under at the destination (the securer's, once there is one)."""
        return getattr(self.securer, "run_id", None)

    def adopt_run_id(self, run_id: str) -> bool:
        """Node 0's guard's run id, read from the job's store by this node's agents (``guard.inside.agent._dist``):
        it replaces this node's own (``own_run_id``: none was given to every node), for the run's taints and the
        nodes' parts at the destination, so that they meet with node 0's. A run id given (``--run-id``, the
        launcher's, the scheduler's) is kept, the difference warned about once. Returns whether it was taken.

        This node's parts wait for node 0's of the same step under the run id (``guard.secure.follow``), so none
        was put under the one replaced."""
        if not run_id or run_id == self.run_id:
            return False
        if not self.own_run_id or self.node_rank == 0:
            if not self._run_id_conflict_logged:
                self._run_id_conflict_logged = True
                log.warning("node 0's guard's run id is %s, this node's %s: the nodes' parts of one checkpoint do not "
                            "meet; give every node the same --run-id (or none: node 0's then reaches the others "
                            "through the job's store)", run_id, self.run_id)
            return False
        log.info("run id %s: node 0's guard's, through the job's store (in place of this node's own %s)", run_id,
                 self.run_id)
        self.run_id, self.own_run_id = run_id, False
        if self.securer is not None:
            self.securer.run_id = run_id
        if self._run_id_taken is not None:
            self._run_id_taken(run_id)
        return True

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
        self._feed(sup, SignalReceived(signum, can_save=self._can_save(sup)), now)
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
        if not self._output_given and config.get("output_dir"):
            self._output_given = True
            self._new_folder(str(config["output_dir"]))
        if self.securer is None and config.get("push_to_hub") and config.get("hub_model_id") and self.securer_factory:
            try:
                self.securer = self.securer_factory(str(config["hub_model_id"]))
                if self.nodes > 1:
                    self.securer.run_id = self.run_id  # node 0's, when taken already (adopt_run_id)
                self._feed(None, DestinationKnown(self._make_pusher(self.securer),
                                                  kind=self._cadence_kind(self.securer)))
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
            self._feed(sup, ReadThrough(min(steps.values()) if steps else progress.step), now)

    def on_file_saved(self, sup: JobLink, message: Message) -> None:
        """The agent saw ``torch.save`` write a file (a loop that may never use the guard's API): complete (the call
        returned), with the agent's step at the save; the files of one save form one checkpoint."""
        path = message.get("path")
        if not path:
            return
        self.port.submit(self.disk.file_saved, str(path), message.get("step"), self.output_dir, message.get("rank"),
                         snapshots.signature_of(message),
                         apply=lambda seen, error: self._file_seen(message, seen, error))
        self._pump(sup, self.clock())

    def _file_seen(self, message: Message, seen: object, error: BaseException | None) -> None:
        """``on_file_saved``'s answer from the file system thread (``scans.Disk.file_saved``)."""
        sup = self._link
        if not isinstance(seen, scans.FileSeen):
            log.debug("cannot look at the saved file %s: %r", message.get("path"), error)
            return
        if seen.output_dir is not None and not self._output_given and seen.output_dir != self.output_dir \
                and message.get("rank") in (None, 0):
            first = self.output_dir is None
            self._new_folder(seen.output_dir)
            log.log(logging.INFO if first else logging.DEBUG, "output folder: %s (where the job %s with "
                    "torch.save)", self.output_dir, "saves" if first else "saved last")
        info = seen.info
        if message.get("finite") is False:  # the agent saw a tensor of it that is not finite (file_saved)
            where = Path(str(message["path"]))
            folder = {str(where.parent)} if self.output_dir is None or where.parent != Path(self.output_dir) else set()
            self._not_finite |= {str(where), *folder} | (
                {str(info.path), *(str(info.folder / rel) for rel in info.files)} if info is not None else set())
            log.warning("the job saved %s with a tensor that is not finite (%s): never secured", where,
                        message.get("bad_tensor") or "?")
        if info is None:
            return
        if message.get("save_s"):
            self.estimator.observe_save(float(message["save_s"]), info.size_bytes)
        else:
            self.estimator.observe_size(info.size_bytes)
        if message.get("rank") not in (None, 0) and not (self.parts_mode() and self.node_rank != 0):
            return  # another rank's shard: rank 0's save names the checkpoint (on node 0: another node's ranks
            # name their node's part)
        # A loop may save model.pt, then optim.pt: the set is taken once the job trains on (a later step) or a
        # moment passes without another file (see _settle).
        self.pending_file = (info, self.clock())
        if sup is not None:
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
        if info.admitted_by == "saved-folder":
            # a checkpoint folder the job saved into and trained on past: judged whole now, on the file system
            # thread, by its completion files and formats (no settle time)
            self.port.submit(self.disk.saved_folder, info, self.wall(), sup.world_size(), self.parts_mode(),
                             apply=lambda found, error: self._taken(
                                 found if isinstance(found, checkpoints.CheckpointInfo) else None))
            self._pump(sup, now)
            return
        self._taken(info, now)

    def _taken(self, info: checkpoints.CheckpointInfo | None, now: float | None = None) -> None:
        """A save of the job taken as a checkpoint: this run's newest, to the plan."""
        if info is None:
            return
        sup = self._link
        self.latest_reported = info
        log.info("the job saved %s (%s, %.1f MB)", info.path, step_text(info.step), info.size_bytes / 1e6)
        if sup is not None:
            self._check_node(sup)
        self._seen_checkpoint(sup, info, now)

    def _new_folder(self, path: str) -> None:
        """The run's output folder is now ``path`` (given, the Trainer's, or that of the job's newest save): the
        final model is pushed from it and the scans look at it. A folder new to this run: other runs' open taints
        there end at this run's start, and this run's taint is recorded there too (``guard.secure.suspects``)."""
        self.output_dir = path
        self._feed(self._link, OutputDirKnown(path))
        if path in self._folders:
            return
        self._folders.append(path)
        if self.started_s is not None:
            self.port.submit(scans.Disk.close_taints, path, self.run_id, self.started_s)
        self._record_taint((path,))

    def _record_taint(self, folders: tuple[str, ...]) -> None:
        """Write this run's taint, once known, beside ``folders`` (on the file system thread)."""
        if self._tainted_at is None or not folders:
            return
        step, at = self._tainted_at
        taint = suspects.RunTaint(self.run_id, step, self.started_s if self.started_s is not None else at, at)
        self.port.submit(scans.Disk.record_taint, folders, taint)

    def on_checkpoint_saved(self, sup: JobLink, message: Message) -> None:
        """The job reported a finished save (``checkpoint_saved``, with the sender's ``rank``): its path is checked
        and described on the file system thread (``scans.Disk.reported``), the answer handled when it comes."""
        asked, parts = dict(message), self.parts_mode()
        if parts and self.node_rank != 0:
            asked["zero"] = True  # the world's process zero is on node 0: this node's ranks describe their part
        self.port.submit(functools.partial(self.disk.reported, parts=parts, world_size=sup.world_size()), asked,
                         self.output_dir, apply=lambda seen, error: self._reported(asked, seen, error))
        self._pump(sup, self.clock())

    def _reported(self, message: Message, seen: object, error: BaseException | None) -> None:
        """``on_checkpoint_saved``'s answer from the file system thread."""
        sup = self._link
        if not isinstance(seen, scans.ReportSeen):
            log.warning("cannot look at the checkpoint the job reported (%s): %r", message.get("path"), error)
            return
        if seen.path is None:
            refused = seen.refused
            if refused is not None:
                log.warning("%s (hint: %s)", refused.message, refused.hint)
            return
        path = seen.path
        rank = message.get("rank")
        parts = self.saved_ranks.setdefault(path, set())
        if rank is not None:
            parts.add(int(rank))
        if message.get("zero", True):
            saved = seen.info
            if saved is None:
                if seen.describe_error is not None:
                    log.warning("%s", seen.describe_error.message)
                return
            if message.get("save_s"):
                self.estimator.observe_save(float(message["save_s"]), saved.size_bytes)
            else:
                self.estimator.observe_size(saved.size_bytes)
            self.awaiting[path] = saved
            requested = message.get("requested")
            self._requested[path] = requested if isinstance(requested, bool) else None
            # The first save at INFO; later ones are counted in the heartbeat (``saves=``), their detail at DEBUG.
            first, self._save_logged = not self._save_logged, True
            log.log(logging.INFO if first else logging.DEBUG, "checkpoint saved by the job: %s (%s, %.1f MB)%s",
                    saved.path, step_text(saved.step), saved.size_bytes / 1e6,
                    "; later saves are counted in the heartbeat" if first else "")
        elif path not in self.awaiting and path not in self.reported_paths:
            self.awaiting[path] = None  # the world's process zero reports the checkpoint itself
        if sup is not None:
            self._complete_reports(sup)

    def _missing_ranks(self, sup: JobLink, path: str, info: checkpoints.CheckpointInfo) -> list[int]:
        """The ranks whose part of the reported checkpoint ``path`` is not reported yet.

        Expected are the ranks that reported their parts of earlier complete checkpoints; before the first one,
        every training rank, except one that trained on past the save's step without reporting it (a loop whose
        rank 0 alone saves and reports). One rank alone expects nothing more.
        """
        parts = self.saved_ranks.get(path, set())
        if self.saving_ranks:
            return sorted(self.saving_ranks - parts) if len(self.saving_ranks | parts) > 1 else []
        expected = sup.training_ranks() | parts
        if len(expected) <= 1:
            return []
        steps = sup.rank_steps()
        return sorted(r for r in expected - parts if info.step is None or steps.get(r, -1) <= info.step)

    def _waiting_reason(self, sup: JobLink, path: str, info: checkpoints.CheckpointInfo | None) -> str:
        missing = self._missing_ranks(sup, path, info) if info is not None else []
        if not missing:
            return "waiting for the report of the world's process zero"
        return f"waiting for rank(s) {','.join(map(str, missing))} to report their part"

    def _complete_reports(self, sup: JobLink) -> None:
        """Feed the plan the reported checkpoints whose every rank's part is reported, oldest first; a waiting one
        older than a complete one is dropped (the newer one is secured)."""
        done: list[tuple[str, checkpoints.CheckpointInfo]] = []
        for path, info in self.awaiting.items():
            if info is None:
                continue  # its description (the world's process zero's report) is still to come
            missing = self._missing_ranks(sup, path, info)
            if not missing:
                done.append((path, info))
            elif (path, str(missing)) not in self._awaiting_logged:
                self._awaiting_logged.add((path, str(missing)))
                log.info("checkpoint %s (%s): waiting for rank(s) %s to report their part; not pushed before",
                         path, step_text(info.step), ",".join(map(str, missing)))
        for path, info in sorted(done, key=lambda item: item[1].step if item[1].step is not None else -1):
            del self.awaiting[path]
            self.saving_ranks |= self.saved_ranks.get(path, set())
            self.reported_paths.add(path)
            requested = self._requested.pop(path, None)
            if len(self.saved_ranks.get(path, ())) > 1:
                # described at the world's process zero's report: the other ranks' files came after it (rank 1's
                # rng_state_1.pth), so the folder is described again (on the file system thread) now that every
                # part is there; answers come back in order, so the checkpoints still reach the plan oldest first
                self.port.submit(self.disk.describe, path, info.step, self.parts_mode(), sup.world_size(),
                                 apply=self._described(requested))
            else:
                self._parts_complete(info, None, requested)
        if done:
            step = max((info.step or -1) for _, info in done)
            for path, waiting in list(self.awaiting.items()):
                if waiting is not None and (waiting.step or -1) < step:
                    log.info("checkpoint %s: a newer one is complete; its missing parts are no longer waited for",
                             path)
                    del self.awaiting[path]

    def _described(self, requested: bool | None) -> Callable[[object, BaseException | None], None]:
        """The answer handler of a reported checkpoint described again once every rank's part is in."""
        def apply(value: object, error: BaseException | None) -> None:
            info = value if isinstance(value, checkpoints.CheckpointInfo) else None
            self._parts_complete(info, error, requested)
        return apply

    def _parts_complete(self, info: checkpoints.CheckpointInfo | None, error: BaseException | None,
                        requested: bool | None) -> None:
        """A reported checkpoint whose every rank's part is in, described: to the plan (``requested``: it answered
        the guard's request, the world's process zero's word)."""
        sup = self._link
        if info is None:
            log.warning("cannot describe the checkpoint every rank reported: %s",
                        error.message if isinstance(error, GuardError) else repr(error))
            return
        newest = self.latest_reported
        if newest is None or (info.step or -1) >= (newest.step or -1):
            self.latest_reported = info
        if sup is not None:
            self._check_node(sup)
        self._seen_checkpoint(sup, info, requested=requested)

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
            self._feed(sup, Tainted(bad))
        reason = outcome.reason

        def fail(link: JobLink | None, at: float) -> None:
            if link is not None:
                self._settle(link, at, force=True)
            self._feed(link, Failure(reason, at=now), at)

        if reason == "non_finite_loss" and self._fed:
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
        code = sup.job_exit_code()
        outcome = sup.state.outcome
        final_model = bool(self._final_model)  # the exit's scan; unknown (no answer): none
        completed = died_after_training(sup.state.facts, code, lambda: final_model) is not None
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
        if ok and outcome is None and self._end_follows(now):
            return
        self._check_node(sup)
        if ok and sup.node_rank not in (None, 0) and self.securer is not None:
            log.info("node %d: the guard of node 0 pushes the final model", sup.node_rank)
            self.node_0_pushes_final = True
        has_final_model = not (ok and self.output_dir) or final_model
        self._feed(sup, JobExited(ok=(ok and outcome is None) or complete, complete=complete,
                                  has_final_model=has_final_model, final_files=self._final_files_found), now)

    def _end_follows(self, now: float) -> bool:
        """A node other than 0 whose job ended well holds its part of a step node 0 has not put yet (its last save,
        as a rule): whether the job's end waits (once) until node 0's part of it is listed, so that this node's part
        follows and the record moves to it (``follow.Follower.end``). The wait is ``Follower.end_wait_s`` at most
        (node 0 pushing a final model puts no part), and leaves this node's push and the record's move their time in
        the final window (``--final-push-window``), before any deadline."""
        follower = self._follower
        if follower is None or self._end_awaits is not None or self.plan.state is not State.WATCHING:
            return False
        wait_s = min(follower.end_wait_s(), max(self._final_window_s / 2, self._final_window_s
                                                 - self.estimator.secure_estimate_s() - RECORD_CUTOFF_S))
        step = follower.end(min(now + wait_s, self.plan.secure_by))
        self._end_awaits = step is not None
        if step is not None:
            log.info("node %d: the job ended; its part of step %d waits for node 0's (%.0fs at most)",
                     self.node_rank, step, min(wait_s, self.plan.secure_by - now))
        return self._end_awaits

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
        # the exit's scan said whether the output folder holds any file; not looked at here (a hung mount): when it
        # did not answer, the hint names what the guard recognises
        nothing = layout.nothing_found_hint(output_dir=self.output_dir,
                                            destination_given=self.securer is not None or report.trigger == "signal",
                                            holds_files=self._holds_files is not False)
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
        # node 0's part of this node's newest never came, and the job failed (a lost node 0 fails the others' ranks
        # on their peer): at a deadline or a signal node 0 is there and chose the step (its record and the end's
        # listing say which), and a newer part held here is no news (before, a plain DCP loop on two nodes at the
        # deadline: node 0 secured_step=1400, node 1 the same with missing=node0 of step 1500)
        if self._follower is not None and result.status == "FAIL":
            result.hint = leader_missing(result.extra, result.details, result.hint,
                                         step=self._follower.unled_step())

    @property
    def output_folder(self) -> Path | None:
        return Path(self.output_dir) if self.output_dir else None
