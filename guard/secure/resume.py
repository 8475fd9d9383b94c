"""Choosing the checkpoint a run resumes from: the newest complete one, secured or local, never a partial folder.

- The secured one is what the guard recorded (``securer.Securer.peek_last_checkpoint``: the newest commit titled
  ``guard: checkpoint step N``, or a folder destination's manifest), fetched at that revision, never a later HEAD.
- The output folder's own newest complete checkpoint (``checkpoints.newest_complete``; no mtime rule: no job is
  writing now) wins when its step is at least the secured one's: nothing is downloaded then. A checkpoint of a run
  whose taint is recorded beside the folder (``guard.secure.suspects``), at or after that run's first non-finite
  step, never counts, marker or not (``checkpoint-108`` saved one step after the NaN of step 107 while still
  "being written" had none); nor does a save a marker still names.
- Saved weights are read (``guard.secure.weights``: safetensors files and ``torch.save`` zips, for a NaN or an
  infinity) before a checkpoint is resumed from: a local one that holds one is skipped for the next newest (logged
  with its file and tensor), and a fetched one is refused before it is placed (``WeightsNotFiniteError``), the
  output folder's own older checkpoint (or a fresh start) taken instead; a checkpoint secured before the guard read
  weights, or by an older run, is never resumed so.
- A partial ``checkpoint-N`` folder newer than the chosen one, which a Trainer would pick up itself
  (``get_last_checkpoint`` takes the highest N), is moved aside as ``checkpoint-N.partial-guard`` and named in the
  log; so is a partial accelerate ``checkpoint_N``/``step_N`` folder (``load_state()`` with automatic naming takes
  the newest); only folders the Trainer or accelerate wrote are moved, never a plain loop's own folders.
- The fetched checkpoint goes back where it came from (its record's ``output_dir`` and ``place``: ``out/ckpt.pt``
  for a loop that reloads its own file, ``out/checkpoint-N`` for a folder), so a loop that resumes the usual way
  (``if os.path.exists("out/ckpt.pt")``) does resume; the record's output folder is used when the caller knows
  none (``FALLBACK_FOLDER``).
- The peek and the fetch run in a worker process (``guard.secure.worker.run_bounded``), killed at the deadline or
  at once on a signal (``abort``). The look at the output folder (its listing, the completeness checks, moving
  partial folders aside, describing the chosen checkpoint) runs on a thread of its own under the same deadline and
  ``abort`` (``guard.core.helpers.call_until``): on a hung NFS or Lustre mount it is given up, never waited on.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from guard.core.helpers import call_until
from guard.errors import HubError
from guard.secure import checkpoints, suspects, weights
from guard.secure.dest.base import pushed_text
from guard.secure.report import NOT_FINITE

__all__ = ["FALLBACK_FOLDER", "PARTIAL_SUFFIX", "FetchTimedOut", "Interrupted", "ResumeFrom", "choose",
           "move_aside_partials"]

log = logging.getLogger("guard.resume")

PARTIAL_SUFFIX = ".partial-guard"
#: The folder the caller names when the job's output folder is not known before it starts (``guard.run.stages``):
#: the secured record's own output folder is used instead when it has one.
FALLBACK_FOLDER = "guard-resume"
#: Folders a job would pick up itself: the Trainer's ``checkpoint-N`` (``get_last_checkpoint``), accelerate's
#: ``checkpoint_N`` (``load_state()`` with automatic naming takes the newest) and ``step_N``.
_TRAINER_CHECKPOINT_RE = re.compile(r"(?:checkpoint-|checkpoint_|step_)([0-9]+)")
#: Files ``Accelerator.save_state`` writes before ``random_states_N.pkl`` (accelerate ``checkpointing.py``).
_ACCELERATE_FILES = ("optimizer.bin", "scheduler.bin", "pytorch_model.bin", "model.safetensors", "sampler.bin")
#: Files ``Trainer._save_checkpoint`` writes before ``trainer_state.json`` (transformers 5.24 ``trainer.py``).
_TRAINER_FILES = ("training_args.bin", "optimizer.pt", "scheduler.pt", "rng_state.pth", "scaler.pt")
_RANDOM_STATES_RE = re.compile(r"random_states_[0-9]+\.pkl")
#: accelerate's ``ProjectConfiguration(automatic_checkpoint_naming=True)`` folder: N counts the saves
_SAVE_COUNT_RE = re.compile(r"checkpoint_([0-9]+)")


class Interrupted(Exception):
    """A signal ended the peek or the fetch (the worker was killed)."""


@dataclasses.dataclass(frozen=True)
class ResumeFrom:
    """The checkpoint a run resumes from.

    Attributes:
        path: the folder (or single file) in the output folder.
        step: its step, or None when unknown (a loose file without a step in its name).
        revision: the Hub commit id or the destination folder it was fetched from, or ``"local"``.
        size_bytes: its size.
        source: ``"destination"`` (fetched) or ``"output folder"`` (already there).
        info: its files and step as securing records a checkpoint (``checkpoints.describe``), read with the rest of
            the output folder before the job starts; None when built without it (tests).
    """

    path: Path
    step: int | None
    revision: str
    size_bytes: int
    source: str
    info: checkpoints.CheckpointInfo | None = None

    @classmethod
    def local(cls, info: checkpoints.CheckpointInfo, step: int | None) -> ResumeFrom:
        """The output folder's own checkpoint ``info``, at ``step`` (None: not known)."""
        return cls(info.path, step, "local", info.size_bytes, "output folder")


