"""The securing plan: one state machine, one deadline (``secure_by``), pushes in a killable worker.

The plan decides *what* to secure and *when*; it knows nothing about processes, sockets or the VERDICT's text.
Events come in as method calls (``checkpoint``, ``deadline_near``, ``signal``, ``job_exit``, ``failure``, ``tick``
for push results and timers); each returns the actions the supervisor's loop carries out, as plain data
(``RequestSave``, ``StopJob``, ``ForwardSignal``, ``Decide``; ``StartPush``/``KillPush`` are carried out by the
plan itself through its ``pusher`` and returned for the record). Its collaborators are typed and injectable: a
monotonic ``clock``, a ``pusher`` (``guard.secure.worker.Pusher``: ``start(op, args, deadline) -> handle`` with
``poll()`` and ``kill()``) and the margin ``estimator`` (``budget.MarginEstimator``).

States::

    WATCHING -- deadline near / signal (job can save) --> AWAITING_SAVE -- fresh save / wait over --> SECURING
    WATCHING -- signal (job cannot save) --> AWAITING_SAVE (the signal is forwarded; what the job writes is pushed)
    SECURING -- push done, job cannot save and still runs --> AWAITING_SAVE (its next save is pushed too)
    WATCHING -- failure --> SECURING (the newest complete checkpoint saved before the failure)
    WATCHING -- job ended well --> FINAL_PUSH --> DONE
    AWAITING_SAVE / SECURING -- push done or secure_by passed --> DONE

``secure_by`` is the one time by which securing is over: the deadline less ``SAFETY_S``, or ``--grace`` after a
signal (every signal, in every state, shortens it to at most that), or ``--grace`` after a failure. The running
push's deadline follows it. In ``WATCHING``, complete checkpoints are pushed as they appear (background securing):
one at a time, a newer one replacing a queued one, at most one push start per ``push_interval_s``.
"""

from __future__ import annotations

import enum
import logging
import math
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from guard.secure.budget import MarginEstimator
from guard.secure.checkpoints import CheckpointInfo, rewritten_after

__all__ = ["SAFETY_S", "STOP_BEFORE_S", "Decide", "ForwardSignal", "KillPush", "Plan", "PushRecord", "RequestSave",
           "StartPush", "State", "StopJob"]

log = logging.getLogger("guard.secure")

SAFETY_S = 1.5  # securing is over this long before the kill (the deadline, or the end of --grace)
STOP_BEFORE_S = 2.0  # the job is stopped (SIGTERM) this long before secure_by if it still runs
LATE_REQUEST_S = 15.0  # before the first training step, the deadline's request waits until this long before it


class State(enum.Enum):
    WATCHING = "watching"  # training; background pushes
    AWAITING_SAVE = "awaiting_save"  # the job was asked for a checkpoint (or signalled): waiting for its save
    SECURING = "securing"  # pushing the checkpoint that ends the run
    FINAL_PUSH = "final_push"  # the job ended well: pushing its final model
    DONE = "done"


# -- actions (plain data) ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestSave:
    """Ask every agent for a checkpoint and then a stop; ``at_step`` for collective saves (several ranks)."""

    stop: bool = True


@dataclass(frozen=True)
class StopJob:
    """SIGTERM the job at ``at`` (clock seconds) if it still runs, SIGKILL ``grace_s`` later."""

    at: float
    grace_s: float = 1.0


@dataclass(frozen=True)
class ForwardSignal:
    """Send ``signum`` to the job now (it cannot answer a checkpoint request: its own handler saves)."""

    signum: int


@dataclass(frozen=True)
class Decide:
    """The run's outcome: ``status``/``reason`` (``TIMEOUT``/``deadline``, ``INTERRUPTED``/``signal``)."""

    status: str
    reason: str
    signum: int | None = None


@dataclass(frozen=True)
class StartPush:
    kind: str  # "background", "securing", "final"
    path: str
    step: int | None
    deadline: float


@dataclass(frozen=True)
class KillPush:
    why: str


Action = RequestSave | StopJob | ForwardSignal | Decide | StartPush | KillPush


class PushHandle(Protocol):
    deadline: float

    def poll(self) -> Any: ...

    def kill(self, why: str = ...) -> Any: ...


class Pusher(Protocol):
    def start(self, op: str, args: dict[str, Any], deadline: float) -> PushHandle: ...


