"""The atomic steps of a folder destination, and their recovery after a kill (``guard.secure.dest.folder``).

A push may be SIGKILLed at any instruction (its deadline, a signal). What it leaves beside the record, and what
the next look at the destination (``recover``) makes of it, so that ``DEST/last-checkpoint`` is always the previous
secured copy or the new one, never neither, and the final model is never a mix of two::

    DEST/.last-checkpoint.tmp-<pid>-XXXX/     a put's staging copy: removed once its process is gone
                                              (``remove_stale_staging``, run by the next put and after the run)
    DEST/.last-checkpoint.previous-<pid>/     the previous copy while the fallback swap runs: put back when
                                              ``last-checkpoint`` is missing, else removed
    DEST/.guard-final-journal.json            the final push's renames, written (fsynced) once every staged file
                                              verified: finished from it
    DEST/.last-checkpoint.kept/               the record before the last one, kept aside (``keep_aside``) so that
                                              a taint reaching the last one swaps it back (``swap_back``); removed
                                              once the last one can no longer turn suspect, by the next record,
                                              and after the run (``drop_kept``)

- ``swap_in``: a staged folder in place as the record, atomically: ``renameat2(RENAME_EXCHANGE)`` on Linux where the
  file system has it; else (NFS and others) two renames through ``.last-checkpoint.previous-<pid>``.
- ``journaled_renames``: the final model's staged files renamed into place under a journal.
- ``recover``: finishes or undoes what a killed push left (its process gone: ``psutil.pid_exists``).
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import shutil
import sys
from pathlib import Path

from guard.secure.dest import local
from guard.secure.dest.base import CHECKPOINT_FOLDER

__all__ = ["KEPT", "STAGING_PREFIX", "drop_kept", "journaled_renames", "keep_aside", "recover", "remove_stale_staging",
           "rename_exchange", "swap_back", "swap_in"]

logger = logging.getLogger("guard.secure.folder")

#: Where the fallback swap keeps the previous secured copy until the new one is in place (never matched by the
#: staging glob): ``.last-checkpoint.previous-<pid>``.
_PREVIOUS = f".{CHECKPOINT_FOLDER}.previous-"
#: A put's staging folder: ``.last-checkpoint.tmp-<pid>-XXXX`` (``local.staging_dir`` adds the ``XXXX``).
STAGING_PREFIX = f".{CHECKPOINT_FOLDER}.tmp-"
#: The record before the last one, kept aside until the next record replaces it or the run ends.
KEPT = f".{CHECKPOINT_FOLDER}.kept"
#: The final push's journal: the renames of files staged and verified beside the root, replayed by the next run.
_FINAL_JOURNAL = ".guard-final-journal.json"


def remove_stale_staging(root: Path, log: logging.Logger = logger) -> None:
    """Remove the ``.last-checkpoint.tmp-<pid>-XXXX`` staging folders under ``root`` left by a push that was killed
    (its process is gone), after ``recover`` put back a previous copy that a killed swap left aside. Raises
    ``OSError``."""
    recover(root, log)
    for entry in root.glob(f"{STAGING_PREFIX}*"):
        if entry.is_dir() and not entry.name.endswith(".old") and not _pid_alive(_staging_pid(entry)):
            shutil.rmtree(entry, ignore_errors=True)


def journaled_renames(root: Path, staged: dict[str, Path]) -> None:
    """Write the journal of ``staged`` renames (``{rel: staged file}``), fsynced; do them; remove the journal."""
    journal = root / _FINAL_JOURNAL
    with open(journal, "w") as out:
        json.dump({"pid": os.getpid(), "renames": {rel: tmp.relative_to(root).as_posix()
                                                    for rel, tmp in staged.items()}}, out)
        out.flush()
        os.fsync(out.fileno())
    local.fsync_dir(root)
    for rel, tmp in staged.items():
        os.replace(tmp, root / rel)
    for parent in {(root / rel).parent for rel in staged}:
        local.fsync_dir(parent)
    journal.unlink()
    local.fsync_dir(root)


def rename_exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically with Linux ``renameat2(RENAME_EXCHANGE)``; False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, exchange = -100, 2  # AT_FDCWD, RENAME_EXCHANGE (linux/fcntl.h, linux/fs.h)
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def swap_in(staging: Path, target: Path) -> Path | None:
    """Put ``staging`` at ``target`` atomically; returns the path now holding the old content (to delete).

    ``renameat2(RENAME_EXCHANGE)`` where the file system has it; else (NFS and others) two renames, the previous
    copy first moved to ``.last-checkpoint.previous-<pid>``: killed between the two, the next run finds no
    ``last-checkpoint`` and that folder, and puts it back (``recover``), so the secured copy is never lost."""
    if not target.exists():
        os.rename(staging, target)
        return None
    if rename_exchange(staging, target):
        return staging
    old = target.with_name(f"{_PREVIOUS}{os.getpid()}")
    if old.exists():
        shutil.rmtree(old)
    os.rename(target, old)
    local.fsync_dir(target.parent)
    os.rename(staging, target)
    return old


def _staging_pid(entry: Path) -> str:
    """The pid in a staging folder's name (``.last-checkpoint.tmp-<pid>-XXXX``)."""
    return entry.name[len(STAGING_PREFIX):].split("-", 1)[0]


