"""Finding complete checkpoints on disk: never one still being written.

A checkpoint folder counts as complete when:

- it holds the Trainer's state file ``trainer_state.json`` or the guard's marker ``guard_checkpoint.json``.
  ``Trainer._save_checkpoint`` (transformers 5.24.0, ``trainer.py``) writes the model, then optimizer, scheduler,
  scaler and RNG states, and ``trainer_state.json`` *last*; ``guard.checkpoint_saved(path)`` writes the marker after
  the script's own save;
- it holds no ``checkpoint-is-incomplete.txt``: transformers' JIT checkpointing (``trainer_jit_checkpoint.py``,
  ``enable_jit_checkpoint=True``) creates that sentinel before saving and removes it on success (anchors.md 6a);
- its files have stopped changing: no file's mtime within ``stable_for_s`` of now, and two stat passes over the
  folder agree on every size and mtime.

The Trainer rotates old checkpoints (``rotate_checkpoints``) while we may be scanning: a folder or file that vanishes
mid-scan is skipped, never an error.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat as _stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from guard.errors import SupervisorError

__all__ = [
    "GUARD_MARKER_NAME",
    "INCOMPLETE_SENTINEL_NAME",
    "TRAINER_STATE_NAME",
    "CheckpointInfo",
    "describe",
    "is_complete",
    "newest_complete",
    "tree_size_bytes",
    "why_incomplete",
]

log = logging.getLogger("guard.checkpoints")

#: Written last by ``Trainer._save_checkpoint`` (transformers ``TRAINER_STATE_NAME``).
TRAINER_STATE_NAME = "trainer_state.json"
#: Written by ``guard.checkpoint_saved(path)`` into a custom loop's checkpoint folder.
GUARD_MARKER_NAME = "guard_checkpoint.json"
#: Present while transformers' JIT checkpointing is saving (``trainer_jit_checkpoint.py``).
INCOMPLETE_SENTINEL_NAME = "checkpoint-is-incomplete.txt"

_CHECKPOINT_RE = re.compile(r"checkpoint-([0-9]+)")
StatFn = Callable[[str], os.stat_result]


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint on disk.

    Attributes:
        path: the folder (or, for a custom loop, the single file).
        step: the training step it was saved at, or None when unknown.
        size_bytes: the sum of its files' sizes.
        files: its files as sorted relative POSIX paths (a tuple; ``(name,)`` for a single file).
        newest_mtime_s: the newest file mtime, epoch seconds.
    """

    path: Path
    step: int | None
    size_bytes: int
    files: tuple[str, ...]
    newest_mtime_s: float


def _walk(path: Path, stat: StatFn) -> dict[str, tuple[int, float]]:
    """``{relative posix path: (size, mtime)}`` for every regular file under ``path`` (symlinks followed for files,
    not for folders). Raises FileNotFoundError when ``path`` itself is gone."""
    top = stat(str(path))
    if not _stat.S_ISDIR(top.st_mode):
        return {path.name: (top.st_size, top.st_mtime)}
    found: dict[str, tuple[int, float]] = {}
    for root, dirs, names in os.walk(path, onerror=None, followlinks=False):
        dirs.sort()
        for name in sorted(names):
            full = os.path.join(root, name)
            try:
                st = stat(full)
            except (FileNotFoundError, NotADirectoryError):
                continue  # removed while we looked (a rotation, a temp file renamed)
            if _stat.S_ISREG(st.st_mode):
                found[Path(os.path.relpath(full, path)).as_posix()] = (st.st_size, st.st_mtime)
    if not found and not path.exists():
        raise FileNotFoundError(str(path))
    return found


def tree_size_bytes(path: str | os.PathLike[str], *, stat: StatFn = os.stat) -> int:
    """Total size in bytes of the regular files under ``path`` (or of ``path`` itself if it is a file).

    Raises:
        FileNotFoundError: ``path`` does not exist.
    """
    return sum(size for size, _ in _walk(Path(path), stat).values())


def why_incomplete(path: str | os.PathLike[str], *, now_s: float, stable_for_s: float = 2.0,
                   stat: StatFn = os.stat) -> str | None:
    """Why the checkpoint folder ``path`` is not (yet) complete, or None when it is.

    Args:
        path: a checkpoint folder.
        now_s: now, epoch seconds (compared with file mtimes).
        stable_for_s: how long every file must have been left unchanged (default 2 s).
        stat: ``os.stat``-like callable (tests inject one).
    """
    return _check(Path(path), now_s, stable_for_s, stat)[1]