@dataclass
class PushRecord:
    """A push: what, when, and how it ended (``result``: ``worker.WorkResult``-like, None while it runs)."""

    kind: str
    info: CheckpointInfo | None
    handle: PushHandle
    started: float
    result: Any = None


@dataclass(frozen=True)
class PriorPush:
    """A checkpoint the destination already holds, verified when it was fetched: the one a resumed run started
    from. Shaped like a push result (``ok``, ``pushed``, ``files`` ...) so that it stands as ``Plan.secured``."""

    destination: str
    revision: str
    files: tuple[str, ...]
    size_bytes: int
    step: int | None
    ok: bool = True
    killed: bool = False
    elapsed_s: float = 0.0
    attempts: int = 0
    error: str | None = None
    hint: str | None = None

    @property
    def pushed(self) -> str:
        return f"{self.destination}@{self.revision}"


class _Ended:
    """The handle of a push that is over (``PriorPush``)."""

    def __init__(self, result: PriorPush) -> None:
        self.result = result
        self.deadline = 0.0

    def poll(self) -> PriorPush:
        return self.result

    def kill(self, why: str = "killed") -> PriorPush:
        return self.result



def _unchanged(info: CheckpointInfo) -> bool:
    """Every file of ``info`` is still there, none modified after the checkpoint was seen complete."""
    return rewritten_after(info.folder, info.files, info.newest_mtime_s) is None


def _step(info: CheckpointInfo | None) -> int:
    return -1 if info is None or info.step is None else info.step


