"""The securing plan's pure rules for choosing checkpoints and pushes (``guard.secure.plan``).

Functions of what they are given, no state: a checkpoint's step (:func:`step_of`), whether two looks are at one
save (:func:`same`) and whether its files are still as saved (:func:`unchanged_on_disk`), whether a save is newer
than the secured one (:func:`unsecured`), the newest good push before a step (:func:`good_secured`), the one
supersede rule (:func:`supersede`), whether a push fits its window (:func:`fits`) and a checkpoint push's arguments
for the worker (:func:`checkpoint_args`). The plan holds the state they are asked about.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from guard.core.durations import step_text
from guard.secure.checkpoints import CheckpointInfo, rewritten_after
from guard.secure.report import PushRecord

__all__ = ["checkpoint_args", "fits", "good_secured", "same", "step_of", "supersede", "unchanged_on_disk",
           "unsecured"]

log = logging.getLogger("guard.secure")


def unchanged_on_disk(info: CheckpointInfo) -> bool:
    """Every file of ``info`` is still there, none modified after the checkpoint was seen complete."""
    return rewritten_after(info.folder, info.files, info.newest_mtime_s) is None


def step_of(info: CheckpointInfo | None) -> int:
    """``info``'s step, -1 for none (or no checkpoint)."""
    return -1 if info is None or info.step is None else info.step


def same(a: CheckpointInfo, b: CheckpointInfo) -> bool:
    """``a`` is ``b`` or an older look at it (same path and step, not rewritten since)."""
    return a.path == b.path and step_of(a) == step_of(b) and a.newest_mtime_s <= b.newest_mtime_s


def unsecured(info: CheckpointInfo | None, done: CheckpointInfo | None) -> bool:
    """``info`` is newer than ``done``, the secured checkpoint (a later step, or the same step saved again)."""
    if info is None:
        return False
    return done is None or step_of(info) > step_of(done) or (
        step_of(info) == step_of(done) and (info.path != done.path or info.newest_mtime_s > done.newest_mtime_s))


def good_secured(history: Sequence[PushRecord], resumed: PushRecord | None, step: int) -> PushRecord | None:
    """The newest verified push of a checkpoint saved before ``step`` in ``history`` (or ``resumed``, the record
    a resumed run was fetched from), or None."""
    candidates = [p for p in history if p.info is not None and p.kind != "final" and p.result is not None
                  and (p.result.ok or getattr(p.result, "recorded_step", None) is not None)
                  and step_of(p.info) < step]
    if resumed is not None and step_of(resumed.info) < step:
        candidates.append(resumed)
    return max(candidates, key=lambda p: step_of(p.info), default=None)


def supersede(running: PushRecord, newer: CheckpointInfo | None, *, left_s: float, need_s: float,
              running_left_s: float) -> str:
    """The one supersede rule, for a newer checkpoint (or the final model, ``newer`` None) while ``running`` is
    pushed, ``left_s`` before ``secure_by``: ``follow`` (both fit one after the other: the running push finishes,
    then the newer one), ``replace`` (only the newer one, ``need_s``, is estimated to finish in time: kill the
    running push, ``running_left_s`` from its end), ``keep`` (the newer one does not fit: the running push goes on).
    A running push of a node's part (many nodes: ``CheckpointInfo.part``) is never replaced: the other nodes put
    their parts of its step (``guard.secure.follow``), so killed, it leaves a step they may still make whole without
    this node knowing, while the newer one needs them all again."""
    assert running.info is not None
    if running_left_s + need_s <= left_s:
        decision = "follow"
    elif need_s <= left_s and not running.info.part:
        decision = "replace"
    else:
        decision = "keep"
    log.info("%s while %s is pushed: %s (about %.0fs + %.0fs of %.0fs left)",
             f"checkpoint {newer.path} ({step_text(newer.step)})" if newer is not None else "the final model",
             running.info.path, {"follow": "it follows", "replace": "pushing it instead",
                                 "keep": "too late for it, the running push goes on"}[decision],
             running_left_s, need_s, left_s)
    return decision


def fits(info: CheckpointInfo, *, need_s: float, left_s: float, measured: bool) -> bool:
    """A push of ``info`` may start: no push was ``measured`` yet (the estimate ``need_s`` is a guess), or it fits
    in the ``left_s`` before its deadline. Logged when not."""
    if not measured or need_s <= left_s:
        return True
    log.warning("not pushing %s (%s): about %.1fs needed (measured pushes), %.1fs left; a push killed at "
                "the end of its window would leave the destination in doubt", info.path, step_text(info.step),
                need_s, max(0.0, left_s))
    return False


def checkpoint_args(info: CheckpointInfo) -> dict[str, Any]:
    """The worker's ``push_checkpoint`` arguments for ``info``."""
    return {
        "local_dir": str(info.folder), "step": info.step or 0, "files": list(info.files),
        # a file written again since this save (a loop that saves ckpt.pt in place) no longer holds its step:
        # the push refuses it (Securer.push_checkpoint), and the newer save, reported on its own, is secured
        # under its own step. Secured under this one it named a step its content was not (the next run's
        # lower-step saves then replaced it as "newer"); after a NaN the rewrite holds the bad weights.
        "saved_by_s": info.newest_mtime_s,
        # a snapshot's record names the folder the job saved in (guard.secure.snapshots)
        **({"source": str(info.source)} if info.source is not None else {}),
        # this node's part of a many-node checkpoint (its format names files on other nodes' disks)
        **({"part": True} if info.part else {})}
