"""What the securing plan shows of itself: its states, and the frozen snapshot ``Plan.report()`` returns
(``PlanReport``, with a ``PushView`` per push), from which the VERDICT's checkpoint fields are filled
(``guard.secure.outcome``). ``PushRecord`` is the plan's own mutable record of a push; only ``guard.secure.plan``
holds one."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from guard.secure.checkpoints import CheckpointInfo
from guard.secure.dest.base import pushed_text
from guard.secure.events import PushHandle

__all__ = ["EndedHandle", "PlanReport", "PriorPush", "PushRecord", "PushView", "State"]


class State(enum.Enum):
    WATCHING = "watching"  # training; background pushes
    AWAITING_SAVE = "awaiting_save"  # the job was asked for a checkpoint (or signalled): waiting for its save
    SECURING = "securing"  # pushing the checkpoint that ends the run
    FINAL_PUSH = "final_push"  # the job ended well: pushing its final model
    DONE = "done"


#: ``WorkResult.error_type`` of a push refused because the job wrote the checkpoint again after that save
#: (``guard.errors.CheckpointRewrittenError``, by name: nothing here imports the error classes)
REWRITTEN = "CheckpointRewrittenError"
#: ``WorkResult.error_type`` of a push refused because the save's weights hold a NaN or an infinity
#: (``guard.errors.WeightsNotFiniteError``, read by ``guard.secure.weights``): a witness of the run's first
#: non-finite step, as the agent's
NOT_FINITE = "WeightsNotFiniteError"


@dataclass(frozen=True)
class PriorPush:
    """A checkpoint the destination already holds, verified when it was fetched: the one a resumed run started
    from. Shaped like a push result (``ok``, ``pushed``, ``files`` ...) so that it stands as the secured one."""

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
        return pushed_text(self.destination, self.revision)


class EndedHandle:
    """The handle of a push that is over (``PriorPush``)."""

    def __init__(self, result: PriorPush) -> None:
        self.result = result
        self.deadline = 0.0
        self.progress_at = 0.0

    def poll(self) -> PriorPush:
        return self.result

    def kill(self, why: str = "killed") -> PriorPush:
        return self.result


class PushRecord:
    """A push while the plan holds it (private: the report shows a ``PushView``)."""

    def __init__(self, kind: str, info: CheckpointInfo | None, handle: PushHandle, started: float,
                 result: Any = None) -> None:
        self.kind, self.info, self.handle, self.started, self.result = kind, info, handle, started, result

    def view(self) -> PushView:
        result = self.result
        return PushView(
            kind=self.kind, path=str(self.info.path) if self.info is not None else None,
            step=self.info.step if self.info is not None else None, info=self.info,
            running=result is None, ok=bool(result is not None and result.ok),
            killed=bool(result is not None and getattr(result, "killed", False)),
            pushed=getattr(result, "pushed", None) if result is not None and (
                result.ok or getattr(result, "recorded_step", None) is not None) else None,
            destination=getattr(result, "destination", None) if result is not None else None,
            files=len(getattr(result, "files", ()) or ()) if result is not None else 0,
            size_bytes=int(getattr(result, "size_bytes", 0) or 0) if result is not None else 0,
            elapsed_s=float(getattr(result, "elapsed_s", 0.0) or 0.0) if result is not None else 0.0,
            attempts=int(getattr(result, "attempts", 0) or 0) if result is not None else 0,
            error=getattr(result, "error", None) if result is not None else None,
            hint=getattr(result, "hint", None) if result is not None else None,
            rewritten=bool(result is not None and getattr(result, "error_type", None) == REWRITTEN),
            not_finite=bool(result is not None and getattr(result, "error_type", None) == NOT_FINITE),
            missing=getattr(result, "missing", None) if result is not None else None)


@dataclass(frozen=True)
class PushView:
    """One push as the report shows it: what (``kind``, ``path``, ``step``) and how it ended (``running`` while it
    runs; ``ok``, ``killed``, ``pushed`` = ``DEST@REVISION``, ``destination``, ``files`` count, ``size_bytes``,
    ``elapsed_s``, ``attempts``, ``error``, ``hint``; ``rewritten``: refused because the job wrote the checkpoint
    again after that save, see ``REWRITTEN``; ``not_finite``: refused because the weights it holds are not finite,
    see ``NOT_FINITE``; ``missing``: a many-node checkpoint whose other parts never came)."""

    kind: str
    path: str | None
    step: int | None
    info: CheckpointInfo | None
    running: bool
    ok: bool
    killed: bool
    pushed: str | None
    destination: str | None
    files: int
    size_bytes: int
    elapsed_s: float
    attempts: int
    error: str | None
    hint: str | None
    rewritten: bool = False
    not_finite: bool = False
    missing: str | None = None  # a many-node checkpoint not whole at the destination: what is missing (``node1``)


@dataclass(frozen=True)
class PlanReport:
    """A frozen snapshot of the plan (``Plan.report``): all the VERDICT needs.

    Attributes:
        state: the plan's state. trigger: ``deadline``, ``signal``, ``failure``, ``ended`` (ended well, no final
            model files: the newest checkpoint secured), or None. failure_reason: the failure's reason, or None.
        signum: the first signal received, or None. secure_by / deadline_at: clock seconds (``inf``/None).
        secured: the newest verified checkpoint push (never a suspect, incomplete or killed one), or None.
        newest: the newest complete checkpoint that may be secured (never a suspect), or None.
        suspect: the newest checkpoint saved at or after the first non-finite step, or None; suspects: all of them.
        non_finite_from_step: the first non-finite step heard of, or None. suspect_from_step: the first suspect save
            step (``Tainted.saves_from``: the step before a non-finite loss, whose weights gave it), or None.
        final: the final model's push, or None. error: the last failed securing/final push, or None.
        history: every push, oldest first. has_pusher: a destination is known and this guard pushes.
        training_complete: the job ended having trained to its end (PASS, even after the deadline's request).
        superseded_trigger: the trigger a complete training replaced (``deadline``), or None.
        final_wanted: the job ended well with final model files to push (``final`` None: it never started, no
            time was left after the running push).
        ignored: ``"State/Event"`` for every event a state did not accept, in order.
        suspect_held: the push of a suspect save that the destination's record still names (a taint reached it
            after its record moved, and moving the record back failed or had no time), or None.
    """

    state: State
    trigger: str | None
    failure_reason: str | None
    signum: int | None
    secure_by: float
    deadline_at: float | None
    secured: PushView | None
    newest: CheckpointInfo | None
    suspect: CheckpointInfo | None
    suspects: tuple[CheckpointInfo, ...]
    non_finite_from_step: int | None
    final: PushView | None
    error: PushView | None
    history: tuple[PushView, ...]
    has_pusher: bool
    training_complete: bool
    superseded_trigger: str | None
    final_wanted: bool
    ignored: tuple[str, ...]
    suspect_from_step: int | None = None
    suspect_held: PushView | None = None
