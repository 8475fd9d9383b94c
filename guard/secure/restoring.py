"""What the securing plan needs to move the destination's record back (``guard.secure.plan``'s ``_restore``).

A taint can reach a push whose record has already moved (its step's losses were read after its record, or the
witness came late: a rank behind, the job's exit, the step before a non-finite loss). Its record then names a
suspect save. The plan moves it back to the newest good record (the newest verified push of a save before the
first suspect step, or the record a resumed run was fetched from) with the worker's ``restore_checkpoint``
(``securer.Securer.restore_checkpoint``): no byte uploaded again, so it fits where a push would not. Only where the
store cannot (it keeps no older copy, the older record is gone) is the good checkpoint pushed again; when neither
ends well, the plan's report says so (``PlanReport.suspect_held``) and the VERDICT says ``secured=no`` and that
the destination still holds the suspect checkpoint.

Pure functions of plain data; nothing here runs a push.
"""

from __future__ import annotations

from typing import Any

__all__ = ["held_said", "restore_args", "revision_of"]


def revision_of(result: Any) -> str | None:
    """The destination's revision a push's result names: a push that ended well (``revision``), one stopped after
    its record moved (``data["recorded_revision"]``), a resumed record (``PriorPush.revision``); else None."""
    revision = getattr(result, "revision", None)
    if isinstance(revision, str) and revision:
        return revision
    data = getattr(result, "data", None)
    recorded = data.get("recorded_revision") if isinstance(data, dict) else None
    return recorded if isinstance(recorded, str) and recorded else None


def restore_args(step: int | None, result: Any, from_step: int | None) -> dict[str, Any] | None:
    """The worker's ``restore_checkpoint`` arguments to move the record back to the good push of ``step`` whose
    result is ``result`` (over the suspect step ``from_step``), or None when that record cannot be named (no step,
    no revision): the checkpoint is pushed again instead."""
    revision = revision_of(result)
    if step is None or revision is None:
        return None
    return {"step": step, "revision": revision, "from_step": from_step}


def held_said(step: int | None, path: str | None) -> str:
    """The hint's clause when the destination's record still names a suspect save (moving it back failed, or no
    time was left): never claim otherwise."""
    what = f"checkpoint step {step}" if step is not None else "a checkpoint"
    where = f" ({path})" if path else ""
    return (f"the destination still holds {what}{where}, saved from the step before the first non-finite loss on: "
            "its record could not be moved back in time; --resume refuses it")