def _trainer_written(folder: Path) -> bool:
    try:
        names = set(os.listdir(folder))
    except OSError:
        return False
    if folder.name.startswith("checkpoint-"):
        return (checkpoints.INCOMPLETE_SENTINEL_NAME in names or any(n in names for n in _TRAINER_FILES)
                or any(n.startswith("rng_state") for n in names))
    return any(n in names for n in _ACCELERATE_FILES) or any(n.startswith(("optimizer_", "sampler_")) for n in names)


def _accelerate_saved(folder: Path | None) -> bool:
    """``folder`` is a whole ``Accelerator.save_state`` folder: it holds the ``random_states_N.pkl`` written last."""
    try:
        return folder is not None and any(_RANDOM_STATES_RE.fullmatch(n) for n in os.listdir(folder))
    except OSError:
        return False


def move_aside_partials(folder: str | os.PathLike[str], *, newer_than: int | None,
                        chosen: str | os.PathLike[str] | None = None, accelerate: bool = False) -> list[Path]:
    """Move every partial ``checkpoint-N`` folder the Trainer wrote, and every partial ``checkpoint_N``/``step_N``
    folder accelerate's ``save_state`` wrote (its files without the ``random_states_N.pkl`` it writes last), with N
    above ``newer_than`` (all when None), aside as ``NAME.partial-guard`` (a number is added when that exists);
    returns the new paths. A plain loop's own folders are never moved.

    ``chosen``: the checkpoint the run resumes from. When it is such a folder, N is compared with its N, not with
    its step (accelerate's automatic ``checkpoint_N`` counts saves: step 300 is ``checkpoint_2``); when it is a
    whole accelerate folder, a sibling ``checkpoint_N``/``step_N`` without ``random_states_N.pkl`` is partial even
    when it holds the model alone (``save_state`` writes ``model.safetensors`` first). Accelerate's own
    ``checkpoints/`` folder (``ProjectConfiguration(automatic_checkpoint_naming=True)``): the partial folder goes to
    the project folder above it, since ``load_state()`` takes the highest number of any name in ``checkpoints/``."""
    base = Path(folder)
    moved: list[Path] = []
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return moved
    picked = Path(chosen) if chosen is not None else None
    if picked is not None and picked.parent.resolve() == base.resolve() and (
            numbered := _TRAINER_CHECKPOINT_RE.fullmatch(picked.name)) is not None:
        newer_than = int(numbered[1])
    accelerate = accelerate or (_accelerate_saved(picked) if picked is not None and picked.is_dir() else False)
    aside = base.parent if base.name == "checkpoints" else base
    for name in names:
        match = _TRAINER_CHECKPOINT_RE.fullmatch(name)
        path = base / name
        if match is None or not path.is_dir() or (newer_than is not None and int(match[1]) <= newer_than):
            continue
        reason = checkpoints.why_incomplete(path, now_s=time.time(), stable_for_s=0.0)
        if accelerate and not name.startswith("checkpoint-") and not _accelerate_saved(path):
            reason = reason or "no random_states_N.pkl (accelerate's save_state writes it last)"
        elif reason is None or not _trainer_written(path):
            continue
        target, n = aside / f"{name}{PARTIAL_SUFFIX}", 1
        while target.exists():
            n += 1
            target = aside / f"{name}{PARTIAL_SUFFIX}{n}"
        os.rename(path, target)
        log.warning("moved the partial checkpoint %s aside to %s (%s): the job would resume from it otherwise",
                    path, target.name, reason)
        moved.append(target)
    return moved