def _pid_alive(text: str) -> bool:
    import psutil

    return text.isdigit() and psutil.pid_exists(int(text))


def recover(root: Path, log: logging.Logger = logger) -> None:
    """Finish what a push killed part way left at a folder destination (its process is gone):

    - no ``last-checkpoint`` but a previous copy (``.last-checkpoint.previous-<pid>``, or ``.last-checkpoint.tmp-
      <pid>-XXXX.old`` of older versions): it is put back; with ``last-checkpoint`` present it is removed;
    - a final push's journal: every staged file it lists is renamed into place (all were verified before the
      journal was written), then the journal is removed.
    """
    target = root / CHECKPOINT_FOLDER
    previous = [e for e in root.glob(f"{_PREVIOUS}*") if not _pid_alive(e.name[len(_PREVIOUS):])]
    previous += [e for e in root.glob(f"{STAGING_PREFIX}*.old") if not _pid_alive(_staging_pid(e))]
    for entry in sorted(previous, key=lambda e: e.stat().st_mtime, reverse=True):
        if not target.exists() and entry.is_dir():
            os.rename(entry, target)
            local.fsync_dir(root)
            log.warning("%s was missing after a push killed mid-swap: the previous secured copy is back in place",
                        target)
        else:
            shutil.rmtree(entry, ignore_errors=True)
    journal = root / _FINAL_JOURNAL
    try:
        entries = json.loads(journal.read_text())
    except (OSError, ValueError):
        return
    if _pid_alive(str(entries.get("pid", ""))):
        return
    for rel, staged in entries.get("renames", {}).items():
        if (root / staged).is_file():
            os.replace(root / staged, root / rel)
    local.fsync_dir(root)
    journal.unlink()
    log.warning("a final push to %s was killed while its files were put in place: finished it from its journal",
                root)


def keep_aside(old: Path, root: Path) -> None:
    """Keep ``old`` (the copy the last swap replaced) as ``DEST/.last-checkpoint.kept``, in place of an earlier
    one. Killed midway, the earlier one is gone and ``old`` is left under its own name (removed by
    ``remove_stale_staging``): only the chance to swap back is lost, never the record. Never raises."""
    kept = root / KEPT
    shutil.rmtree(kept, ignore_errors=True)
    try:
        os.rename(old, kept)
    except OSError:  # kept again meanwhile (another writer): this one is not needed
        shutil.rmtree(old, ignore_errors=True)


def swap_back(root: Path, step: int, log: logging.Logger = logger) -> Path:
    """Swap the copy kept aside (``keep_aside``) back in as ``last-checkpoint``, when it is checkpoint ``step`` and
    every file its manifest names is there with its size (it was verified when it was the record); the copy it
    replaces is removed. Atomic as ``swap_in``. Returns the record's path.

    Raises:
        FileNotFoundError: no copy is kept, or it is not step ``step`` or not whole (the caller pushes again).
        OSError: the swap failed (the record stays as it was).
    """
    kept, target = root / KEPT, root / CHECKPOINT_FOLDER
    manifest = local.read_manifest(kept) if kept.is_dir() else {}
    files = manifest.get("files") if isinstance(manifest.get("files"), dict) else None
    if manifest.get("step") != step or not files:
        raise FileNotFoundError(f"{root} keeps no copy of checkpoint step {step} aside "
                                f"(kept: {manifest.get('step', 'none')})")
    short = [rel for rel, meta in files.items()
             if not (kept / rel).is_file() or (kept / rel).stat().st_size != meta.get("size")]
    if short:
        raise FileNotFoundError(f"the copy of checkpoint step {step} kept at {root} is not whole: {short[0]}")
    old = swap_in(kept, target)
    local.fsync_dir(root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    log.warning("%s is checkpoint step %d again (swapped back from %s)", target, step, KEPT)
    return target


def drop_kept(root: Path) -> None:
    """Remove the copy kept aside (the record can no longer turn suspect, or the run is over)."""
    shutil.rmtree(root / KEPT, ignore_errors=True)
