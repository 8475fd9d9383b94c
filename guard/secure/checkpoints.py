"""Finding complete checkpoints on disk: never one still being written.

What counts as a checkpoint, in this order of preference:

1. a folder the job said it finished: the Trainer's save event (``on_save``) or ``guard.checkpoint_saved(path)``;
   what the job said wins over every rule below (no mtime rule applies to it);
2. a ``checkpoint-N`` folder (the Trainer's), a ``checkpoint_N`` folder (accelerate's automatic naming,
   ``ProjectConfiguration(automatic_checkpoint_naming=True)``) or a ``step_N`` folder (accelerate's
   ``save_state(f"step_{N}")`` in its examples), complete by the rules below; the highest N wins;
3. when no such folder is complete: a stable set of model/optimizer files (``*.pt``, ``*.pth``, ``*.safetensors``,
   ``*.bin``) at the top of the output folder (nanoGPT's ``ckpt.pt``, a loop's ``last.pt``), secured as one folder.
   Files whose names carry a step (``model_step_200.pt``, ``iter-300.pt``) are grouped by it and the highest step
   wins; otherwise the step is unknown here (the agent reports the step of every ``torch.save`` it sees, which
   the supervisor prefers: see ``SavedFiles``).

A checkpoint folder counts as complete when:

- it holds the Trainer's state file ``trainer_state.json`` or the guard's marker ``guard_checkpoint.json``, or (an
  accelerate folder) an RNG state file ``random_states_<process>.pkl``, which accelerate's ``save_state`` writes
  after the model, optimizer, scheduler and sampler states (``accelerate/checkpointing.py``);
  ``Trainer._save_checkpoint`` (transformers 5.24.0, ``trainer.py``) writes the model, then optimizer, scheduler,
  scaler and RNG states, and ``trainer_state.json`` *last*; ``guard.checkpoint_saved(path)`` writes the marker after
  the script's own save;
- of a job of several ranks, it holds every rank's own file when its layout has one per rank (the Trainer's
  ``rng_state_R.pth``, accelerate's ``random_states_R.pkl``, for R in ``range(world_size)``): each rank writes its
  own, and the Trainer's ``trainer_state.json`` is rank 0's alone (no barrier after the other ranks' parts);
- it holds no ``checkpoint-is-incomplete.txt``: transformers' JIT checkpointing (``trainer_jit_checkpoint.py``,
  ``enable_jit_checkpoint=True``) creates that sentinel before saving and removes it on success (anchors.md 6a);
- its files have stopped changing: no file's mtime within ``stable_for_s`` of now, and two stat passes over the
  folder agree on every size and mtime;
- every file is whole by its format (``guard.secure.formats.check_files``: a torch zip with its central directory,
  a pickle stream that ends, a safetensors header that matches the size, a ``.distcp`` set its ``.metadata``
  names);
- it carries no suspect marker that names it (``guard.secure.suspects``: saved after the first non-finite loss;
  a marker is void once its path is written again, and during a run another run's marker is void): such a
  checkpoint is skipped, and named in the log, by the scan, resume and every later push; resume also refuses
  every checkpoint of a tainted run at or after its first non-finite step (``refuse``).

A folder the job said it finished skips the mtime and completion-file rules (not the suspect marker); the push
checks its files by format all the same. The log says which rule admitted each checkpoint (``admitted_by``).

The Trainer rotates old checkpoints (``rotate_checkpoints``) while we may be scanning: a folder or file that vanishes
mid-scan is skipped, never an error.

Symbolic links are never followed out of a checkpoint: a link to a file inside the checkpoint counts as that
file's content; a link that points outside it (or to a folder, or nowhere) is left out and named in the log.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import stat as _stat
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from guard.errors import SupervisorError
from guard.secure.formats import DISTCP_METADATA, check_files, kind_of, missing_required, recorded_step, requires
from guard.secure.layout import CHECKPOINT_FOLDER_RE as _CHECKPOINT_LIKE_RE  # every known layout, tmp- names too
from guard.secure.suspects import SUSPECT_MARKER_NAME, is_marked_suspect, mark_suspect

__all__ = [
    "GUARD_MARKER_NAME",
    "INCOMPLETE_SENTINEL_NAME",
    "MODEL_FILE_SUFFIXES",
    "SUSPECT_MARKER_NAME",
    "TRAINER_STATE_NAME",
    "CheckpointInfo",
    "SavedFiles",
    "describe",
    "every_rank_marked",
    "is_marked_suspect",
    "is_scratch_name",
    "list_files",
    "loose_files",
    "mark_suspect",
    "newest_complete",
    "saved_folder",
    "why_incomplete",
]

log = logging.getLogger("guard.checkpoints")

#: Written last by ``Trainer._save_checkpoint`` (transformers ``TRAINER_STATE_NAME``).
TRAINER_STATE_NAME = "trainer_state.json"
#: Written by ``guard.checkpoint_saved(path)`` into a custom loop's checkpoint folder.
GUARD_MARKER_NAME = "guard_checkpoint.json"
#: Present while transformers' JIT checkpointing is saving (``trainer_jit_checkpoint.py``).
INCOMPLETE_SENTINEL_NAME = "checkpoint-is-incomplete.txt"

#: Checkpoint folder names with an N: a step in the Trainer's ``checkpoint-N`` and accelerate's ``step_N``; a count
#: of saves in accelerate's automatic ``checkpoint_N`` and of epochs in its examples' ``epoch_N``, whose step is the
#: agent's when the guard saw the save (``steps``), the N only ordering them otherwise.
_FOLDER_RE = re.compile(r"(?:checkpoint-|checkpoint_|step_|epoch_|global_step)([0-9]+)")
#: Other folder names whose N is a step, counted only when the folder holds a sharded format (DCP ``.metadata`` or
#: ``*.distcp``, Megatron's ``metadata.json``, DeepSpeed's per-rank files): torchtitan's ``step-N``, Megatron's
#: ``iter_NNNNNNN``, ``ckpt-N``/``ckpt_N``.
_SHARDED_FOLDER_RE = re.compile(r"(?:step-|iter_|iter-|ckpt-|ckpt_)([0-9]+)")
_SHARDED_FILE_RE = re.compile(r".*\.distcp|\.metadata|metadata\.json|.*_model_states\.pt|.*_optim_states\.pt")
#: DeepSpeed's ``save_checkpoint`` writes ``OUT/global_stepN/`` and then ``OUT/latest`` naming it.
DEEPSPEED_LATEST_NAME = "latest"
_ACCELERATE_RNG_RE = re.compile(r"random_states_[0-9]+\.pkl")
#: One file per rank, each written by its own rank: the Trainer's ``rng_state_<process_index>.pth`` (transformers
#: 5.24.0 ``Trainer._save_rng_state``, when ``world_size > 1``; ``trainer_state.json`` is rank 0's alone, written
#: after rank 0's own part with no barrier after the other ranks'), accelerate's ``random_states_<process>.pkl``
#: (``accelerate/checkpointing.py`` ``save_accelerator_state``).
_PER_RANK_RE = re.compile(r"(rng_state_|random_states_)([0-9]+)\.(pth|pkl)")
#: Files the Trainer writes before ``trainer_state.json`` and accelerate before ``random_states_N.pkl``: a folder
#: holding one of them is complete only with that last file.
_TRAINER_OR_ACCELERATE = re.compile(r"training_args\.bin|optimizer\.(?:pt|bin)|scheduler\.(?:pt|bin)|"
                                    r"rng_state(?:_[0-9]+)?\.pth|scaler\.pt|sampler(?:_[0-9]+)?\.bin")
#: Suffixes of model and optimizer files written by ``torch.save``, safetensors and the Trainer (and timm's
#: ``CheckpointSaver``: ``last.pth.tar``, ``checkpoint-N.pth.tar``).
MODEL_FILE_SUFFIXES = (".pt", ".pth", ".safetensors", ".bin", ".pth.tar")
#: Files with a model suffix that are not model state (the Trainer's pickled ``TrainingArguments``).
_NOT_MODEL_FILES = frozenset({"training_args.bin"})
_STEP_IN_NAME_RE = re.compile(r"(?:^|[^a-z])(?:global_step|step|iter|iteration|it)[-_]?([0-9]+)(?![0-9])",
                              re.IGNORECASE)
StatFn = Callable[[str], os.stat_result]
#: ``(step or None, newest mtime in epoch seconds) -> why the checkpoint is refused, or None``.
Refusal = Callable[[int | None, float], str | None]
#: The settle rule: a file written by other means counts once every file of its checkpoint is unchanged this long
#: (seconds).
STABLE_FOR_S = 2.0


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint on disk.

    Attributes:
        path: the folder (or, for a custom loop, the single file).
        step: the training step it was saved at, or None when unknown.
        size_bytes: the sum of its files' sizes.
        files: its files as sorted relative POSIX paths under ``folder`` (``(name,)`` for a single file).
        newest_mtime_s: the newest file mtime, epoch seconds.
        root: the folder ``files`` are relative to when it is not ``path`` (a set of loose files: the output
            folder), else None. Push ``folder`` with exactly ``files``.
        admitted_by: the rule that made it count (logged): ``"reported"`` (the job said the save is done: the
            Trainer's save event, ``checkpoint_saved``), ``"saved"`` (the agent saw ``torch.save`` return), or
            ``"settled"`` (written by other means: unchanged for the settle time, its completion file present and
            every file whole by format, ``guard.secure.formats``); None when not told.
        step_source: where ``step`` comes from: ``"trainer_state"`` (``global_step``), ``"reported"`` (the job's
            ``checkpoint_saved`` or the agent's step count at the save: the guard's own step unit, comparable with
            the VERDICT's ``step``), ``"marker"``, ``"name"`` (N of the folder or file name: the job's unit, which
            may differ, e.g. with gradient accumulation), ``"recorded"`` (a file whose step was otherwise unknown:
            the one it records itself, ``recorded``), or None (unknown).
        recorded: the step the checkpoint records itself when ``step`` is the guard's count or unknown: ``(key,
            value)`` from a ``torch.save``d dict's top level (``formats.recorded_step``: nanoGPT's 0-based
            ``iter_num``...), for the hints, which speak of the step the job resumes from; else None.
        source: the folder the job saved the files in when ``root`` is a copy of them (``guard.secure.snapshots``:
            a file saved in place faster than a push starts), for the record's placement; else None.
        requires: what the checkpoint's own format says it must hold, ``((rel, least size in bytes), ...)``
            (``formats.requires``: a DCP ``.metadata``'s shards, DeepSpeed's per-rank files, per-rank RNG files);
            empty when its format names nothing.
        part: the files here do not satisfy ``requires`` by themselves: this node's part of a checkpoint whose
            other parts lie on other nodes' disks (only found when the scan is told the job has several nodes).
    """

    path: Path
    step: int | None
    size_bytes: int
    files: tuple[str, ...]
    newest_mtime_s: float
    root: Path | None = None
    step_source: str | None = None
    admitted_by: str | None = None
    recorded: tuple[str, int] | None = None
    source: Path | None = None
    requires: tuple[tuple[str, int], ...] = ()
    part: bool = False

    @property
    def folder(self) -> Path:
        """The folder to push: ``root`` when set, else ``path`` (a folder), else the single file's folder."""
        if self.root is not None:
            return self.root
        return self.path.parent if self.files == (self.path.name,) and not self.path.is_dir() else self.path