def is_complete(path: str | os.PathLike[str], *, now_s: float, stable_for_s: float = 2.0,
                stat: StatFn = os.stat) -> bool:
    """True when the checkpoint folder ``path`` is complete (see :func:`why_incomplete`)."""
    return why_incomplete(path, now_s=now_s, stable_for_s=stable_for_s, stat=stat) is None


def _check(path: Path, now_s: float, stable_for_s: float,
           stat: StatFn) -> tuple[dict[str, tuple[int, float]], str | None]:
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
    if TRAINER_STATE_NAME not in first and GUARD_MARKER_NAME not in first:
        return first, f"no {TRAINER_STATE_NAME} or {GUARD_MARKER_NAME} (save not finished)"
    newest_name, (_, newest_mtime_s) = max(first.items(), key=lambda item: item[1][1])
    if newest_mtime_s > now_s - stable_for_s:
        return first, f"still being written ({newest_name} changed {max(0.0, now_s - newest_mtime_s):.1f}s ago)"
    try:
        second = _walk(path, stat)
    except FileNotFoundError:
        return {}, "gone (removed while scanning)"
    if second != first:
        changed = sorted(set(first.items()) ^ set(second.items()))
        return second, f"still being written ({changed[0][0]} changed while scanning)"
    return first, None


def _step_from_json(path: Path, name: str, key: str) -> int | None:
    try:
        data = json.loads((path / name).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    value = data.get(key) if isinstance(data, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _info(path: Path, files: dict[str, tuple[int, float]], step: int | None) -> CheckpointInfo:
    return CheckpointInfo(path=path, step=step, size_bytes=sum(size for size, _ in files.values()),
                          files=tuple(sorted(files)), newest_mtime_s=max(m for _, m in files.values()))


def newest_complete(output_dir: str | os.PathLike[str], *, now_s: float, stable_for_s: float = 2.0,
                    stat: StatFn = os.stat, seen: set[tuple[str, str]] | None = None) -> CheckpointInfo | None:
    """The newest complete ``checkpoint-N`` folder (highest N) under ``output_dir``.

    Folders newer than the one returned that are skipped are logged with the reason (still being written, no state
    file, the JIT sentinel); a partial folder is never returned.

    Args:
        output_dir: the job's output folder (``TrainingArguments.output_dir``).
        now_s: now, epoch seconds.
        stable_for_s: how long every file must have been left unchanged (default 2 s).
        stat: ``os.stat``-like callable (tests inject one).
        seen: pass the same set on every call to log each (folder, reason) only once; None logs every time.

    Returns:
        The :class:`CheckpointInfo` (step = N), or None when there is none (or ``output_dir`` does not exist).
    """
    base = Path(output_dir)
    try:
        names = os.listdir(base)
    except (FileNotFoundError, NotADirectoryError):
        log.debug("no checkpoints: %s does not exist", base)
        return None
    candidates = sorted(((int(m.group(1)), name) for name in names if (m := _CHECKPOINT_RE.fullmatch(name))),
                        reverse=True)
    for step, name in candidates:
        path = base / name
        files, reason = _check(path, now_s, stable_for_s, stat)
        if reason is None:
            return _info(path, files, step)
        if seen is None or (str(path), reason) not in seen:
            log.info("skipped checkpoint %s: %s", path, reason)
            if seen is not None:
                seen.add((str(path), reason))
    return None


def describe(path: str | os.PathLike[str], *, step: int | None = None, stat: StatFn = os.stat) -> CheckpointInfo:
    """Describe a checkpoint the job reported itself (``guard.checkpoint_saved(path)``), named freely.

    ``path`` may be a folder or a single file. The step is, in order: ``global_step`` from ``trainer_state.json``,
    the caller's ``step``, ``step`` from ``guard_checkpoint.json``, N from a ``checkpoint-N`` name, else None.
    Completeness is not checked here: the job said the save is done.

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
    found = None
    if where.is_dir():
        found = _step_from_json(where, TRAINER_STATE_NAME, "global_step")
        if found is None:
            found = step if step is not None else _step_from_json(where, GUARD_MARKER_NAME, "step")
    elif step is not None:
        found = step
    if found is None and (m := _CHECKPOINT_RE.fullmatch(where.name)):
        found = int(m.group(1))
    return _info(where, files, found)
