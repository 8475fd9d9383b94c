"""The securing plan: a closed state machine with one entry (``Plan.on``), one bound (``secure_by``), pushes in a
killable worker.

The plan decides *what* to secure and *when*; it knows nothing about processes, sockets or the VERDICT's text.
Every event (``guard.secure.events``: frozen data) enters through ``Plan.on(event) -> list[Action]``; the table
``TRANSITIONS`` maps ``(state, event type)`` to its handler, and an event a state does not accept is logged and
counted in the report, never silently dropped. Its state is private: nothing outside this module assigns it;
``Plan.report()`` returns a frozen snapshot (``PlanReport``) from which the VERDICT's checkpoint fields are filled
(``guard.secure.outcome``). Collaborators are typed and injectable: a monotonic ``clock``, a ``pusher``
(``events.Pusher``) and the margin ``estimator`` (``budget.MarginEstimator``).

States::

    WATCHING -- deadline near / signal (job can save) --> AWAITING_SAVE -- fresh save / wait over --> SECURING
    WATCHING -- signal (job cannot save) --> AWAITING_SAVE (the signal is forwarded; what the job writes is pushed)
    SECURING -- push done, job cannot save (or was asked and has not answered) and still runs --> AWAITING_SAVE
        (its next save is pushed too, until secure_by)
    SECURING -- push done of a save the job made on its own (not the answer), job still runs --> AWAITING_SAVE
        (until the wait for the answer is over: the requested save is newer and is secured too)
    WATCHING -- failure --> SECURING (the newest complete checkpoint saved before the failure)
    any but DONE -- job ended with training complete --> FINAL_PUSH --> DONE (PASS, even after the deadline's
        request: the job finished first)
    AWAITING_SAVE / SECURING -- push done or secure_by passed --> DONE

**One bound.** ``secure_by = min(deadline - SAFETY_S, window_end - SAFETY_S)`` (:func:`bound_s`), where
``window_end`` is the earliest end a cause set: ``now + grace`` for a signal (every signal, in every state) and a
failure, ``now + allowance`` for a final push, none for the deadline itself. The job's stop (``StopJob``), the
wait for its save and every push's deadline derive from it.

**A push is provisional until its step's losses are read** (``ReadThrough``). Losses are read every
``--check-every`` steps; a save made inside that window, reported at once, may come after the first non-finite loss
that the window's read will show. While losses are being read (a ``ReadThrough`` came), a save of a step past the
last one read finite is held, neither pushed nor secured, until its step is read (then it is taken as any save),
a taint makes it suspect, or no more losses can come (the job's exit, a failure). A save whose tensors the agent saw
non-finite (``CheckpointSeen.finite`` False) taints every save from its step on; so does a push that read a NaN or an
infinity in the save's weights itself (``report.NOT_FINITE``: ``guard.secure.weights``, before any byte moved).

**A push that cannot finish is not started.** Once a push was measured, a push whose estimate
(``budget.MarginEstimator.secure_estimate_s``) exceeds the time left before its own deadline is not started
(logged with both figures): killed at ``secure_by`` it would only have left the destination in doubt.

**A taint in every state.** ``Tainted(N)``: every save at or after ``Tainted.saves_from`` (N-1 for a loss: the save at
N-1 holds the weights step N's loss came from; N for a save holding a non-finite tensor) is suspect (``MarkSuspect``),
never pushed, never secured; a running push of one is killed. A secured one (the destination's record names it) is
moved back to the newest good record (``RestoreRecord``, the worker's ``restore_checkpoint``: no upload,
``guard.secure.restoring``); only where the store cannot is the newest good checkpoint pushed over it again. Until
either ends well nothing counts as secured, and if neither does the report names the suspect checkpoint the
destination still holds (``PlanReport.suspect_held``).

**A save never seen may be the good one.** The scans hand the plan the newest complete save they find, so the saves
made between two scans never reach it. With every taint the plan asks for a look on disk (``LookOlder``) for the
newest complete save before the first suspect step with finite weights; its answer (``LookedOlder``) is taken as a
save when newer than what the plan has. Securing with nothing else to push waits for it (half the time left,
``LOOK_S`` at most) before it gives up: a job whose newest save was refused at the deadline, with no older one seen,
secured nothing, though the save one step before lay whole on disk.

**One supersede rule** (:meth:`Plan._supersede`): a running push is killed for a newer checkpoint only when the
newer one is estimated to finish before ``secure_by``; when both fit one after the other, the running one finishes
first. The estimate is what a push costs (``budget.MarginEstimator.secure_estimate_s``: the measured pushes'
durations once there are some, not the margin's guessed overhead on top of them); every push is killed at
``secure_by`` whatever it says.

**A push that makes no progress** (:meth:`Plan._check_stalled`): a push whose worker moved no byte for ``stall_s``
(``--push-stall``, default ``PUSH_STALL_S``; its handle's ``progress_at``) is logged once (``push of step N made no
progress for X s``) and, as soon as a newer complete checkpoint exists (and, while securing, is estimated to finish
before ``secure_by``), killed and replaced by the newer one's push, without waiting for the push interval (the
stalled commit never answered). A hung background push thus never holds every newer one back until its deadline
(``huggingface_hub`` issue #1502: a hung push blocked every newer one for 40 s, with no log line). Each push killed
this way doubles the bound for the next (a Hub that is slow to answer every commit still gets one through); a push
that ends well resets it.
"""

from __future__ import annotations

import logging
import math
import signal
from collections.abc import Callable
from typing import Any

from guard.core.durations import format_size, step_text
from guard.secure.budget import MarginEstimator
from guard.secure.cadence import PUSH_STALL_S, PUSH_TIME_FACTOR, background_interval_s
from guard.secure.checkpoints import CheckpointInfo
from guard.secure.choosing import (
    checkpoint_args,
    fits,
    good_secured,
    same,
    step_of,
    supersede,
    unchanged_on_disk,
    unsecured,
)
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
    KillPush,
    LookedOlder,
    LookOlder,
    MarkSuspect,
    OutputDirKnown,
    Pusher,
    ReadThrough,
    RecordTaint,
    ReleaseKept,
    RequestSave,
    RestoreRecord,
    RunOver,
    SignalReceived,
    StartPush,
    StopJob,
    Tainted,
    Tick,
    TrainingStarted,
)
from guard.secure.report import NOT_FINITE, REWRITTEN, EndedHandle, PlanReport, PriorPush, PushRecord, PushView, State
from guard.secure.restoring import restore_args

__all__ = ["LATE_REQUEST_S", "SAFETY_S", "STOP_BEFORE_S", "TRANSITIONS", "Action", "Plan", "PlanReport",
           "PriorPush", "PushView", "State", "bound_s"]