def _save_counts(local: checkpoints.CheckpointInfo | None, record: dict[str, Any] | None,
                 base: Path) -> tuple[int, int] | None:
    """(local N, secured N) when both are accelerate's automatic ``checkpoint_N`` folders of ``base``: N counts the
    saves, so only the numbers compare (the secured step is the agent's, the local one is the name's N)."""
    if local is None or record is None or local.path.parent.resolve() != base.resolve():
        return None
    place = record.get("place")
    mine = _SAVE_COUNT_RE.fullmatch(local.path.name)
    theirs = _SAVE_COUNT_RE.fullmatch(place) if isinstance(place, str) else None
    return (int(mine[1]), int(theirs[1])) if mine is not None and theirs is not None else None


class _NotFinite(HubError):
    """The fetched checkpoint's weights are not finite (the worker's ``WeightsNotFiniteError``): nothing placed."""


class FetchTimedOut(HubError):
    """The peek or the fetch did not finish by its deadline (the worker was killed), or the output folder did not
    answer by then: nothing was damaged."""


def _on_disk(work: Callable[[], Any], what: str, folder: Path, deadline: float, abort: Callable[[], bool],
             securer: Any) -> Any:
    """``work()`` (file system calls on the output folder) on its own thread, given up at ``deadline`` or on
    ``abort``; its exception is raised here."""
    started = time.monotonic()
    pending = call_until(work, deadline_s=deadline, abort=abort)
    if not pending.done():
        if abort():
            raise Interrupted(what)
        raise FetchTimedOut(f"{what} in the output folder {folder} did not answer within "
                            f"{deadline - started:.0f}s (a hung file system?): stopped",
                            destination=str(securer.destination),
                            hint=f"check the mount of {folder} (a job would hang on it too); --resume if-valid "
                                 "starts fresh when the checkpoint cannot be read")
    if isinstance(pending.error, weights.CheckTimedOut):
        raise FetchTimedOut(f"reading the saved weights of {pending.error.path} did not end within "
                            f"{deadline - started:.0f}s: stopped", destination=str(securer.destination),
                            hint="--resume if-valid starts fresh when the checkpoint cannot be read in time")
    if pending.error is not None:
        raise pending.error
    return pending.result()