@dataclass
class Plan:
    """The securing policy (see the module docstring). All times are ``clock`` seconds.

    Args:
        clock: monotonic seconds.
        pusher: starts pushes (``worker.Pusher``), or None without a destination.
        estimator: the margin estimator; pushes measured here feed it.
        deadline_at: the platform's deadline in clock seconds, or None.
        grace_s: ``--grace`` (seconds from a signal to the platform's SIGKILL).
        background: push complete checkpoints as they appear (``--background-push``).
        push_interval_s: the least time between two background push starts (``--push-interval``).
        final_output_dir: the job's output folder for the final model push, or None.
    """

    clock: Callable[[], float]
    pusher: Pusher | None
    estimator: MarginEstimator
    deadline_at: float | None = None
    grace_s: float = 30.0
    background: bool = True
    push_interval_s: float = 600.0
    final_output_dir: str | None = None
    state: State = State.WATCHING
    secure_by: float = math.inf
    trigger: str | None = None  # "deadline", "signal", "failure", "ended" (ended well, no final model files)
    failure_reason: str | None = None
    signum: int | None = None
    push: PushRecord | None = None
    queued: CheckpointInfo | None = None
    secured: PushRecord | None = None  # the newest verified checkpoint push
    final: PushRecord | None = None
    error: Any = None  # the last failed securing/final push result
    newest: CheckpointInfo | None = None  # the newest complete checkpoint that may be secured
    suspect: CheckpointInfo | None = None  # saved at or after the first non-finite step: never pushed
    bad_from_step: int | None = None
    wait_save_until: float | None = None
    awaiting_after_step: int = -1  # a fresh save is newer than this
    follow_saves: bool = False  # the job cannot be asked to save: every save it makes until it ends is secured
    job_ended: bool = False
    training_started: bool = False  # a training step was seen: before it there is nothing new to ask for
    last_start: float = -math.inf
    history: list[PushRecord] = field(default_factory=list)
    seen: list[CheckpointInfo] = field(default_factory=list)  # every complete checkpoint seen, oldest first

    # -- queries ----------------------------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Securing has started and is not over (the supervisor keeps its loop running)."""
        return self.state in (State.AWAITING_SAVE, State.SECURING, State.FINAL_PUSH)

    def due_at(self, now: float) -> float:
        """The next time ``tick`` has work."""
        due = [self.secure_by]
        if self.push is not None:
            due.append(now + 0.2)
        if self.wait_save_until is not None:
            due.append(self.wait_save_until)
        if self.state is State.WATCHING:
            if self.deadline_at is not None:
                due.append(self._deadline_request_at())
            if self.queued is not None and self.push is None:
                due.append(self.last_start + self.push_interval_s)
        return min(due)

    def _deadline_request_at(self) -> float:
        """When to ask for the last checkpoint: ``margin`` before the deadline once training has started. Before the
        first step there is nothing new to save, and the margin still rests on guessed sizes, so asking then would
        only stop a job that is still loading (a short budget with a slow start): wait until the last moment that
        still leaves time to stop the job and secure what is already on disk (``LATE_REQUEST_S``)."""
        assert self.deadline_at is not None
        margin_s = self.estimator.margin_s() if self.training_started else min(self.estimator.margin_s(),
                                                                                LATE_REQUEST_S)
        return self.deadline_at - margin_s

    def deadline_due(self, now: float) -> bool:
        return self.state is State.WATCHING and self.deadline_at is not None and now >= self._deadline_request_at()

    # -- events -----------------------------------------------------------------------------------------------

    def already_secured(self, info: CheckpointInfo, *, destination: str, revision: str) -> None:
        """The destination already holds ``info``: the checkpoint a resumed run was fetched from (and verified).
        It stands as the secured one until a newer one is, so a deadline or signal before the job's first save
        still ends with exit 75 naming it, not "nothing secured"."""
        result = PriorPush(destination, revision, tuple(info.files), info.size_bytes, info.step)
        self.secured = PushRecord("resumed", info, _Ended(result), self.clock(), result)
        if _step(info) >= _step(self.newest):
            self.newest = info


    def checkpoint(self, info: CheckpointInfo) -> list[Action]:
        """A complete checkpoint appeared (the job's save event, or found complete in its output folder)."""
        now = self.clock()
        if self.bad_from_step is not None and info.step is not None and info.step >= self.bad_from_step:
            self.suspect = info
            log.warning("checkpoint %s was saved after the first non-finite loss (step %d): suspect, not pushed",
                        info.path, self.bad_from_step)
            return []
        if _step(info) < _step(self.newest) or (self.newest is not None and info.path == self.newest.path
                                                   and info.newest_mtime_s <= self.newest.newest_mtime_s):
            return []
        previous, self.newest = self.newest, info
        self.seen.append(info)
        if self.pusher is None or self.state in (State.DONE, State.FINAL_PUSH):
            return []
        if self.state is State.WATCHING:
            if not self.background:
                return []
            if self.push is not None or now < self.last_start + self.push_interval_s:
                self.queued = info  # a newer one replaces a queued one
                return []
            return self._start("background", info, self._background_deadline(now))
        rewritten = previous is not None and info.path == previous.path and _step(info) == _step(previous)
        if self.state is State.AWAITING_SAVE and (_step(info) > self.awaiting_after_step or rewritten):
            # a fresh save: a later step, or the same file saved over in place (nanoGPT's ckpt.pt, step unknown)
            self.wait_save_until = None
            self.state = State.SECURING
            return self._secure_newest()
        if self.state is State.SECURING:
            return self._newer_while_securing(info, now)
        return []

    def deadline_near(self, *, can_save: bool, handles_term: bool = False) -> list[Action]:
        """The deadline is within the margin: ask for a fresh checkpoint (or secure the newest) before it. A job
        that cannot be asked but saves on SIGTERM itself (``handles_term``) gets SIGTERM now, so that its own save
        has the margin, not the last seconds."""
        if self.state is not State.WATCHING or self.deadline_at is None:
            return []
        now = self.clock()
        self.trigger = "deadline"
        self.secure_by = self.deadline_at - SAFETY_S
        log.warning("deadline in %.0fs: securing a checkpoint (margin %.0fs)", self.deadline_at - now,
                    self.estimator.margin_s())
        actions: list[Action] = [Decide("TIMEOUT", "deadline"), StopJob(self.secure_by - STOP_BEFORE_S)]
        return actions + self._await_save(now, can_save, signum=None, term_now=handles_term)

    def signal(self, signum: int, *, can_save: bool) -> list[Action]:
        """A termination signal: securing ends within ``--grace`` from now, whatever runs."""
        now = self.clock()
        by = now + self.grace_s - SAFETY_S
        if self.state is State.DONE:
            return []
        if self.signum is None:
            self.signum = signum
        if self.state is State.WATCHING:
            self.trigger = "signal"
            self.secure_by = by
            log.warning("signal %d received: securing a checkpoint within --grace %.0fs", signum, self.grace_s)
            actions: list[Action] = [Decide("INTERRUPTED", "signal", signum), StopJob(self.secure_by - STOP_BEFORE_S)]
            return actions + self._await_save(now, can_save, signum=signum)
        log.warning("signal %d received while %s: ending within --grace (%.0fs)", signum,
                    self.state.value.replace("_", " "), max(0.0, min(self.secure_by, by) - now))
        self._shorten(by)
        if self.state is State.FINAL_PUSH and self.trigger is None:
            self.trigger = "signal"
        return []

    def failure(self, reason: str, *, bad_from_step: int | None = None) -> list[Action]:
        """The run failed (non-finite loss, stall, crash, OOM, killed, incomplete): secure the newest complete
        checkpoint saved before it, within ``--grace`` or the deadline, whichever is first."""
        if self.state in (State.DONE, State.FINAL_PUSH) or self.trigger is not None:
            return []
        now = self.clock()
        self.trigger = "failure"
        self.failure_reason = reason
        self.secure_by = now + self.grace_s - SAFETY_S
        if self.deadline_at is not None:
            self.secure_by = min(self.secure_by, self.deadline_at - SAFETY_S)
        if bad_from_step is not None:
            self.bad_from_step = bad_from_step
            if self.newest is not None and self.newest.step is not None and self.newest.step >= bad_from_step:
                self.suspect, self.newest = self.newest, self._older_than(bad_from_step)
                log.warning("checkpoint %s was saved after the first non-finite loss (step %d): suspect, not pushed",
                            self.suspect.path, bad_from_step)
        self.state = State.SECURING
        return self._secure_newest()

    def job_exit(self, *, ok: bool, has_final_model: bool = True) -> list[Action]:
        """The job's main process ended (``ok``: exit 0 and no outcome decided by the guard; ``has_final_model``:
        its output folder holds final model files). A job that ended well without final model files has its newest
        checkpoint secured instead (if not already)."""
        self.job_ended = True
        if self.state is State.AWAITING_SAVE:
            self.wait_save_until = None
            self.state = State.SECURING
            return self._secure_newest()
        if self.state is State.WATCHING and ok and self.pusher is not None and self.final_output_dir \
                and not has_final_model:
            log.warning("the job ended well but wrote no final model files to %s: securing its newest checkpoint "
                        "instead", self.final_output_dir)
            self.trigger = "ended"
            self.state = State.SECURING
            self.secure_by = self._final_bound(self.clock())
            return self._secure_newest()
        if self.state is State.WATCHING and ok and self.pusher is not None and self.final_output_dir:
            actions = self._kill("the final model supersedes it") if self.push is not None else []
            now = self.clock()
            self.secure_by = self._final_bound(now)
            self.state = State.FINAL_PUSH
            log.info("the job ended: securing the final model from %s", self.final_output_dir)
            handle = self.pusher.start("push_final", {"output_dir": str(self.final_output_dir)}, self.secure_by)
            self.push = self.final = PushRecord("final", None, handle, now)
            self.history.append(self.push)
            return [*actions, StartPush("final", str(self.final_output_dir), None, self.secure_by)]
        if self.state is State.WATCHING and self.push is None:
            self.state = State.DONE
        return []

    def _final_bound(self, now: float) -> float:
        """When securing after a good end is over: 3x the estimate plus two minutes, never past the deadline."""
        bound = now + max(self.estimator.secure_estimate_s() * 3 + 120, 5.0)
        return min(bound, self.deadline_at - SAFETY_S) if self.deadline_at is not None else bound

    def tick(self) -> list[Action]:
        """Timers and the running push: call from the loop at ``due_at`` (and whenever convenient)."""
        now = self.clock()
        actions: list[Action] = []
        if self.push is not None:
            self.push.handle.deadline = min(self.push.handle.deadline, self.secure_by)
            result = self.push.handle.poll()
            if result is not None:
                actions += self._push_ended(result, now)
            elif self.push.info is not None:  # a push running longer than the rate allows lowers it now
                self.estimator.observe_push_progress(self.push.info.size_bytes, now - self.push.started)
        if self.wait_save_until is not None and now >= self.wait_save_until and self.state is State.AWAITING_SAVE:
            log.warning("the job did not save a checkpoint in time: securing the newest complete one")
            self.wait_save_until = None
            self.state = State.SECURING
            actions += self._secure_newest()
        if (self.state is State.WATCHING and self.queued is not None and self.push is None
                and now >= self.last_start + self.push_interval_s):
            info, self.queued = self.queued, None
            actions += self._start("background", info, self._background_deadline(now))
        if self.busy and now >= self.secure_by:
            if self.push is not None:
                actions += self._kill("deadline")
            if self.state is not State.DONE:
                log.warning("securing ran out of time")
                self.state = State.DONE
        return actions

    def stop(self) -> list[Action]:
        """The run is over (the guard is about to write its VERDICT): kill a push still running."""
        return self._kill("killed") if self.push is not None else []

    # -- internals --------------------------------------------------------------------------------------------

    def _await_save(self, now: float, can_save: bool, signum: int | None, term_now: bool = False) -> list[Action]:
        self.state = State.AWAITING_SAVE
        self.awaiting_after_step = _step(self.newest)
        if self.push is not None:
            self.push.handle.deadline = min(self.push.handle.deadline, self.secure_by)
        left_s = self.secure_by - now
        fallback = self.newest if self._unsecured(self.newest) else None
        reserve_s = self.estimator.secure_estimate_s(fallback.size_bytes) if fallback is not None else 0.0
        self.wait_save_until = now + max(0.5 * left_s, left_s - reserve_s, 0.0)
        if can_save:
            log.info("waiting up to %.0fs for the job's checkpoint", self.wait_save_until - now)
            return [RequestSave()]
        self.follow_saves = True
        if signum is None and term_now:
            log.info("the job cannot be asked for a checkpoint but saves on SIGTERM itself: SIGTERM now, %.0fs "
                     "before the deadline; what it writes is secured", self.secure_by + SAFETY_S - now)
            return [ForwardSignal(signal.SIGTERM)]
        log.info("the job cannot be asked for a checkpoint (no guard API, no Trainer): %s; what it writes is "
                 "secured", "the signal goes to it now" if signum is not None else "it is stopped before the deadline")
        return [ForwardSignal(signum)] if signum is not None else []

    def _follow(self) -> bool:
        """A job that cannot be asked to save runs on until it is stopped (or ends): wait for its next save
        (pushed as it appears) instead of ending securing; ``secure_by`` still ends it."""
        if not self.follow_saves or self.job_ended or self.pusher is None or self.clock() >= self.secure_by:
            return False
        self.state = State.AWAITING_SAVE
        self.awaiting_after_step = _step(self.newest)
        self.wait_save_until = None
        return True

    def _shorten(self, by: float) -> None:
        self.secure_by = min(self.secure_by, by)
        if self.wait_save_until is not None:
            self.wait_save_until = min(self.wait_save_until, self.secure_by)
        if self.push is not None:
            self.push.handle.deadline = min(self.push.handle.deadline, self.secure_by)

    def _unsecured(self, info: CheckpointInfo | None) -> bool:
        if info is None:
            return False
        done = self.secured.info if self.secured is not None else None
        return done is None or _step(info) > _step(done) or (
            _step(info) == _step(done) and (info.path != done.path or info.newest_mtime_s > done.newest_mtime_s))

    def _older_than(self, step: int) -> CheckpointInfo | None:
        """The newest checkpoint saved before ``step`` that is still on disk as it was saved (a loop that saves
        ``ckpt.pt`` again in place leaves no older one), else the newest one pushed before it."""
        for info in reversed(self.seen):
            if _step(info) < step and _unchanged(info):
                return info
        done = self.secured.info if self.secured is not None else None
        for record in reversed(self.history):
            if record.info is not None and _step(record.info) < step and (record.result is None or record.result.ok):
                return record.info
        return done if done is not None and _step(done) < step else None

    def _secure_newest(self) -> list[Action]:
        """In SECURING: push the newest unsecured checkpoint (keep a push of it already running); else done."""
        target = self.newest
        if self.push is not None and self.push.info is not None and target is not None \
                and self.push.info.path == target.path and _step(self.push.info) == _step(target) \
                and target.newest_mtime_s <= self.push.info.newest_mtime_s:
            self.push.kind = "securing"
            return []
        actions: list[Action] = []
        if self.push is not None:
            actions += self._kill("a newer checkpoint supersedes it")
        if self.pusher is None or not self._unsecured(target):
            if self._follow():
                return actions
            if target is None:
                log.error("no complete checkpoint to secure")
            self.state = State.DONE
            return actions
        assert target is not None
        return actions + self._start("securing", target, self.secure_by)

    def _newer_while_securing(self, info: CheckpointInfo, now: float) -> list[Action]:
        """A newer complete checkpoint appeared while SECURING (a job that saves on its own schedule, e.g. one that
        cannot answer a checkpoint request). By the estimates: when the running push can end and the newer one
        still be pushed after it before ``secure_by``, both happen in turn (``_push_ended``); else, when the newer
        one alone can be pushed in time, it supersedes the running push; else the running push is kept."""
        running = self.push
        if running is None:
            return self._secure_newest()
        if running.info is None or not self._unsecured(info) or _step(info) < _step(running.info) or (
                info.path == running.info.path and _step(info) == _step(running.info)
                and info.newest_mtime_s <= running.info.newest_mtime_s):
            return []
        left_s = self.secure_by - now
        need_s = self.estimator.secure_estimate_s(info.size_bytes)
        running_left_s = max(0.0, self.estimator.secure_estimate_s(running.info.size_bytes) - (now - running.started))
        if running_left_s + need_s <= left_s:
            log.info("checkpoint %s (step %s) saved while %s is pushed: it follows (about %.0fs + %.0fs of %.0fs "
                     "left)", info.path, info.step, running.info.path, running_left_s, need_s, left_s)
            return []
        if need_s <= left_s:
            log.warning("checkpoint %s (step %s) saved while %s is pushed: pushing it instead (about %.0fs needed, "
                        "%.0fs left; not enough for both)", info.path, info.step, running.info.path, need_s, left_s)
            return self._secure_newest()
        log.info("checkpoint %s (step %s) saved while %s is pushed: too late to push it (about %.0fs needed, %.0fs "
                 "left): the running push goes on", info.path, info.step, running.info.path, need_s, left_s)
        return []

    def _background_deadline(self, now: float) -> float:
        """A background push may take 3x its estimate plus a minute, and never past securing's end."""
        bound = now + 3 * self.estimator.secure_estimate_s() + 60.0
        if self.deadline_at is not None:
            bound = min(bound, self.deadline_at - SAFETY_S)
        return min(bound, self.secure_by)

    def _start(self, kind: str, info: CheckpointInfo, deadline: float) -> list[Action]:
        assert self.pusher is not None
        now = self.clock()
        self.last_start = now if kind == "background" else self.last_start
        log.info("securing %s (step %s, %.1f MB)%s, %.0fs allowed", info.path, info.step, info.size_bytes / 1e6,
                 " in the background" if kind == "background" else "", deadline - now)
        handle = self.pusher.start("push_checkpoint", {"local_dir": str(info.folder), "step": info.step or 0,
                                                       "files": list(info.files),
                                                       # after a NaN, a file rewritten since its save holds
                                                       # the bad weights: refuse it (see Securer.push_checkpoint)
                                                       "saved_by_s": info.newest_mtime_s
                                                       if self.bad_from_step is not None else None}, deadline)
        self.push = PushRecord(kind, info, handle, now)
        self.history.append(self.push)
        return [StartPush(kind, str(info.path), info.step, deadline)]

    def _kill(self, why: str) -> list[Action]:
        record, self.push = self.push, None
        if record is None:
            return []
        record.result = record.handle.kill("deadline" if why == "deadline" else "killed")
        log.warning("push of %s stopped: %s", record.info.path if record.info else "the final model", why)
        if record.kind in ("securing", "final"):
            self.error = record.result
        return [KillPush(why)]

    def _push_ended(self, result: Any, now: float) -> list[Action]:
        record, self.push = self.push, None
        assert record is not None
        record.result = result
        if result.ok:
            if result.elapsed_s > 0 and result.size_bytes > 0:
                self.estimator.observe_push(result.size_bytes, result.elapsed_s)
            if record.kind == "final":
                log.info("final model secured and verified: %s", result.pushed)
            else:
                if self.secured is None or _step(record.info) >= _step(self.secured.info):
                    self.secured = record
                log.info("secured and verified: %s (step %s, %.1f MB in %.1fs)", result.pushed,
                         record.info.step if record.info else None, result.size_bytes / 1e6, result.elapsed_s)
        else:
            log.error("%s", result.error)
            if record.kind != "background":
                self.error = result
        if self.state is State.FINAL_PUSH:
            self.state = State.DONE
            return []
        if self.state is State.SECURING:
            if now < self.secure_by and self._unsecured(self.newest) and (result.ok or self.newest is not record.info):
                return self._secure_newest()  # a newer one appeared meanwhile (also after a failed push)
            if not (result.ok and self._follow()):
                self.state = State.DONE
            return []
        if self.state is State.WATCHING and self.queued is not None and now >= self.last_start + self.push_interval_s:
            info, self.queued = self.queued, None
            return self._start("background", info, self._background_deadline(now))
        return []