log = logging.getLogger("guard.secure")

SAFETY_S = 1.5  # securing is over this long before the kill (the deadline, or the end of --grace)
STOP_BEFORE_S = 2.0  # the job is stopped (SIGTERM) this long before secure_by if it still runs
LATE_REQUEST_S = 15.0  # before the first training step, the deadline's request waits until this long before it
LOOK_S = 30.0  # a look on disk for an older good save (LookOlder) is waited for this long at most


def bound_s(deadline_at: float | None, window_end: float) -> float:
    """``secure_by``: ``min(deadline - SAFETY_S, window_end - SAFETY_S)`` in clock seconds (``inf`` without
    either). ``window_end`` is ``now + --grace`` after a signal or a failure, ``now + allowance`` for a final push,
    ``inf`` otherwise."""
    return min(math.inf if deadline_at is None else deadline_at - SAFETY_S, window_end - SAFETY_S)


Handler = Callable[["Plan", Any, float], list[Action]]


class Plan:
    """The securing policy (see the module docstring). All times are ``clock`` seconds.

    Args:
        clock: monotonic seconds.
        pusher: starts pushes (``worker.Pusher``), or None without a destination.
        estimator: the margin estimator; pushes measured here feed it.
        deadline_at: the platform's deadline in clock seconds, or None.
        grace_s: ``--grace`` (seconds from a signal to the platform's SIGKILL).
        background: push complete checkpoints as they appear (``--background-push``).
        push_interval_s: the least time between two background push starts (``--push-interval``), or None:
            derived from the destination (``destination_kind``) and the last measured push time
            (``cadence.background_interval_s``, recomputed after every push that ended well).
        destination_kind: ``"folder"`` or ``"hub"`` (``dest.base.Destination.kind``), or None until a destination is
            known (``DestinationKnown``; then taken as the Hub, the only destination found later).
        final_output_dir: the job's output folder for the final model push, or None.
        final_window_s: with no deadline, how long securing after a good end may take (``--final-push-window``,
            default 180 s); an upload estimated to take longer gets 3x its estimate.
        unchanged: whether a checkpoint's files are still on disk as they were saved (default: their mtimes);
            injected by tests whose checkpoints are not on disk.
        stall_s: a push with no progress for this long (seconds, ``--push-stall``, default ``PUSH_STALL_S``; 0 or
            less: off) is logged and replaced by a newer complete checkpoint's push (the module docstring).
    """

    def __init__(self, *, clock: Callable[[], float], pusher: Pusher | None, estimator: MarginEstimator,
                 deadline_at: float | None = None, grace_s: float = 30.0, background: bool = True,
                 push_interval_s: float | None = 600.0, final_output_dir: str | None = None,
                 final_window_s: float = 180.0, unchanged: Callable[[CheckpointInfo], bool] = unchanged_on_disk,
                 destination_kind: str | None = None, stall_s: float = PUSH_STALL_S, nodes: int = 1) -> None:
        self._clock = clock
        self._pusher = pusher
        self._estimator = estimator
        self._deadline_at = deadline_at
        self._grace_s = grace_s
        self._background = background
        self._fixed_interval_s = push_interval_s
        self._destination_kind = destination_kind
        self._nodes = nodes
        self._measured_push_s: float | None = None  # the last push that ended well (its upload and verification)
        self._stall_s = stall_s if stall_s > 0 else math.inf
        self._stall_bound_s = self._stall_s  # doubled by each push killed for no progress, reset by a good end
        self._stall_logged: PushRecord | None = None
        self._final_output_dir = final_output_dir
        self._final_files: tuple[str, ...] | None = None  # the final model's files, when not the whole folder
        self._final_window_s = final_window_s
        self._unchanged = unchanged
        self._state = State.WATCHING
        self._window_end = math.inf
        self._trigger: str | None = None
        self._superseded_trigger: str | None = None
        self._failure_reason: str | None = None
        self._signum: int | None = None
        self._push: PushRecord | None = None
        self._queued: CheckpointInfo | None = None
        self._secured: PushRecord | None = None
        self._resumed: PushRecord | None = None  # the record a resumed run was fetched from
        self._suspect_held: PushRecord | None = None  # a suspect save the destination's record names, not moved back
        self._settled: PushRecord | None = None  # the last record that can no longer turn suspect (``ReleaseKept``)
        self._final: PushRecord | None = None
        self._final_pending = False  # the final push waits for the running push (the supersede rule)
        self._final_wanted = False  # the job ended well with final model files to push
        self._error: PushRecord | None = None
        self._newest: CheckpointInfo | None = None
        self._suspects: list[CheckpointInfo] = []
        self._bad_from_step: int | None = None  # the first non-finite step
        self._suspect_from: int | None = None  # the first suspect save step (``Tainted.saves_from``)
        self._wait_save_until: float | None = None
        self._awaiting_after_step = -1
        self._follow_saves = False
        self._answer_by: float | None = None  # the job was asked to save: its answer is waited for until then
        self._answer_pending = False  # the save secured (or being secured) was not the job's answer
        self._unanswered = False  # the job was asked and has not answered: its saves are followed until secure_by
        self._job_ended = False
        self._complete = False
        self._training_started = False
        self._last_start = -math.inf
        self._history: list[PushRecord] = []
        self._seen: list[CheckpointInfo] = []
        self._ignored: list[str] = []
        self._read_through: int | None = None  # losses read finite through this step (every rank), None: none yet
        self._held: list[tuple[CheckpointSeen, int]] = []  # saves past _read_through, with _reads when held
        self._reads = 0  # ReadThrough events so far
        self._looking: float | None = None  # a LookOlder's answer is waited for until then

    # -- the one entry ----------------------------------------------------------------------------------------

    def on(self, event: Event) -> list[Action]:
        """Feed one event; returns the actions to carry out (``StartPush``/``KillPush`` are done already)."""
        handler = TRANSITIONS.get((self._state, type(event)))
        if handler is None:
            name = f"{self._state.value}/{type(event).__name__}"
            self._ignored.append(name)
            log.debug("securing plan: %s not accepted while %s: ignored", type(event).__name__, self._state.value)
            return []
        return handler(self, event, self._clock())

    # -- queries ----------------------------------------------------------------------------------------------

    @property
    def state(self) -> State:
        return self._state

    @property
    def secure_by(self) -> float:
        """When securing is over (:func:`bound_s`), clock seconds."""
        return bound_s(self._deadline_at, self._window_end)

    @property
    def busy(self) -> bool:
        """Securing has started and is not over (the supervisor keeps its loop running)."""
        return self._state in (State.AWAITING_SAVE, State.SECURING, State.FINAL_PUSH)

    @property
    def has_pusher(self) -> bool:
        return self._pusher is not None

    def push_running(self) -> bool:
        """A push that ends the run (securing a failure, a deadline, a signal) is under way."""
        return self._state is State.SECURING and self._push is not None

    def due_at(self, now: float) -> float:
        """The next time a ``Tick`` has work: never a time already passed once the tick at ``now`` ran (``secure_by``
        counts while securing or before it comes; after it, with the plan done, it would make the loop turn
        without waiting until the job's stop)."""
        due = [self.secure_by] if self.busy or now < self.secure_by else [math.inf]
        if self._push is not None:
            due.append(now + 0.2)
        if self._wait_save_until is not None:
            due.append(self._wait_save_until)
        if self._looking is not None:
            due.append(self._looking)
        if self._state is State.WATCHING:
            if self._deadline_at is not None:
                due.append(self._deadline_request_at())
            if self._queued is not None and self._push is None:
                due.append(self._last_start + self._interval_s())
        return min(due)

    def _interval_s(self) -> float:
        """The least time between two background push starts: ``--push-interval``, else from the destination and
        the last measured push (``cadence.background_interval_s``)."""
        if self._fixed_interval_s is not None:
            return self._fixed_interval_s
        return background_interval_s(self._destination_kind or "hub", measured_push_s=self._measured_push_s,
                                     nodes=self._nodes)

    def deadline_due(self, now: float) -> bool:
        """The deadline's request is due (send ``DeadlineNear``)."""
        return self._state is State.WATCHING and self._deadline_at is not None and now >= self._deadline_request_at()

    def _deadline_request_at(self) -> float:
        """When to ask for the last checkpoint: ``margin`` before the deadline once training has started. Before the
        first step there is nothing new to save, and the margin still rests on guessed sizes, so asking then would
        only stop a job that is still loading: wait until ``LATE_REQUEST_S`` before it."""
        assert self._deadline_at is not None
        margin_s = self._estimator.margin_s()
        return self._deadline_at - (margin_s if self._training_started else min(margin_s, LATE_REQUEST_S))

    def report(self) -> PlanReport:
        """A frozen snapshot of what the plan knows (see :class:`PlanReport`)."""
        secured, held = self._secured, self._suspect_held if self._secured is None else None
        if secured is not None and self._is_suspect(secured.info):
            secured, held = None, secured  # a push stopped after its record moved, no time left to move it back
        return PlanReport(
            state=self._state, trigger=self._trigger, failure_reason=self._failure_reason, signum=self._signum,
            secure_by=self.secure_by, deadline_at=self._deadline_at,
            secured=secured.view() if secured is not None else None, newest=self._newest,
            suspect=self._suspects[-1] if self._suspects else None, suspects=tuple(self._suspects),
            non_finite_from_step=self._bad_from_step, suspect_from_step=self._suspect_from,
            final=self._final.view() if self._final is not None else None,
            error=self._error.view() if self._error is not None else None,
            history=tuple(p.view() for p in self._history), has_pusher=self._pusher is not None,
            training_complete=self._complete, superseded_trigger=self._superseded_trigger,
            final_wanted=self._final_wanted,
            ignored=tuple(self._ignored), suspect_held=held.view() if held is not None else None)

    # -- handlers (see TRANSITIONS) -----------------------------------------------------------------------------

    def _on_already_secured(self, event: AlreadySecured, now: float) -> list[Action]:
        """The destination already holds ``info``: it stands as the secured one until a newer one is, so a
        deadline or signal before the job's first save still ends with exit 75 naming it."""
        info = event.info
        result = PriorPush(event.destination, event.revision, tuple(info.files), info.size_bytes, info.step)
        self._secured = self._resumed = PushRecord("resumed", info, EndedHandle(result), now, result)
        if step_of(info) >= step_of(self._newest):
            self._newest = info
        return []

    def _on_training_started(self, event: TrainingStarted, now: float) -> list[Action]:
        self._training_started = True
        return []

    def _on_destination(self, event: DestinationKnown, now: float) -> list[Action]:
        self._pusher = event.pusher
        if event.kind is not None:
            self._destination_kind = event.kind
        return []

    def _on_output_dir(self, event: OutputDirKnown, now: float) -> list[Action]:
        """The output folder the final model is pushed from: the newest one named (the folder of the job's newest
        save when none was given: never locked onto the first)."""
        self._final_output_dir = event.path
        return []

    def _on_deadline_moved(self, event: DeadlineMoved, now: float) -> list[Action]:
        before = self.secure_by
        self._deadline_at = event.deadline_at
        return self._shortened(before, now)

    def _on_checkpoint(self, event: CheckpointSeen, now: float) -> list[Action]:
        return self._checkpoint(event, now, hold=True)

    def _checkpoint(self, event: CheckpointSeen, now: float, *, hold: bool) -> list[Action]:
        """A save, held while provisional (``hold``; False: released, its step counts as read)."""
        info = event.info
        if event.finite is False:
            if info.step is None:
                log.warning("checkpoint %s holds a tensor that is not finite: never pushed", info.path)
                return []
            log.warning("checkpoint %s (%s) holds a tensor that is not finite: suspect from %s on",
                        info.path, step_text(info.step), step_text(info.step))
            taint = Tainted(info.step, witness="weights")
            return self._on_taint(taint, now) + self._mark(info, why="saved at or after")
        if self._is_suspect(info):
            return self._mark(info, why="saved at or after")
        if hold and self._provisional(info):
            if all(not same(info, held.info) for held, _ in self._held):
                log.info("checkpoint %s (%s): held until the losses through its step are read (read through "
                         "%s)", info.path, step_text(info.step),
                         "no step yet" if self._read_through is None else step_text(self._read_through))
                self._held.append((event, self._reads))
            return []
        newest = self._newest
        if newest is not None and (step_of(info) < step_of(newest) or same(info, newest)):
            return []
        self._newest = info
        self._seen.append(info)
        if self._pusher is None or self._state in (State.DONE, State.FINAL_PUSH):
            return []
        if self._state is State.WATCHING:
            if not self._background:
                return []
            if self._push is not None or now < self._last_start + self._interval_s():
                self._queued = info  # a newer one replaces a queued one
                return []
            return self._start("background", info, self._background_deadline(now), now)
        rewritten = newest is not None and info.path == newest.path and step_of(info) == step_of(newest)
        if self._answer_by is not None and event.requested is not None:
            # a save the job made on its own (a periodic one under way when asked) is secured, and the answer to
            # the request still waited for; the answer ends that wait
            self._answer_pending = not event.requested
            if event.requested:
                self._unanswered = False
        if self._state is State.AWAITING_SAVE and (step_of(info) > self._awaiting_after_step or rewritten):
            # a fresh save: a later step, or the same file saved over in place (nanoGPT's ckpt.pt, step unknown)
            self._wait_save_until = None
            self._state = State.SECURING
        if self._state is State.SECURING:
            return self._secure_newest(now)
        return []

    def _provisional(self, info: CheckpointInfo) -> bool:
        """``info`` waits for its step's losses: losses are being read, not yet through its step, and more can
        come (the job runs and has not failed)."""
        return (not self._job_ended and self._failure_reason is None and self._read_through is not None
                and info.step is not None and info.step > self._read_through)

    def _on_read_through(self, event: ReadThrough, now: float) -> list[Action]:
        """The losses were read finite through ``event.step``: the saves held up to it are taken, oldest first."""
        self._reads += 1
        self._read_through = max(event.step, self._read_through if self._read_through is not None else event.step)
        through = self._read_through
        # a read sent after the save covers it whatever its step's unit (a save named by samples or epochs): the
        # second one since it was held (the first may be another rank's, behind)
        return self._settle(through) + self._release(
            lambda held, reads: step_of(held.info) <= through or self._reads - reads >= 2, now)

    def _settle(self, through: int) -> list[Action]:
        """The record's step's next loss was read finite (``through`` past its step): it can no longer turn
        suspect, so the older record kept aside to move back to may go (``ReleaseKept``; not while a push runs,
        whose record may be moving)."""
        record = self._secured
        if record is None or record is self._settled or record.kind == "resumed" or self._push is not None \
                or record.info is None or step_of(record.info) >= through:
            return []
        self._settled = record
        return [ReleaseKept(record.info.step)]

    def _release(self, ready: Callable[[CheckpointSeen, int], bool], now: float) -> list[Action]:
        """The held saves for which ``ready(event, reads when held)`` says so go through ``_on_checkpoint`` again,
        oldest first."""
        ripe = [held for held, reads in self._held if ready(held, reads)]
        if not ripe:
            return []
        self._held = [(held, reads) for held, reads in self._held if not ready(held, reads)]
        actions: list[Action] = []
        for held in sorted(ripe, key=lambda held: step_of(held.info)):
            actions += self._checkpoint(held, now, hold=False)
        return actions

    def _on_deadline_near(self, event: DeadlineNear, now: float) -> list[Action]:
        """The deadline is within the margin: ask for a fresh checkpoint (or secure the newest) before it. A job
        that cannot be asked but saves on SIGTERM itself (``handles_term``) gets SIGTERM now."""
        if self._deadline_at is None:
            self._ignored.append("watching/DeadlineNear (no deadline)")
            return []
        self._trigger = "deadline"
        log.warning("deadline in %.0fs: securing a checkpoint (margin %.0fs)", self._deadline_at - now,
                    self._estimator.margin_s())
        actions: list[Action] = [Decide("TIMEOUT", "deadline"), StopJob(self.secure_by - STOP_BEFORE_S)]
        return actions + self._await_save(now, event.can_save, signum=None, term_now=event.handles_term)

    def _on_signal(self, event: SignalReceived, now: float) -> list[Action]:
        """A termination signal: securing ends within ``--grace`` from now (and before the deadline), whatever
        runs."""
        signum = event.signum
        if self._signum is None:
            self._signum = signum
        before = self.secure_by
        self._window_end = min(self._window_end, now + self._grace_s)
        if self._state is State.WATCHING:
            self._trigger = "signal"
            log.warning("signal %d received: securing a checkpoint within %.0fs", signum,
                        max(0.0, self.secure_by - now))
            actions: list[Action] = [Decide("INTERRUPTED", "signal", signum),
                                     StopJob(self.secure_by - STOP_BEFORE_S)]
            return actions + self._await_save(now, event.can_save, signum=signum)
        log.warning("signal %d received while %s: ending within %.0fs", signum, self._state.value.replace("_", " "),
                    max(0.0, self.secure_by - now))
        if self._state is State.FINAL_PUSH and self._trigger is None:
            self._trigger = "signal"
        return self._shortened(before, now)

    def _on_failure(self, event: Failure, now: float) -> list[Action]:
        """The run failed: secure the newest complete checkpoint saved before it, within ``--grace`` (and before
        the deadline)."""
        self._trigger = "failure"
        self._failure_reason = event.reason
        self._window_end = min(self._window_end, (now if event.at is None else min(now, event.at)) + self._grace_s)
        self._state = State.SECURING
        held = self._release(lambda event, reads: True, now)  # no more losses will be read: the saves held go
        return held + self._secure_newest(now)

    def _on_taint(self, event: Tainted, now: float) -> list[Action]:
        """The loss went non-finite at ``from_step``: in every state, every save at or after it is suspect."""
        first = event.from_step if self._bad_from_step is None else min(self._bad_from_step, event.from_step)
        saves_from = event.saves_from if self._suspect_from is None else min(self._suspect_from, event.saves_from)
        if first == self._bad_from_step and saves_from == self._suspect_from:
            return []
        self._bad_from_step, self._suspect_from = first, saves_from
        if event.witness == "weights":
            log.warning("the weights saved at step %d are not finite: checkpoints saved at or after step %d are "
                        "suspect", event.from_step, saves_from)
        elif event.witness == "grad_norm":
            log.warning("the gradient norm went non-finite at step %d (its loss was finite): checkpoints saved at or "
                        "after step %d are suspect (the update of step %d made the weights non-finite)", first,
                        saves_from, first)
        else:
            log.warning("the loss went non-finite at step %d: checkpoints saved at or after step %d are suspect (a "
                        "save at step N holds the weights step N+1's loss was computed on)", first, saves_from)
        actions: list[Action] = [RecordTaint(saves_from)]
        for info in self._seen + [held.info for held, _ in self._held]:
            if self._is_suspect(info):
                actions += self._mark(info, why="saved at or after")
        self._held = [(held, reads) for held, reads in self._held if not self._is_suspect(held.info)]
        if self._queued is not None and self._is_suspect(self._queued):
            self._queued = None
        if self._newest is not None and self._is_suspect(self._newest):
            self._newest = self._older_than(saves_from)
        actions += self._look_older(saves_from, now)
        running = self._push
        killed = running is not None and running.info is not None and self._is_suspect(running.info)
        if killed:
            actions += self._kill("suspect")  # a push stopped after its record moved is secured: restored below
        if (self._secured is not None and self._is_suspect(self._secured.info)) \
                or (killed and running is not None and running.kind == "restore"):
            actions += self._restore(now)
        if killed and self._state is State.SECURING:
            actions += self._secure_newest(now)
        if self._state is State.AWAITING_SAVE:
            # the save it waits for would be saved after the non-finite loss: secure the newest good one now
            log.warning("the checkpoint the guard asked for would be saved after the non-finite loss: securing the "
                        "newest one saved before it instead")
            self._wait_save_until = None
            self._follow_saves = False
            self._answer_pending = False
            self._unanswered = False
            self._state = State.SECURING
            actions += self._secure_newest(now)
        # the read that found step ``first`` read the steps before it in its window: the saves held before it
        if self._read_through is not None:
            self._read_through = max(self._read_through, first - 1)
        return actions + self._release(lambda event, reads: step_of(event.info) < first, now)

    def _on_job_exit(self, event: JobExited, now: float) -> list[Action]:
        """The job's main process ended. Training complete (and no non-finite loss): ``PASS`` with its final
        push, whatever securing had begun; else what it saved is secured."""
        self._job_ended = True
        # no more losses will be read: the saves held are taken (a taint read at the end came before the exit)
        held = self._release(lambda event, reads: True, now)
        return held + self._job_exit(event, now)

    def _job_exit(self, event: JobExited, now: float) -> list[Action]:
        finished = event.ok and (event.complete or self._state is State.WATCHING) and self._bad_from_step is None
        if finished and self._trigger in (None, "deadline") and self._state is not State.FINAL_PUSH:
            return self._finished(event, now)
        if self._state is State.AWAITING_SAVE:
            self._wait_save_until = None
            self._state = State.SECURING
            return self._secure_newest(now)
        if self._state is State.WATCHING and self._push is None:
            self._state = State.DONE
        return []

    def _finished(self, event: JobExited, now: float) -> list[Action]:
        self._complete = True
        if self._trigger == "deadline":
            log.warning("the job finished its training before the deadline: a PASS, not a timeout")
            self._superseded_trigger, self._trigger = "deadline", None
        self._wait_save_until = None
        self._follow_saves = False
        self._answer_pending = False
        self._unanswered = False
        self._final_files = event.final_files
        if self._pusher is None or not self._final_output_dir:
            if self._push is None:
                self._state = State.DONE
            else:
                self._state = State.SECURING  # the running push may still end well; nothing more to do
            return []
        if event.final_by_node_0:
            # two guards writing the same final model files at the destination collide (a Megatron job's
            # .latest_checkpointed_iteration.txt, written by node 0's and node 1's guards at once: FileNotFoundError)
            log.info("node 0's guard pushes the final model: this node secures its part of its newest checkpoint")
        elif not event.has_final_model:
            log.warning("the job ended well but wrote no final model files to %s: securing its newest checkpoint "
                        "instead", self._final_output_dir)
        if not event.has_final_model or event.final_by_node_0:
            self._trigger = "ended"
            self._window_end = min(self._window_end, now + self._final_allowance_s())
            self._state = State.SECURING
            return self._secure_newest(now)
        self._window_end = min(self._window_end, now + self._final_allowance_s())
        self._state = State.FINAL_PUSH
        self._final_wanted = True
        running = self._push
        if running is not None and running.info is not None:
            decision = self._supersede(running, None, now)
            if decision == "replace":
                return [*self._kill("superseded"), *self._start_final(now)]
            self._final_pending = True
            return []
        return self._start_final(now)

    def _on_tick(self, event: Tick, now: float) -> list[Action]:
        actions: list[Action] = []
        if self._push is not None:
            record = self._push
            record.handle.deadline = min(record.handle.deadline, self.secure_by)
            result = record.handle.poll()
            if result is not None:
                actions += self._push_ended(result, now)
            elif record.info is not None:  # a push running longer than the rate allows lowers it now
                self._estimator.observe_push_progress(record.info.size_bytes, now - record.started)
                actions += self._check_stalled(record, now)
        if self._wait_save_until is not None and now >= self._wait_save_until and self._state is State.AWAITING_SAVE:
            log.warning("the job did not save a checkpoint in time: securing the newest complete one")
            self._wait_save_until = None
            self._state = State.SECURING
            actions += self._secure_newest(now)
        if (self._state is State.WATCHING and self._queued is not None and self._push is None
                and now >= self._last_start + self._interval_s()):
            info, self._queued = self._queued, None
            actions += self._start("background", info, self._background_deadline(now), now)
        if self._looking is not None and now >= self._looking:
            self._looking = None  # no answer in time: what the plan has decides
            if self._state is State.SECURING and self._push is None:
                actions += self._secure_newest(now)
        if self.busy and now >= self.secure_by:
            if self._push is not None:
                actions += self._kill("deadline")
            log.warning("securing ran out of time")
            self._state = State.DONE
        return actions

    def _on_looked(self, event: LookedOlder, now: float) -> list[Action]:
        """``LookOlder``'s answer: a good save newer than the newest the plan has is taken as a save; else, while
        securing with nothing under way, what there is decides."""
        self._looking = None
        info = event.info
        if info is not None and not self._is_suspect(info) and step_of(info) > step_of(self._newest):
            log.info("found on disk: %s (%s), saved before the first suspect step with finite weights", info.path,
                     step_text(info.step))
            return self._checkpoint(CheckpointSeen(info), now, hold=False)
        return self._secure_newest(now) if self._state is State.SECURING and self._push is None else []

    def _look_older(self, before_step: int, now: float) -> list[Action]:
        """Look on disk for the newest good save before ``before_step`` (``LookOlder``): the scans hand the plan the
        newest complete save only, so saves between two scans were never seen. Waited for (``_look_pending``)
        half the time left, ``LOOK_S`` at most. None when the plan has the save just before it."""
        if self._pusher is None or self._state is State.DONE or step_of(self._newest) >= before_step - 1:
            return []
        self._looking = now + min(LOOK_S, max(0.0, self.secure_by - now) / 2)
        return [LookOlder(before_step, self._looking)]

    def _look_pending(self, now: float) -> bool:
        return self._looking is not None and now < self._looking

    def _on_run_over(self, event: RunOver, now: float) -> list[Action]:
        return self._kill("killed") if self._push is not None else []

    # -- internals --------------------------------------------------------------------------------------------

    def _is_suspect(self, info: CheckpointInfo | None) -> bool:
        return (info is not None and self._suspect_from is not None and info.step is not None
                and info.step >= self._suspect_from)

    def _mark(self, info: CheckpointInfo, *, why: str) -> list[Action]:
        assert self._bad_from_step is not None
        if any(s.path == info.path and s.step == info.step for s in self._suspects):
            return []
        self._suspects.append(info)
        log.warning("checkpoint %s (%s) was %s the first suspect step (%d; the first non-finite step: %d): suspect, "
                    "not pushed", info.path, step_text(info.step), why, self._suspect_from, self._bad_from_step)
        return [MarkSuspect(str(info.path), info.step, self._bad_from_step)]

    def _measured(self, took_s: float) -> None:
        """A push took ``took_s`` seconds: a derived interval follows it (logged when it changes)."""
        before = self._interval_s()
        self._measured_push_s = took_s
        after = self._interval_s()
        if after != before:
            log.info("background push interval now %.0fs (the last push took %.1fs; at least %.0fx that, and the "
                     "destination's commit rate limit)", after, took_s, PUSH_TIME_FACTOR)

    def _check_stalled(self, record: PushRecord, now: float) -> list[Action]:
        """A running checkpoint push that made no progress for the stall bound: logged once; killed and replaced
        by the newest complete checkpoint when that is newer (and, while securing, fits before ``secure_by``)."""
        assert record.info is not None
        idle_s = now - max(record.started, record.handle.progress_at)
        if idle_s < self._stall_bound_s or self._state not in (State.WATCHING, State.SECURING):
            return []
        if self._stall_logged is not record:
            self._stall_logged = record
            log.warning("push of %s (%s) made no progress for %.0fs", step_text(record.info.step), record.info.path,
                        idle_s)
        newer = self._queued if self._queued is not None else self._newest
        if newer is None or same(newer, record.info) or step_of(newer) < step_of(record.info) \
                or self._is_suspect(newer) or not self._unsecured(newer):
            return []
        if self._state is State.SECURING and self._estimate_s(newer) > self.secure_by - now:
            return []
        log.warning("push of %s stalled: pushing the newer checkpoint %s (%s) instead",
                    step_text(record.info.step), newer.path, step_text(newer.step))
        self._stall_bound_s *= 2
        kind = record.kind
        actions = self._kill("stalled")
        if kind == "background" and self._state is State.WATCHING:
            self._queued = None
            return actions + self._start("background", newer, self._background_deadline(now), now)
        return actions + self._start("securing", newer, self.secure_by, now)

    def _estimate_s(self, info: CheckpointInfo) -> float:
        return self._estimator.secure_estimate_s(info.size_bytes)

    def _final_allowance_s(self) -> float:
        """How long securing after a good end may take: ``final_window_s`` (``--final-push-window``), or 3x the
        upload's estimate when that is more."""
        return max(self._estimator.secure_estimate_s() * 3, self._final_window_s, 5.0)

    def _shortened(self, before: float, now: float) -> list[Action]:
        """``secure_by`` may have moved earlier: the running push, the wait for a save and the job's stop follow."""
        by = self.secure_by
        if self._wait_save_until is not None:
            self._wait_save_until = min(self._wait_save_until, by)
        if self._push is not None:
            self._push.handle.deadline = min(self._push.handle.deadline, by)
        if by < before and self.busy and not self._job_ended:
            return [StopJob(by - STOP_BEFORE_S)]
        return []

    def _await_save(self, now: float, can_save: bool, signum: int | None, term_now: bool = False) -> list[Action]:
        self._state = State.AWAITING_SAVE
        self._awaiting_after_step = step_of(self._newest)
        if self._push is not None:
            self._push.handle.deadline = min(self._push.handle.deadline, self.secure_by)
        left_s = self.secure_by - now
        fallback = self._newest if self._unsecured(self._newest) else None
        reserve_s = self._estimate_s(fallback) if fallback is not None else 0.0
        self._wait_save_until = now + max(0.5 * left_s, left_s - reserve_s, 0.0)
        if can_save:
            self._answer_by = self._wait_save_until
            self._unanswered = True
            log.info("waiting up to %.0fs for the job's checkpoint", self._wait_save_until - now)
            return [RequestSave()]
        self._follow_saves = True
        if signum is None and term_now:
            log.info("the job cannot be asked for a checkpoint but saves on SIGTERM itself: SIGTERM now, %.0fs "
                     "before the deadline; what it writes is secured", self.secure_by + SAFETY_S - now)
            return [ForwardSignal(signal.SIGTERM)]
        log.info("the job cannot be asked for a checkpoint (no guard API, no Trainer): %s; what it writes is "
                 "secured", "the signal goes to it now" if signum is not None else "it is stopped before the deadline")
        return [ForwardSignal(signum)] if signum is not None else []

    def _follow(self, now: float) -> bool:
        """A job that cannot be asked to save runs on until it is stopped (or ends): wait for its next save
        instead of ending securing; ``secure_by`` still ends it. A job that was asked and made a save of its own
        first (``CheckpointSeen.requested`` False) is waited for likewise, until the wait for its answer ends. A
        job that was asked and has not answered (asked while too early to tell whether it can: a loop without the
        API still starting, whose saves are found, ``requested`` None) runs on until its stop as well: each newer
        save it makes before ``secure_by`` is secured too, not only the first one."""
        if self._answer_pending and not self._job_ended and self._pusher is not None and self._answer_by is not None \
                and now < min(self._answer_by, self.secure_by):
            self._state = State.AWAITING_SAVE
            self._awaiting_after_step = step_of(self._newest)
            self._wait_save_until = self._answer_by
            log.info("that save was the job's own, not its answer to the request: waiting up to %.0fs more for "
                     "the answer", self._answer_by - now)
            self._answer_pending = False  # waited for once: the next save or the wait's end decides
            return True
        if not (self._follow_saves or self._unanswered) or self._job_ended or self._pusher is None \
                or now >= self.secure_by:
            return False
        self._state = State.AWAITING_SAVE
        self._awaiting_after_step = step_of(self._newest)
        self._wait_save_until = None
        return True

    def _unsecured(self, info: CheckpointInfo | None) -> bool:
        return unsecured(info, self._secured.info if self._secured is not None else None)

    def _older_than(self, step: int) -> CheckpointInfo | None:
        """The newest checkpoint saved before ``step`` still on disk as it was saved (a loop that saves ``ckpt.pt``
        again in place leaves no older one), else the newest one pushed before it."""
        for info in reversed(self._seen):
            if step_of(info) < step and self._unchanged(info):
                return info
        good = self._good_secured(step)
        return good.info if good is not None else None

    def _restore(self, now: float) -> list[Action]:
        """The destination's record names a save from the first suspect step on: moved back to the newest good
        record (``RestoreRecord``: no upload, ``guard.secure.restoring``), else the newest good checkpoint is pushed
        over it again; nothing counts as secured until either ends well."""
        held, self._secured = self._secured, None
        if held is not None:
            self._suspect_held = held
        good = self._good_secured(self._suspect_from) if self._suspect_from is not None else None
        args = restore_args(step_of(good.info) if good is not None and good.info is not None else None,
                            good.result if good is not None else None, step_of(self._suspect_held.info)
                            if self._suspect_held is not None else None)
        if self._pusher is None or good is None or args is None or self._push is not None or now >= self.secure_by:
            return self._repush(now)
        if self._state is State.DONE:
            self._state = State.SECURING  # the loop waits for it
        deadline = self._background_deadline(now) if self._state is State.WATCHING else self.secure_by
        log.warning("the destination's record names %s, saved from the step before the first non-finite loss on: "
                    "moving it back to %s (%s)", step_text(args["from_step"]), good.info.path if good.info else "?",
                    step_text(args["step"]))
        handle = self._pusher.start("restore_checkpoint", args, deadline)
        self._push = PushRecord("restore", good.info, handle, now)
        self._history.append(self._push)
        return [RestoreRecord(args["step"], args["revision"], args["from_step"], deadline)]

    def _restore_ended(self, record: PushRecord, result: Any, now: float) -> list[Action]:
        """The record moved back (secured: the good checkpoint it names), or not: pushed again where it fits."""
        if result.ok or self._recorded_anyway(record):
            self._secured, self._suspect_held = record, None
            log.warning("the destination's record is %s again (%s)", step_text(step_of(record.info)), result.pushed)
            return self._after_push(record, result, now)
        log.error("moving the destination's record back failed: %s", result.error)
        return (self._repush(now) if not result.killed else []) or self._after_push(record, result, now)

    def _repush(self, now: float) -> list[Action]:
        """The newest good checkpoint pushed over the suspect record (the store cannot move it back)."""
        target = self._newest
        log.warning("the destination holds %s, saved at or after the first suspect step: %s",
                    step_text(step_of(self._suspect_held.info)) if self._suspect_held is not None else "a suspect save",
                    f"pushing {target.path} ({step_text(target.step)}) over it" if target is not None and self._pusher
                    else "no older good checkpoint to put back; nothing counts as secured")
        if self._pusher is None or target is None or self._push is not None:
            return []
        if self._state is State.WATCHING:
            self._queued = None
            return self._start("background", target, self._background_deadline(now), now)
        if self._state is State.SECURING:
            return self._secure_newest(now)
        return []

    def _good_secured(self, step: int) -> PushRecord | None:
        """The newest verified push of a checkpoint saved before ``step`` (the resumed one included), or None."""
        return good_secured(self._history, self._resumed, step)

    def _supersede(self, running: PushRecord, newer: CheckpointInfo | None, now: float) -> str:
        """The one supersede rule (:func:`choosing.supersede`): ``follow``, ``replace`` or ``keep``."""
        assert running.info is not None
        need_s = self._estimate_s(newer) if newer is not None else self._estimator.secure_estimate_s()
        running_left_s = max(0.0, self._estimate_s(running.info) - (now - running.started))
        return supersede(running, newer, left_s=self.secure_by - now, need_s=need_s, running_left_s=running_left_s)

    def _secure_newest(self, now: float) -> list[Action]:
        """In SECURING: push the newest unsecured checkpoint (the supersede rule decides about a running push);
        else done."""
        target = self._newest
        running = self._push
        if running is not None and running.info is not None and target is not None and same(target, running.info):
            running.kind = "securing" if running.kind != "restore" else running.kind
            return []
        if self._pusher is None or target is None or not self._unsecured(target):
            if running is not None:
                running.kind = "securing" if running.kind == "background" else running.kind
                return []  # its end decides (a newer good result, or nothing lost)
            if self._look_pending(now) or self._follow(now):
                return []  # the look's answer decides, or the job's next save
            if target is None:
                log.error("no complete checkpoint to secure")
            self._state = State.DONE
            return []
        actions: list[Action] = []
        if running is not None and running.info is not None:
            decision = self._supersede(running, target, now)
            if decision != "replace":
                running.kind = "securing" if running.kind != "restore" else running.kind
                return []
            actions += self._kill("superseded")
        elif not self._fits(target, self.secure_by, now):
            if self._job_ended:
                self._state = State.DONE  # nothing newer will come
            return []  # a newer, smaller save may still fit; secure_by ends the wait
        return actions + self._start("securing", target, self.secure_by, now)

    def _fits(self, info: CheckpointInfo, deadline: float, now: float) -> bool:
        """A push of ``info`` may start before ``deadline`` (:func:`choosing.fits`)."""
        measured = self._measured_push_s is not None
        return fits(info, need_s=self._estimate_s(info), left_s=deadline - now, measured=measured)

    def _background_deadline(self, now: float) -> float:
        """A background push may take 3x its estimate plus a minute, and never past ``secure_by``."""
        return min(now + 3 * self._estimator.secure_estimate_s() + 60.0, self.secure_by)

    def _start(self, kind: str, info: CheckpointInfo, deadline: float, now: float) -> list[Action]:
        assert self._pusher is not None
        if kind == "background":
            self._last_start = now
        estimate_s = self._estimate_s(info)
        log.info("securing %s (%s, %s)%s, %.0fs allowed", info.path, step_text(info.step), format_size(info.size_bytes),
                 " in the background" if kind == "background" else "", deadline - now)
        handle = self._pusher.start("push_checkpoint", checkpoint_args(info), deadline)
        self._push = PushRecord(kind, info, handle, now)
        self._history.append(self._push)
        return [StartPush(kind, str(info.path), info.step, deadline, estimate_s)]

    def _start_final(self, now: float) -> list[Action]:
        assert self._pusher is not None and self._final_output_dir
        self._final_pending = False
        log.info("the job ended: securing the final model from %s", self._final_output_dir)
        args: dict[str, Any] = {"output_dir": str(self._final_output_dir)}
        if self._final_files is not None:
            args["files"] = list(self._final_files)
        handle = self._pusher.start("push_final", args, self.secure_by)
        self._push = self._final = PushRecord("final", None, handle, now)
        self._history.append(self._push)
        return [StartPush("final", str(self._final_output_dir), None, self.secure_by,
                          self._estimator.secure_estimate_s())]

    def _kill(self, why: str) -> list[Action]:
        record, self._push = self._push, None
        if record is None:
            return []
        record.result = record.handle.kill("deadline" if why == "deadline" else "killed")
        log.warning("push of %s stopped: %s", record.info.path if record.info else "the final model", why)
        if self._recorded_anyway(record):
            pass
        elif record.kind in ("securing", "final"):
            self._error = record
        return [KillPush(why, str(record.info.path) if record.info else None,
                         record.info.step if record.info else None)]

    def _recorded_anyway(self, record: PushRecord) -> bool:
        """A checkpoint push that did not end on its own (killed, its worker died) after the destination's record
        had moved to its step (``WorkResult.recorded_step``): the destination holds it, verified, so it is what is
        secured (the VERDICT and the destination never disagree). Returns whether it was taken so."""
        step = getattr(record.result, "recorded_step", None)
        if step is None or record.info is None or record.kind == "final" or step != record.info.step:
            return False
        self._secured = record
        if self._is_suspect(record.info):
            log.error("the push of %s was stopped after the destination's record named it, but it was saved after "
                      "the first non-finite loss: the destination holds a suspect checkpoint", record.info.path)
        else:
            log.warning("the push of %s was stopped after the destination's record named %s: that checkpoint "
                        "is secured", record.info.path, step_text(step))
        return True

    def _push_ended(self, result: Any, now: float) -> list[Action]:
        record, self._push = self._push, None
        assert record is not None
        record.result = result
        if record.kind == "restore":
            return self._restore_ended(record, result, now)
        if result.ok:
            took_s = getattr(result, "transfer_s", result.elapsed_s)  # the successful attempt alone, no waits
            if took_s > 0 and result.size_bytes > 0:
                self._estimator.observe_push(result.size_bytes, took_s)
            if took_s > 0 and record.kind != "final":
                self._measured(float(took_s))
            self._stall_bound_s = self._stall_s
            if record.info is not None and record.kind != "final":
                self._estimator.observe_push_cost(record.info.size_bytes, now - record.started)  # what it cost
            if record.kind == "final":
                log.info("final model secured and verified: %s", result.pushed)
            elif self._is_suspect(record.info):
                log.warning("the push of %s ended, but it was saved after the first non-finite loss: not secured",
                            record.info.path if record.info else "?")
                self._secured = record  # what the destination holds now, until _restore replaces it
                restored = self._restore(now)
                if restored:
                    return restored
            else:
                self._secured = record  # the destination's record now names it (its swap, its commit)
                log.info("secured and verified: %s (%s, %s in %.1fs)", result.pushed,
                         step_text(record.info.step if record.info else None), format_size(result.size_bytes),
                         result.elapsed_s)
        elif self._recorded_anyway(record):  # its worker died after the record moved: secured all the same
            if self._is_suspect(record.info):
                return self._restore(now) or self._after_push(record, result, now)
        else:
            rewritten = getattr(result, "error_type", None) == REWRITTEN and self._bad_from_step is None
            # the push read the save's weights and found a NaN or an infinity: a witness, as the agent's
            not_finite = getattr(result, "error_type", None) == NOT_FINITE and record.kind != "final" \
                and record.info is not None
            if rewritten:  # the job saved over it again: not the destination's failure; its newer save follows
                log.info("%s: its newer save is secured instead", result.error)
            else:
                log.error("%s", result.error)
            if not getattr(result, "killed", False):
                self._estimator.discard_push_progress()  # an error is not a rate measurement
            if record.kind != "background" and not rewritten and not not_finite:
                self._error = record
            if record.kind == "final" and getattr(result, "error_type", None) == NOT_FINITE:
                return self._final_not_finite(now)
            if not_finite and record.info is not None:
                tainted = self._checkpoint(CheckpointSeen(record.info, finite=False), now, hold=False)
                if any(isinstance(action, StartPush) for action in tainted):
                    return tainted  # the taint already started the newest good one's push
                return tainted + self._after_push(record, result, now)
        return self._after_push(record, result, now)

    def _final_not_finite(self, now: float) -> list[Action]:
        """The final model's weights are not finite (the push read them): the run failed as at a non-finite loss;
        its newest good checkpoint is secured instead, when one is not yet."""
        log.warning("the job's final model is not finite: securing its newest good checkpoint instead")
        self._trigger, self._failure_reason, self._complete = "failure", "non_finite_loss", False
        self._final_pending = False
        self._window_end = min(self._window_end, now + self._final_allowance_s())
        self._state = State.SECURING
        actions = self._secure_newest(now)
        if not any(isinstance(action, StartPush) for action in actions) and not self._look_pending(now):
            self._state = State.DONE
        return actions

    def _after_push(self, record: PushRecord, result: Any, now: float) -> list[Action]:
        """What follows a push's end in each state (a final push pending, a newer checkpoint, a queued one)."""
        if self._state is State.FINAL_PUSH:
            if self._final_pending and now < self.secure_by:
                return self._start_final(now)
            if record.kind == "final" or not self._final_pending:
                self._state = State.DONE
            return []
        if self._state is State.SECURING:
            if now < self.secure_by and self._unsecured(self._newest) \
                    and (result.ok or self._newest is not record.info):
                return self._secure_newest(now)  # a newer one appeared meanwhile (also after a failed push)
            # a job that cannot be asked runs on and saves again: after a push that ended (or failed: a file cut
            # short while it was being rewritten), its next save is secured, until secure_by
            if not (self._look_pending(now) or self._follow(now)):
                self._state = State.DONE
            return []
        if self._state is State.WATCHING and self._queued is not None \
                and now >= self._last_start + self._interval_s():
            info, self._queued = self._queued, None
            return self._start("background", info, self._background_deadline(now), now)
        return []


def _build_table() -> dict[tuple[State, type[Any]], Handler]:
    everywhere: dict[type[Any], Handler] = {
        CheckpointSeen: Plan._on_checkpoint, ReadThrough: Plan._on_read_through, Tainted: Plan._on_taint,
        Tick: Plan._on_tick,
        RunOver: Plan._on_run_over, DeadlineMoved: Plan._on_deadline_moved, DestinationKnown: Plan._on_destination,
        OutputDirKnown: Plan._on_output_dir, AlreadySecured: Plan._on_already_secured,
        TrainingStarted: Plan._on_training_started, JobExited: Plan._on_job_exit, LookedOlder: Plan._on_looked,
    }
    table: dict[tuple[State, type[Any]], Handler] = {}
    for state in State:
        for kind, handler in everywhere.items():
            table[state, kind] = handler
        if state is not State.DONE:
            table[state, SignalReceived] = Plan._on_signal
    table[State.WATCHING, DeadlineNear] = Plan._on_deadline_near
    table[State.WATCHING, Failure] = Plan._on_failure
    return table


#: ``(state, event type) -> handler``: what each state accepts (anything else is logged and ignored).
TRANSITIONS: dict[tuple[State, type[Any]], Handler] = _build_table()