def _bounded(run: Callable[..., Any], op: str, args: dict[str, Any], deadline: float, abort: Callable[[], bool],
             securer: Any) -> dict[str, Any] | None:
    started = time.monotonic()
    result = run(op, args, deadline, abort, destination=str(securer.destination),
                 token=getattr(securer, "token", None))
    if result.error_type == "killed":
        raise Interrupted(op)
    if result.error_type == "deadline":
        what = "reading what is secured at" if op == "peek_last_checkpoint" else "downloading the checkpoint from"
        raise FetchTimedOut(f"{what} {securer.destination} did not finish within {deadline - started:.0f}s "
                            "(its bound: half of the time left): stopped", destination=str(securer.destination),
                            hint="check the destination's download speed (a hung transfer, Xet included, is "
                                 "stopped at this bound); --resume if-valid starts fresh when it cannot be fetched")
    if not result.ok and result.error_type == NOT_FINITE:
        raise _NotFinite(result.error or "the secured checkpoint's weights are not finite",
                         destination=str(securer.destination), hint=result.hint)
    if not result.ok:
        raise HubError(result.error or f"{op} failed", destination=str(securer.destination),
                       hint=result.hint or "check the destination; --resume if-valid starts fresh instead")
    data: dict[str, Any] | None = result.data
    return data


def choose(folder: str | os.PathLike[str], securer: Any, *, deadline: float, abort: Callable[[], bool],
           run: Callable[..., Any] | None = None) -> ResumeFrom | None:
    """The newest complete checkpoint among the secured one and ``folder``'s own; fetches the secured one into
    ``folder`` (as ``checkpoint-<step>``) only when it is newer. None when there is none (starting fresh).

    Args:
        folder: the job's output folder (created when missing).
        securer: the ``securer.Securer`` of ``--push-to``.
        deadline: monotonic seconds by which the peek, the fetch and the look at the output folder must be over
            (the worker is killed then; a file system call that has not returned is given up, left on its thread).
        abort: returns True once a signal arrived: the work is killed (or given up) at once.
        run: ``worker.run_bounded`` (tests inject one).

    Raises:
        Interrupted: ``abort`` became true.
        FetchTimedOut: the peek or the fetch was still running at ``deadline`` (killed then), or the output folder
            had not answered by then.
        HubError: the destination could not be read, or the download is corrupt or partial.
    """
    if run is None:
        from guard.secure.worker import run_bounded

        run = run_bounded
    base = Path(folder)
    record = _bounded(run, "peek_last_checkpoint", {}, deadline, abort, securer)
    if os.fspath(folder) == FALLBACK_FOLDER and record is not None and record.get("output_dir"):
        base = Path(str(record["output_dir"]))
        log.info("output folder: %s (where the secured checkpoint came from, as its record says)", base)
    local = _on_disk(lambda: _local_candidate(base, record, deadline), "looking for a complete checkpoint", base,
                     deadline, abort, securer)
    chosen: ResumeFrom | None = None
    counted = local.save_counts if local is not None else None
    if counted is not None and counted[0] > counted[1] and local is not None and local.accelerate_saved:
        # a whole save (its random_states_N.pkl, written last, is there) the guard had not secured yet
        log.info("resuming from the output folder's own %s: a later save than the secured checkpoint_%d (step %s; "
                 "its own step is not known: accelerate's checkpoint_N counts saves)", local.info.path, counted[1],
                 record.get("step") if record else None)
        chosen = ResumeFrom.local(local.info, None)
    elif counted is None and local is not None and (
            record is None or (local.info.step is not None and record.get("step") is not None
                               and local.info.step >= record["step"])):
        why = "nothing is secured at the destination" if record is None else (
            f"as new as or newer than the secured step {record['step']}")
        log.info("resuming from the output folder's own %s (step %s): %s", local.info.path, local.info.step, why)
        chosen = ResumeFrom.local(local.info, local.info.step)
    elif record is not None:
        if local is not None:
            log.info("the output folder's %s (%s) is older than the secured step %s (or not comparable): "
                     "fetching the secured one", local.info.path,
                     "step not known" if local.info.step is None else f"step {local.info.step}", record.get("step"))
        try:
            data = _bounded(run, "fetch_last_checkpoint", {"into_dir": str(base), "revision": record["revision"]},
                            deadline, abort, securer)
        except _NotFinite as exc:
            data = None
            log.error("%s", exc.message)
            older = local.info if local is not None else None
            if older is not None:
                log.warning("resuming from the output folder's own %s (step %s) instead", older.path, older.step)
                chosen = ResumeFrom.local(older, older.step)
        if data is not None:
            chosen = ResumeFrom(Path(data["path"]), data["step"], data["revision"], int(data["size_bytes"]),
                                "destination")
            log.info("resuming from %s (step %s, secured at %s)", chosen.path, chosen.step,
                     pushed_text(str(securer.destination), str(chosen.revision)))
        elif chosen is None and local is not None:
            # nothing at the record's revision (a Hub repo's HEAD without last-checkpoint/: a README only): the
            # output folder's own complete checkpoint is the newest there is
            log.info("nothing to fetch at %s: resuming from the output folder's own %s (step %s)",
                     securer.destination, local.info.path, local.info.step)
            chosen = ResumeFrom.local(local.info, local.info.step)
    chosen = _on_disk(lambda: _settle(base, chosen), "moving partial checkpoints aside", base, deadline, abort,
                      securer)
    if chosen is None:
        log.info("nothing secured at %s and no complete checkpoint in %s: starting fresh", securer.destination, base)
    return chosen