_links_logged: set[str] = set()


def _link_inside(link: str, top: Path) -> bool:
    """True when the symlink ``link`` resolves to a regular file inside ``top`` (never followed out of it)."""
    try:
        target = Path(os.path.realpath(link))
        return target.is_file() and target.is_relative_to(Path(os.path.realpath(top)))
    except OSError:
        return False


def _refuse_link(link: str) -> None:
    if link not in _links_logged:
        _links_logged.add(link)
        try:
            target = os.readlink(link)
        except OSError:
            target = "?"
        log.warning("left out %s -> %s: a symbolic link that points outside the checkpoint (or to a folder, or "
                    "nowhere); the guard never follows links out of a checkpoint: save real files", link, target)


def _walk(path: Path, stat: StatFn) -> dict[str, tuple[int, float]]:
    """``{relative posix path: (size, mtime)}`` for every regular file under ``path``; a symlink counts only when
    it points to a file inside ``path`` (see the module docstring). Raises FileNotFoundError when ``path`` itself
    is gone."""
    top = stat(str(path))
    if not _stat.S_ISDIR(top.st_mode):
        return {path.name: (top.st_size, top.st_mtime)}
    found: dict[str, tuple[int, float]] = {}
    for root, dirs, names in os.walk(path, onerror=None, followlinks=False):
        dirs.sort()
        for name in [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            dirs.remove(name)
            _refuse_link(os.path.join(root, name))
        for name in sorted(names):
            full = os.path.join(root, name)
            if os.path.islink(full) and not _link_inside(full, path):
                _refuse_link(full)
                continue
            try:
                st = stat(full)
            except (FileNotFoundError, NotADirectoryError):
                continue  # removed while we looked (a rotation, a temp file renamed)
            if _stat.S_ISREG(st.st_mode):
                found[Path(os.path.relpath(full, path)).as_posix()] = (st.st_size, st.st_mtime)
    if not found and not path.exists():
        raise FileNotFoundError(str(path))
    return found


def list_files(folder: str | os.PathLike[str]) -> list[str]:
    """The files of a checkpoint folder to push, as sorted POSIX relative paths: regular files, and symlinks to
    files inside ``folder``; links pointing out of it are left out (and logged once). An empty list when
    ``folder`` does not exist."""
    try:
        return sorted(_walk(Path(folder), os.stat))
    except (FileNotFoundError, NotADirectoryError):
        return []


def why_incomplete(path: str | os.PathLike[str], *, now_s: float, stable_for_s: float = STABLE_FOR_S,
                   stat: StatFn = os.stat) -> str | None:
    """Why the checkpoint folder ``path`` is not (yet) complete, or None when it is.

    Args:
        path: a checkpoint folder.
        now_s: now, epoch seconds (compared with file mtimes).
        stable_for_s: how long every file must have been left unchanged (default 2 s).
        stat: ``os.stat``-like callable (tests inject one).
    """
    return _check(Path(path), now_s, stable_for_s, stat)[1]


def _missing_ranks(files: Collection[str], world_size: int) -> str | None:
    """The per-rank files (``_PER_RANK_RE``) missing from a checkpoint of ``world_size`` ranks that holds one of
    them, as the reason it is not complete; None when every rank's is there (or the layout has none)."""
    if world_size <= 1:
        return None
    kinds: dict[tuple[str, str], set[int]] = {}
    for name in files:
        m = _PER_RANK_RE.fullmatch(name.rsplit("/", 1)[-1])
        if m is not None:
            kinds.setdefault((m[1], m[3]), set()).add(int(m[2]))
    for (prefix, suffix), ranks in sorted(kinds.items()):
        missing = sorted(set(range(world_size)) - ranks)
        if missing:
            return (f"no {prefix}<rank>.{suffix} of rank(s) {','.join(map(str, missing))} of {world_size} (every "
                    "rank writes its own part; still being written)")
    return None


def every_rank_marked(files: Collection[str], name: str, world_size: int) -> bool:
    """Whether a checkpoint folder's layout itself says every rank's part is written, whatever the ranks reported:
    a ``torch.distributed.checkpoint`` save's ``.metadata`` (written by the coordinator once every rank's write
    finished, ``torch.distributed.checkpoint.state_dict_saver``; ``_check`` verified it names every shard),
    DeepSpeed's ``global_stepN`` (complete only once ``latest`` names it), or each rank's own RNG file of
    ``world_size`` ranks (the Trainer's, accelerate's). Call it on a folder ``_check`` found complete."""
    if DISTCP_METADATA in files or name.startswith("global_step"):
        return True
    return world_size > 1 and any(_PER_RANK_RE.fullmatch(f.rsplit("/", 1)[-1]) for f in files) \
        and _missing_ranks(files, world_size) is None


def _check(path: Path, now_s: float, stable_for_s: float, stat: StatFn, reported: bool = False, world_size: int = 1,
           parts: bool = False) -> tuple[dict[str, tuple[int, float]], str | None]:
    """``(files, why not complete)`` of a checkpoint folder (see the module docstring); ``parts``: the job has
    several nodes, each with its own disk: what other nodes hold (other ranks' files, shards a ``.metadata`` names)
    may be missing here (the folder is then a part, ``newest_complete``)."""
    try:
        first = _walk(path, stat)
    except FileNotFoundError:
        return {}, "gone (removed while scanning)"
    except NotADirectoryError:
        return {}, "not a folder"
    if not first:
        return first, "empty"
    if INCOMPLETE_SENTINEL_NAME in first:
        return first, f"{INCOMPLETE_SENTINEL_NAME} present (a JIT checkpoint still being saved, or one that failed)"
    if reported:
        return first, None  # the job said the save is done (Trainer on_save, checkpoint_saved): no mtime rule
    accelerate = not path.name.startswith("checkpoint-") and any(_ACCELERATE_RNG_RE.fullmatch(n) for n in first)
    distcp = DISTCP_METADATA in first or any(n.endswith(".distcp") for n in first)
    if distcp and DISTCP_METADATA not in first and not parts:
        return first, f"no {DISTCP_METADATA} (a torch.distributed.checkpoint save writes it last)"
    if path.name.startswith("global_step"):
        why = _deepspeed_unfinished(path, parts)
        if why is not None:
            return first, why
    sharded = any(_SHARDED_FILE_RE.fullmatch(n.rsplit("/", 1)[-1]) for n in first)
    marked = (TRAINER_STATE_NAME in first or GUARD_MARKER_NAME in first or accelerate or distcp or sharded
              or path.name.startswith("global_step"))
    if not marked and any(_TRAINER_OR_ACCELERATE.fullmatch(n.rsplit("/", 1)[-1]) for n in first):
        return first, f"no {TRAINER_STATE_NAME} or {GUARD_MARKER_NAME} (save not finished)"
    if not marked and not any(_is_model_file(n.rsplit("/", 1)[-1]) for n in first):
        return first, "no model file"
    missing = None if parts else _missing_ranks(first, world_size)
    if missing is not None:
        return first, missing
    # a folder of a plain loop (``checkpoint-20/model.pt``): complete once settled and whole by format (below).
    # Without the settle time (the writer is gone, or resume), formats decide; a folder with no completion file
    # holding a model file of a format not checked here still waits for it: nothing else can say it is whole
    unchecked = None if marked or stable_for_s >= STABLE_FOR_S else _unchecked_model_file(path, first)
    settle_s = STABLE_FOR_S if unchecked is not None else stable_for_s
    newest_name, (_, newest_mtime_s) = max(first.items(), key=lambda item: item[1][1])
    if newest_mtime_s > now_s - settle_s:
        why = f"; {unchecked}'s format is not one the guard checks" if unchecked is not None else ""
        return first, (f"still being written ({newest_name} changed {max(0.0, now_s - newest_mtime_s):.1f}s "
                       f"ago{why})")
    try:
        second = _walk(path, stat)
    except FileNotFoundError:
        return {}, "gone (removed while scanning)"
    if second != first:
        changed = sorted(set(first.items()) ^ set(second.items()))
        return second, f"still being written ({changed[0][0]} changed while scanning)"
    problems = check_files(path, sorted(first), parts=parts)
    if problems:
        return first, f"not whole by format ({problems[0]})"
    lacking = missing_required(requires(path, world_size=world_size if world_size > 1 else None),
                               {rel: size for rel, (size, _) in first.items()})
    if lacking and not parts:
        more = f" and {len(lacking) - 1} more" if len(lacking) > 1 else ""
        return first, f"incomplete by its format: {lacking[0]}{more} (a rank's part still being written, or on " \
                      "another node's disk)"
    return first, None


def _unchecked_model_file(path: Path, files: Iterable[str]) -> str | None:
    """The first model file of the folder ``path`` whose format ``formats.kind_of`` does not know (its wholeness
    cannot be checked), or None."""
    for rel in sorted(files):
        if _is_model_file(rel.rsplit("/", 1)[-1]):
            try:
                if kind_of(path / rel) is None:
                    return rel
            except OSError:
                return rel
    return None


def _deepspeed_unfinished(path: Path, parts: bool = False) -> str | None:
    """Why DeepSpeed's ``global_stepN`` folder is not finished: the ``latest`` file beside it (written after every
    rank's part, ``DeepSpeedEngine.save_checkpoint``) does not name it or a later step; None when it does. With
    ``parts`` (many nodes, each with its own disk) no ``latest`` at all is no reason: global rank 0 writes it, on
    node 0's disk, and this folder holds only this node's ranks' ZeRO files (judged by the settle rule instead)."""
    try:
        latest = (path.parent / DEEPSPEED_LATEST_NAME).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        if parts and isinstance(exc, FileNotFoundError):
            return None
        return f"no {DEEPSPEED_LATEST_NAME} file beside it (DeepSpeed writes it once every rank saved)"
    mine, named = _FOLDER_RE.fullmatch(path.name), _FOLDER_RE.fullmatch(latest)
    if mine is None or named is None or int(named[1]) < int(mine[1]):
        return f"{DEEPSPEED_LATEST_NAME} names {latest!r}, not this save or a later one (still being written)"
    return None


def _step_from_json(path: Path, name: str, key: str) -> int | None:
    try:
        data = json.loads((path / name).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    value = data.get(key) if isinstance(data, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _info(path: Path, files: dict[str, tuple[int, float]], step: int | None, *, root: Path | None = None,
          step_source: str | None = None, admitted_by: str | None = None) -> CheckpointInfo:
    source = step_source if step is not None else None
    recorded = None
    if source in (None, "reported"):  # the guard's own count, or none: what does the checkpoint say?
        base = root if root is not None else (path if path.is_dir() else path.parent)
        for rel in sorted(files):
            if rel.endswith((".pt", ".pth", ".ckpt")) and (recorded := recorded_step(base / rel)):
                break
    if step is None and recorded is not None:  # a loose file found by the scan: the step it records itself
        step, source = int(recorded[1]), "recorded"
    return CheckpointInfo(path=path, step=step, size_bytes=sum(size for size, _ in files.values()),
                          files=tuple(sorted(files)), newest_mtime_s=max(m for _, m in files.values()), root=root,
                          step_source=source, admitted_by=admitted_by, recorded=recorded)


_admitted_logged: set[tuple[str, float]] = set()


def _log_admitted(info: CheckpointInfo, stable_for_s: float, *, quiet: bool = False) -> None:
    """Say once per checkpoint (path and newest mtime) which rule admitted it (``quiet``: a folder whose save the
    guard saw and judged at it: not said again)."""
    key = (str(info.path), info.newest_mtime_s)
    if key in _admitted_logged or quiet:
        return
    _admitted_logged.add(key)
    if info.admitted_by == "reported":
        log.info("checkpoint %s counts: the job said its save is done", info.path)
    elif info.admitted_by == "resumed":
        log.info("checkpoint %s counts: the checkpoint this run resumed from (fetched or inspected whole before the "
                 "job started)", info.path)
    else:
        # the scan's own rule, whoever wrote the files (the scan does not know which saves the agent saw return:
        # never "written by other means", which a file the guard saw saved contradicted)
        if stable_for_s > 0:
            log.info("checkpoint %s counts: every file unchanged for %.1fs and whole by format", info.path,
                     stable_for_s)
        else:  # the job's processes are gone (or resume): nothing is being written, the formats decide
            log.info("checkpoint %s counts: whole by format (no process of the job is running to write it)", info.path)


def _folder_step(path: Path, name_step: int) -> tuple[int, str]:
    found = _step_from_json(path, TRAINER_STATE_NAME, "global_step")
    if found is not None:
        return found, "trainer_state"
    found = _step_from_json(path, GUARD_MARKER_NAME, "step")
    if found is not None:
        return found, "marker"
    return name_step, "name"


def _placed_before(path: Path, since_s: float | None, stat: StatFn) -> bool:
    """Every file of the folder ``path`` is older than ``since_s`` (the job's start): placed there before it (the
    resume fetch), not rewritten by the job since. False without ``since_s`` or files."""
    if since_s is None:
        return False
    try:
        files = _walk(path, stat)
    except OSError:
        return False
    return _left_over(path, files, since_s)


def _changed_since(path: Path, since_s: float) -> bool:
    """The file's inode changed at or after ``since_s`` (its ctime: written, renamed or touched, which a job's
    ``os.utime`` cannot move back); True when it cannot be read (not taken for a leftover)."""
    try:
        return os.stat(path, follow_symlinks=False).st_ctime >= since_s
    except OSError:
        return True


def _left_over(folder: Path, files: Iterable[str], since_s: float | None) -> bool:
    """No file of the checkpoint changed since ``since_s`` (the job's start, epoch s): an earlier run's."""
    names = list(files)
    return since_s is not None and bool(names) and not any(_changed_since(folder / n, since_s) for n in names)


def newest_complete(output_dir: str | os.PathLike[str], *, now_s: float, stable_for_s: float = STABLE_FOR_S,
                    stat: StatFn = os.stat, seen: set[tuple[str, str]] | None = None,
                    reported: Collection[str] = (), loose: bool = True, since_s: float | None = None,
                    resumed: Collection[str] = (), world_size: int = 1,
                    waiting: Mapping[str, str] | None = None,
                    steps: Mapping[str, int] | None = None, parts: bool = False, run_id: str | None = None,
                    refuse: Refusal | None = None, only_step: int | None = None,
                    vet: Callable[[CheckpointInfo], str | None] | None = None,
                    quiet: Collection[str] = ()) -> CheckpointInfo | None:
    """The newest complete checkpoint under ``output_dir`` (see the module docstring for what counts).

    Folders newer than the one returned that are skipped are logged with the reason (still being written, no state
    file, the JIT sentinel); a partial folder is never returned.

    Args:
        output_dir: the job's output folder (``TrainingArguments.output_dir``, ``--output-dir``, the job's own
            ``--out_dir``...).
        now_s: now, epoch seconds.
        stable_for_s: how long every file must have been left unchanged (default 2 s); 0 at resume time, when
            no job is writing.
        stat: ``os.stat``-like callable (tests inject one).
        seen: pass the same set on every call to log each (folder, reason) only once; None logs every time.
        reported: paths of folders the job said it finished saving (the Trainer's save event,
            ``checkpoint_saved``): complete without the mtime rule. Compared with the folders found after resolving
            symbolic links on both sides.
        loose: also consider loose model files at the top of ``output_dir`` when no folder is complete (pass
            False for a Trainer, whose root files are its final model).
        since_s: the job's start, epoch seconds: a checkpoint none of whose files changed since (their ctime,
            which ``os.utime`` cannot move back) is an earlier run's and is left alone (logged once with ``seen``),
            unless it is one of ``resumed``. None: no such rule.
        resumed: paths of the checkpoint this run resumed from (fetched, or the output folder's own): they count
            although older than ``since_s``, and, while none of their files changed since ``since_s``, without the
            mtime rule (a fetch wrote them just before the job started, verified against its record: never "still
            being written"; a file the job rewrites since follows the rule again).
        world_size: the job's ranks (default 1): a folder holding per-rank files (the Trainer's
            ``rng_state_R.pth``, accelerate's ``random_states_R.pkl``) counts only with every rank's.
        waiting: ``{folder: reason}`` of folders some ranks reported and others not yet: skipped with the reason,
            unless their layout says every rank's part is written (:func:`every_rank_marked`). Compared resolved.
        steps: folder path -> its step as the guard counts it (the agent's step at the job's ``torch.save`` into
            it), for folders whose N is not that step (accelerate's automatic ``checkpoint_N`` counts saves); they
            are ordered and returned by it (``step_source`` ``"reported"``).
        parts: the job runs on several nodes, each with its own disk: a folder whose format names files it does
            not hold (another node's shards or ranks' files) is returned as this node's part (``part`` True,
            ``requires`` what the format names), checked as a union by the caller; default False (such a folder is
            incomplete). Other folder names (``step-N``, ``iter_N``) count when they hold a sharded format.
        run_id: this run's id: another run's suspect marker does not count (``suspects.is_marked_suspect``);
            None (resume): every marker that still names its save counts.
        refuse: ``(step, newest mtime in epoch seconds) -> reason or None``: a checkpoint it names a reason for is
            skipped with it (resume: a tainted run's, ``suspects.tainted_by``).
        only_step: look at the folders of that step alone (many nodes: this node's part of the step node 0 put,
            ``guard.secure.follow``); no loose files then. Default None: every folder.
        vet: the last word on a checkpoint that passed every other rule: a reason skips it for the next one
            (resume: its saved weights are not finite, ``guard.secure.weights``); None (default): none.
        quiet: resolved paths of folders the job's ``torch.save`` into was seen (judged at that save): their
            "still being written" skip is logged at debug, not info (no news: the guard already took or judged
            them). Default: none.

    Returns:
        The :class:`CheckpointInfo`, or None when there is none (or ``output_dir`` does not exist).
    """
    base = Path(output_dir)
    try:
        names = os.listdir(base)
    except (FileNotFoundError, NotADirectoryError):
        log.debug("no checkpoints: %s does not exist", base)
        return None
    # The job's report names the folder its own way (``os.path.abspath`` in the job, resolved by the supervisor) and
    # the output folder may be reached through a symbolic link (``/scratch`` on a cluster, ``/var`` on macOS): the
    # two are compared resolved, so that a folder the job said it finished is never "still being written".
    said = {os.path.realpath(p) for p in reported}
    kept = {os.path.realpath(p) for p in resumed}
    known = {os.path.realpath(p): s for p, s in (steps or {}).items()}
    candidates = sorted(((known.get(os.path.realpath(base / name), int(m.group(1))), name) for name in names
                         if (m := _FOLDER_RE.fullmatch(name) or _SHARDED_FOLDER_RE.fullmatch(name))), reverse=True)
    if only_step is not None:
        candidates, loose = [c for c in candidates if c[0] == only_step], False
    for step, name in candidates:
        path = base / name
        if not path.is_dir() or path.is_symlink():
            continue
        if not _FOLDER_RE.fullmatch(name) and not _holds_sharded(path):
            continue  # a step-N folder of no sharded format: not a checkpoint of a known layout
        told = os.path.realpath(path) in said
        fetched = not told and os.path.realpath(path) in kept and _placed_before(path, since_s, stat)
        files: dict[str, tuple[int, float]]
        reason: str | None
        if is_marked_suspect(path, run_id=run_id):
            files, reason = {}, "marked suspect (saved after the first non-finite loss): never resumed or pushed"
        else:
            files, reason = _check(path, now_s, stable_for_s, stat, reported=told or fetched, world_size=world_size,
                                   parts=parts)
        pending = (waiting or {}).get(os.path.realpath(path))
        if reason is None and pending is not None and not every_rank_marked(files, name, world_size):
            reason = pending
        if reason is None and _left_over(path, files, since_s) and os.path.realpath(path) not in kept:
            reason = "found and left alone: saved before this run started and not resumed from"
        if reason is None and refuse is not None:
            found, _ = (step, "reported") if os.path.realpath(path) in known else _folder_step(path, step)
            reason = refuse(found, max(m for _, m in files.values()))
        if reason is None:
            found, source = (step, "reported") if os.path.realpath(path) in known else _folder_step(path, step)
            info = _info(path, files, found, step_source=source,
                         admitted_by="reported" if told else "resumed" if fetched else "settled")
            required, lacking = _required_here(path, files, world_size)
            # a part: its format names files it lacks (node 0's DCP .metadata), or, read as one node's whole
            # checkpoint, it is not one (node 1's DCP shards without .metadata, a ZeRO rank's files alone)
            alone = bool(lacking) or (parts and _check(path, now_s, 0.0, stat, reported=True,
                                                       world_size=world_size, parts=False)[1] is not None)
            info = dataclasses.replace(info, requires=tuple(sorted(required.items())), part=alone)
            reason = vet(info) if vet is not None else None
            if reason is None:
                _log_admitted(info, stable_for_s, quiet=os.path.realpath(path) in quiet)
                return info
        if seen is None or (str(path), reason) not in seen:
            settling = reason.startswith("still being written") and os.path.realpath(path) in quiet
            log.log(logging.DEBUG if settling else logging.INFO, "skipped checkpoint %s: %s", path, reason)
            if seen is not None:
                seen.add((str(path), reason))
    return loose_files(base, now_s=now_s, stable_for_s=stable_for_s, stat=stat, since_s=since_s, resumed=kept,
                       seen=seen, run_id=run_id, refuse=refuse, vet=vet) if loose else None


def _holds_sharded(path: Path) -> bool:
    """The folder holds a file of a sharded format at its top (``_SHARDED_FILE_RE``)."""
    try:
        return any(_SHARDED_FILE_RE.fullmatch(name) for name in os.listdir(path))
    except OSError:
        return False


def is_scratch_name(name: str) -> bool:
    """A hidden or temporary name (``.partial-checkpoint-1``, ``tmp``, ``tmp-x``, ``x.tmp``, timm's
    ``tmp.pth.tar``): what lies under it is renamed into place later (or dropped)."""
    lowered = name.lower()
    return lowered.startswith((".", "tmp")) or lowered.endswith((".tmp", "-tmp", "_tmp"))


_is_scratch = is_scratch_name


def _system_temp_folders() -> frozenset[str]:
    """The machine's temporary folders (``/tmp``, ``/var/tmp``, ``$TMPDIR``, ``tempfile.gettempdir()``): an output
    folder under one of them is a real one (Slurm's recipe writes to ``${TMPDIR:-/tmp}/$SLURM_JOB_ID/out``)."""
    import tempfile

    found = {"/tmp", "/var/tmp", "/dev/shm", tempfile.gettempdir(), os.environ.get("TMPDIR") or "/tmp"}
    return frozenset(os.path.realpath(path.rstrip(os.sep) or os.sep) for path in found)


def _in_scratch_folder(path: Path) -> bool:
    """A save under a hidden or temporary folder of the job's (``.partial-checkpoint-1/``, ``tmp-x/``), one of the
    two folders above the file, to be renamed into place later; the machine's own temporary folders (``/tmp``)
    are not such folders."""
    system = _system_temp_folders()
    for folder in (path.parent, path.parent.parent):
        if _is_scratch(folder.name) and os.path.realpath(folder) not in system:
            return True
    return False


def _is_model_file(name: str) -> bool:
    return name.endswith(MODEL_FILE_SUFFIXES) and not name.startswith((".", "_")) and name not in _NOT_MODEL_FILES


def loose_files(output_dir: str | os.PathLike[str], *, now_s: float, stable_for_s: float = STABLE_FOR_S,
                stat: StatFn = os.stat, since_s: float | None = None, resumed: Collection[str] = (),
                seen: set[tuple[str, str]] | None = None, run_id: str | None = None,
                refuse: Refusal | None = None,
                vet: Callable[[CheckpointInfo], str | None] | None = None) -> CheckpointInfo | None:
    """A stable set of model/optimizer files at the top of ``output_dir``, as one checkpoint (``root`` is the
    folder; ``files`` the set), or None. Files last written before ``since_s`` (an earlier run's, e.g. a leftover
    ``model_step_30.pt``) are left alone and logged, unless one of ``resumed``.

    Files named with a step (``model_step_200.pt``) are grouped by it; the group with the highest step wins over
    the files without one when it is as new; the files without a step form one set, step unknown. A set counts
    only when none of its files changed within ``stable_for_s`` and two stat passes agree. ``run_id``, ``refuse``
    and ``vet``: as for ``newest_complete``.
    """
    base = Path(output_dir)
    try:
        names = sorted(n for n in os.listdir(base) if _is_model_file(n) and not _is_scratch(n))
    except (FileNotFoundError, NotADirectoryError):
        return None

    suspects = [n for n in names if is_marked_suspect(base / n, run_id=run_id)]
    if suspects:
        log.debug("left out %s: marked suspect (saved after the first non-finite loss)", ", ".join(suspects))
        names = [n for n in names if n not in suspects]

    def look() -> dict[str, tuple[int, float]]:
        out = {}
        for name in names:
            full = base / name
            if full.is_symlink():
                continue  # a link at the top of the output folder is not the job's save
            try:
                st = stat(str(full))
            except (FileNotFoundError, NotADirectoryError):
                continue
            if _stat.S_ISREG(st.st_mode):
                out[name] = (st.st_size, st.st_mtime)
        return out

    first = look()
    kept = {os.path.realpath(p) for p in resumed}
    old = sorted(n for n in first if _left_over(base, [n], since_s) and os.path.realpath(base / n) not in kept)
    if old:
        key = (str(base), "left alone: " + ", ".join(old))
        if seen is None or key not in seen:
            log.info("found and left alone in %s: %s (saved before this run started, not resumed from)", base,
                     ", ".join(old))
            if seen is not None:
                seen.add(key)
        names = [n for n in names if n not in old]
        first = {n: e for n, e in first.items() if n not in old}
    if not first:
        return None
    groups: dict[int | None, dict[str, tuple[int, float]]] = {}
    for name, entry in first.items():
        m = _STEP_IN_NAME_RE.search(name)
        groups.setdefault(int(m.group(1)) if m else None, {})[name] = entry
    stepped = [k for k in groups if k is not None]
    choices = ([groups[max(stepped)]] if stepped else []) + ([groups[None]] if None in groups else [])
    chosen = max(choices, key=lambda g: max(m for _, m in g.values()))
    step = next((k for k, g in groups.items() if g is chosen), None)
    newest = max(m for _, m in chosen.values())
    if newest > now_s - stable_for_s:
        log.debug("model files in %s still being written", base)
        return None
    second = look()
    if any(second.get(name) != entry for name, entry in chosen.items()):
        return None
    problems = check_files(base, sorted(chosen))
    if problems:
        log.debug("model files in %s not whole by format: %s", base, problems[0])
        return None
    refused = refuse(step, newest) if refuse is not None else None
    if refused is not None:
        log.info("left out %s in %s: %s", ", ".join(sorted(chosen)), base, refused)
        return None
    path = base / next(iter(chosen)) if len(chosen) == 1 else base
    info = _info(path, chosen, step, root=base, step_source="name", admitted_by="settled")
    vetoed = vet(info) if vet is not None else None
    if vetoed is not None:
        log.info("left out %s in %s: %s", ", ".join(sorted(chosen)), base, vetoed)
        return None
    _log_admitted(info, stable_for_s)
    return info


class SavedFiles:
    """Files the agent saw the job save (``torch.save`` returned), grouped into checkpoints.

    A save that returned is complete: no mtime rule. Files saved into the same folder at the same step (the
    agent's step count, the guard's step unit) form one checkpoint, e.g. ``model.pt`` and ``optim.pt``. A file saved
    into a checkpoint folder (``checkpoint-20/model.pt``, accelerate's ``step_3/optimizer.bin``) makes that folder
    the checkpoint (``CheckpointInfo.path`` the folder, ``admitted_by`` ``"saved-folder"``): it is taken whole once
    the job trained on past the save, judged then by its completion files and formats (``saved_folder``), without
    the settle time.
    """

    def __init__(self) -> None:
        self._by_folder: dict[Path, tuple[int | None, dict[str, float]]] = {}

    def add(self, path: str | os.PathLike[str], step: int | None, *, stat: StatFn = os.stat) -> CheckpointInfo | None:
        """Record one saved file; returns the checkpoint it belongs to (its folder's files of that step that
        still exist, or its checkpoint folder), or None when the file is gone or is not a model file."""
        where = Path(os.path.abspath(path))
        if not _is_model_file(where.name) or _in_scratch_folder(where):
            return None  # a save into a hidden or temporary folder is renamed into place later (or dropped)
        for folder in (where.parent, where.parent.parent):
            if _CHECKPOINT_LIKE_RE.fullmatch(folder.name) and not folder.name.startswith("tmp-"):
                # one file of a checkpoint folder: the folder is the checkpoint, never this file alone
                try:
                    walked = _walk(folder, stat)
                except (FileNotFoundError, NotADirectoryError):
                    return None
                if not walked:
                    return None
                return _info(folder, walked, step, step_source="reported" if step is not None else None,
                             admitted_by="saved-folder")
        folder = where.parent
        last_step, names = self._by_folder.get(folder, (None, {}))
        if last_step != step:
            names = {}
        names[where.name] = 0.0
        self._by_folder[folder] = (step, names)
        files: dict[str, tuple[int, float]] = {}
        for name in list(names):
            try:
                st = stat(str(folder / name))
            except OSError:
                names.pop(name)
                continue
            files[name] = (st.st_size, st.st_mtime)
        if not files:
            return None
        target = folder / next(iter(files)) if len(files) == 1 else folder
        return _info(target, files, step, root=folder, step_source="reported", admitted_by="saved")

    def names_in(self, folder: str | os.PathLike[str]) -> tuple[str, ...]:
        """The names of the files of the job's last save into ``folder`` (its top level), sorted."""
        return tuple(sorted(self._by_folder.get(Path(os.path.abspath(folder)), (None, {}))[1]))


def saved_folder(path: str | os.PathLike[str], *, now_s: float, steps: Mapping[str, int] | None = None,
                 stat: StatFn = os.stat, world_size: int = 1,
                 parts: bool = False) -> tuple[CheckpointInfo | None, str | None]:
    """A checkpoint folder the job saved a file into with ``torch.save`` and trained on past: ``(the checkpoint,
    None)`` when it is complete by its completion files and formats (``why_incomplete``'s rules without the settle
    time: the job wrote it and went on), else ``(None, why not)``. Its step is the one the scan gives it
    (``trainer_state.json``, the guard's marker, the name's N; ``steps``: folder -> the guard's step for folders whose
    N counts saves).

    Args:
        path: the folder. now_s: now, epoch seconds. stat: ``os.stat``-like callable. world_size: the job's ranks.
        parts: the job has several nodes, each with its own disk: a folder holding this node's part is taken as
            such (``CheckpointInfo.part``, as ``newest_complete`` finds it).
    """
    where = Path(path)
    files, reason = _check(where, now_s, 0.0, stat, world_size=world_size, parts=parts)
    if reason is not None:
        return None, reason
    known = {os.path.realpath(p): s for p, s in (steps or {}).items()}
    match = _FOLDER_RE.fullmatch(where.name) or _SHARDED_FOLDER_RE.fullmatch(where.name)
    if os.path.realpath(where) in known:
        step: int | None
        step, source = known[os.path.realpath(where)], "reported"
    elif match is not None:
        step, source = _folder_step(where, int(match.group(1)))
    else:
        step, source = None, None
    info = _info(where, files, step, step_source=source, admitted_by="saved")
    if parts:
        required, lacking = _required_here(where, files, world_size)
        info = dataclasses.replace(info, requires=tuple(sorted(required.items())), part=bool(lacking))
    return info, None


def _required_here(path: Path, files: Mapping[str, tuple[int, float]],
                   world_size: int) -> tuple[dict[str, int], list[str]]:
    """``(what the folder's format requires, what of it the folder lacks)`` (``formats.requires`` with the job's
    ``world_size`` when above 1, ``formats.missing_required``); ``files``: the folder's ``{rel: (size, mtime)}``."""
    required = requires(path, world_size=world_size if world_size > 1 else None)
    return required, missing_required(required, {rel: size for rel, (size, _) in files.items()})


def describe(path: str | os.PathLike[str], *, step: int | None = None, stat: StatFn = os.stat, parts: bool = False,
             world_size: int = 1) -> CheckpointInfo:
    """Describe a checkpoint the job reported itself (``guard.checkpoint_saved(path)``), named freely.

    ``path`` may be a folder or a single file. The step is, in order: ``global_step`` from ``trainer_state.json``,
    the caller's ``step``, ``step`` from ``guard_checkpoint.json``, N from a ``checkpoint-N`` name, else None.
    Completeness is not checked here: the job said the save is done. ``parts``: the job has several nodes, each
    with its own disk: a folder lacking files its format names for the job's ``world_size`` ranks (node 0's
    ``checkpoint-N`` without ``rng_state_1.pth``, node 1's with that file alone) is this node's part
    (``CheckpointInfo.part``, with ``requires``); default False.

    Raises:
        SupervisorError: ``path`` does not exist or holds no file.
    """
    where = Path(path)
    try:
        files = _walk(where, stat)
    except (FileNotFoundError, NotADirectoryError):
        files = {}
    if not files:
        raise SupervisorError(f"the job reported checkpoint {where}, but it does not exist or is empty",
                              hint="call guard.checkpoint_saved(path) after the save, with the folder or file written")
    found, source = None, None
    if where.is_dir():
        found, source = _step_from_json(where, TRAINER_STATE_NAME, "global_step"), "trainer_state"
        if found is None:
            found, source = step, "reported"
        if found is None:
            found, source = _step_from_json(where, GUARD_MARKER_NAME, "step"), "marker"
    elif step is not None:
        found, source = step, "reported"
    if found is None and (m := _FOLDER_RE.fullmatch(where.name)):
        found, source = int(m.group(1)), "name"
    info = _info(where, files, found, step_source=source, admitted_by="reported")
    if not parts or not where.is_dir():
        return info
    required, lacking = _required_here(where, files, world_size)
    return dataclasses.replace(info, requires=tuple(sorted(required.items())), part=bool(lacking))


def rewritten_after(folder: Path, files: Iterable[str], saved_s: float,
                    stat: StatFn = os.stat) -> tuple[str, float] | None:
    """The first of ``files`` (relative to ``folder``) modified after ``saved_s`` (epoch seconds, the newest mtime
    when the checkpoint was seen complete), with how many seconds later; None when none was. A missing file counts
    as rewritten (``inf`` seconds): a checkpoint saved in place (``ckpt.pt``) no longer holds the older step.
    ``stat``: ``os.stat``-like callable (tests inject one)."""
    for rel in files:
        try:
            mtime_s = stat(str(folder / rel)).st_mtime
        except OSError:
            return rel, math.inf
        if mtime_s > saved_s + 1e-3:  # mtime resolution and float rounding
            return rel, mtime_s - saved_s
    return None
