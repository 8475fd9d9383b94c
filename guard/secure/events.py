"""What the securing plan hears and what it answers: events and actions as frozen data (``guard.secure.plan``).

Every event goes through ``Plan.on(event) -> list[Action]``; the plan's transition table says which states accept
which event types. Actions are carried out by ``guard.secure.securing.Securing`` (``RequestSave``, ``StopJob``,
``ForwardSignal``, ``Decide``, ``MarkSuspect``, ``RecordTaint``, ``ReleaseKept``, ``LookOlder``) or by the plan
itself through its pusher and returned for the record (``StartPush``, ``KillPush``, ``RestoreRecord``). All times are
the plan's ``clock`` seconds (monotonic).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from guard.secure.checkpoints import CheckpointInfo

__all__ = [
    "Action",
    "AlreadySecured",
    "CheckpointSeen",
    "DeadlineMoved",
    "DeadlineNear",
    "Decide",
    "DestinationKnown",
    "Event",
    "Failure",
    "ForwardSignal",
    "JobExited",
    "KillPush",
    "LookOlder",
    "LookedOlder",
    "MarkSuspect",
    "OutputDirKnown",
    "PushHandle",
    "Pusher",
    "ReadThrough",
    "RecordTaint",
    "ReleaseKept",
    "RequestSave",
    "RestoreRecord",
    "RunOver",
    "SignalReceived",
    "StartPush",
    "StopJob",
    "Tainted",
    "Tick",
    "TrainingStarted",
]


class PushHandle(Protocol):
    """A running push (``guard.secure.worker``'s handle): ``poll()`` is its result once over, else None;
    ``progress_at``: when (clock seconds) it last moved a byte, as of the last ``poll()``."""

    deadline: float

    @property
    def progress_at(self) -> float: ...

    def poll(self) -> Any: ...

    def kill(self, why: str = ...) -> Any: ...


class Pusher(Protocol):
    """Starts pushes (``guard.secure.worker.Pusher``): ``start(op, args, deadline) -> handle``."""

    def start(self, op: str, args: dict[str, Any], deadline: float) -> PushHandle: ...


# -- events ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointSeen:
    """A complete checkpoint appeared (the job's save event, or found complete in its output folder).

    ``requested``: the job said the save answered the guard's checkpoint request (True) or was its own, e.g. a
    periodic save already under way when the request came (False); None when not known (found on disk, a
    ``torch.save`` the agent saw).

    ``finite``: False when the agent saw a tensor of it that is not finite (``file_saved``'s ``finite``: the weights
    are a witness, whatever the loss said): suspect from its step on, never pushed; None when not checked."""

    info: CheckpointInfo
    requested: bool | None = None
    finite: bool | None = None


@dataclass(frozen=True)
class ReadThrough:
    """The losses of every training rank were read, all finite, through optimizer step ``step``: a save at or
    before it is no longer provisional (a save after it waits for its step's losses, ``Plan``'s hold)."""

    step: int


@dataclass(frozen=True)
class AlreadySecured:
    """The destination already holds ``info`` (the checkpoint a resumed run was fetched from, verified)."""

    info: CheckpointInfo
    destination: str
    revision: str


@dataclass(frozen=True)
class TrainingStarted:
    """A training step was seen: from now on the deadline's request follows the margin."""


@dataclass(frozen=True)
class DeadlineNear:
    """The deadline is within the margin (``Plan.deadline_due``). ``can_save``: the job answers a checkpoint
    request; ``handles_term``: it cannot, but saves on SIGTERM itself."""

    can_save: bool
    handles_term: bool = False


@dataclass(frozen=True)
class DeadlineMoved:
    """The scheduler moved the deadline (clock seconds; None: no deadline any more)."""

    deadline_at: float | None


@dataclass(frozen=True)
class SignalReceived:
    """A termination signal reached the guard: securing ends within ``--grace`` from now."""

    signum: int
    can_save: bool


@dataclass(frozen=True)
class Failure:
    """The run failed (``non_finite_loss``, ``stalled``, ``crash``, ``oom``, ``killed``, ``incomplete``).

    ``at``: when it failed (clock seconds), when fed later (after a scan of the output folder); None: now. The
    ``--grace`` window counts from it.
    """

    reason: str
    at: float | None = None


@dataclass(frozen=True)
class Tainted:
    """Step ``from_step`` was not finite: every save from :attr:`saves_from` on is suspect, in every state.
    ``witness``: ``"loss"`` (the step's loss), ``"grad_norm"`` (the step's gradient norm, its loss finite) or
    ``"weights"`` (a save at ``from_step`` holds a non-finite tensor)."""

    from_step: int
    witness: str = "loss"

    @property
    def saves_from(self) -> int:
        """The first save step made suspect. A save at step N holds the weights after N optimizer steps, and step
        N+1's loss is their forward pass: a non-finite loss at step S makes the save at S-1 suspect as well (its
        weights gave that loss; resumed, they give it again). A save holding a non-finite tensor is suspect itself."""
        return self.from_step if self.witness == "weights" else max(0, self.from_step - 1)


@dataclass(frozen=True)
class JobExited:
    """The job's main process ended. ``ok``: exit 0 and no failure decided; ``complete``: training ran to its end
    (a Trainer reached ``max_steps``/its epochs, a loop ended without a stop delivered to it);
    ``has_final_model``: its output folder holds final model files; ``final_files``: the only files of it that
    are the final model (an output folder that is not the job's own: the working folder of ``--save model.pt``),
    None for the whole folder; ``final_by_node_0``: a node other than 0 that secures its own parts of the
    checkpoints (many nodes, each with its own disk): node 0's guard pushes the final model, this one its part of
    the newest checkpoint."""

    ok: bool
    complete: bool = False
    has_final_model: bool = True
    final_files: tuple[str, ...] | None = None
    final_by_node_0: bool = False


@dataclass(frozen=True)
class DestinationKnown:
    """Where checkpoints go is now known (a pusher), or this guard must not push (None: another node's guard).
    ``kind``: ``"folder"``, ``"hub"`` or ``"s3"`` (``dest.base.Destination.kind``), for the derived push interval;
    None: unchanged."""

    pusher: Pusher | None
    kind: str | None = None


@dataclass(frozen=True)
class OutputDirKnown:
    """The job's output folder (for the final model push)."""

    path: str


@dataclass(frozen=True)
class LookedOlder:
    """The answer to ``LookOlder``: the newest complete checkpoint on disk saved before its step with finite
    weights, or None."""

    info: CheckpointInfo | None


@dataclass(frozen=True)
class Tick:
    """Timers and the running push; send at ``Plan.due_at`` (and whenever convenient)."""


@dataclass(frozen=True)
class RunOver:
    """The guard is about to write its VERDICT: a push still running is killed."""


Event = (CheckpointSeen | ReadThrough | AlreadySecured | TrainingStarted | DeadlineNear | DeadlineMoved
         | SignalReceived | Failure | Tainted | JobExited | DestinationKnown | OutputDirKnown | LookedOlder | Tick
         | RunOver)


# -- actions -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestSave:
    """Ask every agent for a checkpoint and then a stop."""

    stop: bool = True


@dataclass(frozen=True)
class StopJob:
    """SIGTERM the job at ``at`` (clock seconds) if it still runs, SIGKILL ``grace_s`` later; an earlier stop
    already set stands."""

    at: float
    grace_s: float = 1.0


@dataclass(frozen=True)
class ForwardSignal:
    """Send ``signum`` to the job now (it cannot answer a checkpoint request: its own handler saves)."""

    signum: int


@dataclass(frozen=True)
class Decide:
    """The run's outcome: ``TIMEOUT``/``deadline`` or ``INTERRUPTED``/``signal``."""

    status: str
    reason: str
    signum: int | None = None


@dataclass(frozen=True)
class StartPush:
    """A push started (carried out by the plan): ``kind`` ``background``/``securing``/``final``; ``deadline`` is
    when its worker is killed; ``estimate_s`` the margin estimator's time for it at the start."""

    kind: str
    path: str
    step: int | None
    deadline: float
    estimate_s: float = 0.0


@dataclass(frozen=True)
class KillPush:
    """The running push was killed (``why``: ``deadline``, ``superseded``, ``stalled`` (no progress, a newer
    checkpoint replaces it), ``suspect``, ``final``, ``killed``)."""

    why: str
    path: str | None = None
    step: int | None = None


@dataclass(frozen=True)
class MarkSuspect:
    """Mark the checkpoint at ``path`` (step ``step``) as saved at or after the first non-finite step
    (``checkpoints.mark_suspect``)."""

    path: str
    step: int | None
    first_bad_step: int


@dataclass(frozen=True)
class RecordTaint:
    """Record the run's taint (its first suspect save step, ``first_bad_step``: ``Tainted.saves_from``) beside its
    output folders (``suspects.record_taint``): resume refuses every checkpoint of the run from that step on."""

    first_bad_step: int


@dataclass(frozen=True)
class RestoreRecord:
    """The destination's record names a suspect save (step ``from_step``): it was moved back (carried out by the
    plan through its pusher, as ``StartPush``: the worker's ``restore_checkpoint``) to the newest good record, step
    ``step`` at ``revision`` (a Hub commit id, an S3 ETag, a folder's path), without uploading it again; ``deadline``:
    when the worker is killed."""

    step: int | None
    revision: str
    from_step: int | None
    deadline: float


@dataclass(frozen=True)
class ReleaseKept:
    """The destination's record (step ``step``) can no longer turn suspect (the losses after its step were read
    finite): the older record kept aside to move back to (a folder's ``.last-checkpoint.kept``) may go."""

    step: int | None


@dataclass(frozen=True)
class LookOlder:
    """Look on disk for the newest complete checkpoint saved before step ``before_step`` whose weights are finite,
    by ``until`` (clock seconds); the answer comes back as ``LookedOlder``. The scans hand the plan the newest
    complete save only: the saves between two scans, whole on disk, were never seen."""

    before_step: int
    until: float


Action = (RequestSave | StopJob | ForwardSignal | Decide | StartPush | KillPush | MarkSuspect | RecordTaint
          | RestoreRecord | ReleaseKept | LookOlder)