@dataclasses.dataclass(frozen=True)
class _Local:
    """The output folder's newest complete checkpoint, whether it is a whole ``Accelerator.save_state``, and
    ``_save_counts`` against the secured record."""

    info: checkpoints.CheckpointInfo
    accelerate_saved: bool
    save_counts: tuple[int, int] | None


def _weights_refused(info: checkpoints.CheckpointInfo, deadline: float) -> str | None:
    """Why ``info`` is not resumed from by its saved weights (a NaN or an infinity, named), or None. Raises
    ``weights.CheckTimedOut`` past ``deadline``."""
    try:
        bad = weights.check_files(info.folder, info.files, deadline=deadline).bad
    except OSError as exc:
        return f"its weights cannot be read ({exc})"
    if bad is None:
        return None
    log.error("the output folder's %s holds weights that are not finite (%s has a NaN or an infinity): not resumed "
              "from", info.path, bad.describe())
    return f"its weights are not finite ({bad.describe()})"


def _local_candidate(base: Path, record: dict[str, Any] | None, deadline: float) -> _Local | None:
    """The output folder's newest complete checkpoint whose saved weights are finite (the folder is created when
    missing). File system calls: run through ``_on_disk``."""
    base.mkdir(parents=True, exist_ok=True)
    place = record.get("place") if record is not None else None
    if isinstance(place, str) and (secured_n := _SAVE_COUNT_RE.fullmatch(place)) is not None:
        # accelerate's automatic naming: a later checkpoint_N without its random_states_N.pkl is half-written; out
        # of the way first, so that the newest whole one (which load_state() will take) is the local candidate
        move_aside_partials(base, newer_than=int(secured_n[1]), accelerate=True)
    # no run writes here now: other runs' open taints end now, and every tainted run's checkpoints at or after its
    # first non-finite step are refused, wherever they lie and whether or not their marker was written
    taints = suspects.close_taints(base, run_id=None, at_s=time.time())
    refuse = suspects.tainted_by(taints) if taints else None
    local = checkpoints.newest_complete(base, now_s=time.time(), stable_for_s=0.0, refuse=refuse,
                                        vet=lambda info: _weights_refused(info, deadline))
    if local is None:
        return None
    return _Local(local, _accelerate_saved(local.path), _save_counts(local, record, base))


def _settle(base: Path, chosen: ResumeFrom | None) -> ResumeFrom | None:
    """Partial folders newer than ``chosen`` moved aside, and ``chosen`` described for securing. File system calls:
    run through ``_on_disk``."""
    move_aside_partials(base, newer_than=chosen.step if chosen is not None else None,
                        chosen=chosen.path if chosen is not None else None)
    if chosen is None:
        return None
    return dataclasses.replace(chosen, info=checkpoints.describe(chosen.path, step=chosen.step))
