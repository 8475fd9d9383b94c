"""Local snapshots of files a job saves in place faster than a push can start.

A loop that saves ``out/ckpt.pt`` over itself every fraction of a second (``torch.save`` truncates and rewrites the
same inode) has rewritten the file before any push worker, a process of its own, has read it: every push is refused
("rewritten after that save") and nothing is ever secured. Such a save is copied here, on the file system thread,
as soon as its report arrives: the copy is that save when the file's signature ``(size, mtime_ns, inode)`` before
and after the copy equals the one the agent reported right after ``torch.save`` returned (``file_saved``); else the
file was already saved again, and that newer save's own report follows. The push then reads the snapshot, which
nothing rewrites, and the record names the folder the file was saved in (``CheckpointInfo.source``).

A save is copied when it is small (``SNAPSHOT_MAX_BYTES``) and its path was saved before less than
``SNAPSHOT_BELOW_S`` earlier: a file saved in place less often is read by the push before it is saved again. The
copies lie in a private temporary folder (local disk), newest first: those of the last ``KEEP_S`` seconds are kept
(a push under way may read one), at most ``KEEP_COUNT`` of them and ``KEEP_BYTES`` in all (the newest two always);
the folder is removed when the guard exits.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path

from guard.secure.checkpoints import CheckpointInfo, StatFn
from guard.secure.formats import recorded_step

__all__ = ["KEEP_BYTES", "KEEP_COUNT", "KEEP_S", "SNAPSHOT_BELOW_S", "SNAPSHOT_MAX_BYTES", "Signature", "Snapshots",
           "sig_of", "signature_of"]

log = logging.getLogger("guard.secure")

#: A path saved again within this many seconds is snapshotted: a push worker (a new process: about 1 s to start on
#: an idle machine, several under load) would read it after the next save.
SNAPSHOT_BELOW_S = 10.0
#: Files larger than this are never copied (the copy would cost more than the push it saves); 256 MiB.
SNAPSHOT_MAX_BYTES = 256 * 1024 * 1024
KEEP_S = 300.0  # snapshots younger than this are kept (a push under way reads one), within the two bounds below
KEEP_COUNT = 512
KEEP_BYTES = 1024 * 1024 * 1024

#: ``(size_bytes, mtime_ns, inode)`` of a file.
Signature = tuple[int, int, int]


def signature_of(message: Mapping[str, object]) -> Signature | None:
    """The signature a ``file_saved`` message reports (``size``, ``mtime_ns``, ``inode``), or None when it has
    none (an older agent)."""
    values = (message.get("size"), message.get("mtime_ns"), message.get("inode"))
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return None
    size, mtime_ns, inode = values
    assert isinstance(size, int) and isinstance(mtime_ns, int) and isinstance(inode, int)
    return size, mtime_ns, inode


def sig_of(st: os.stat_result) -> Signature:
    """The signature ``(size, mtime_ns, inode)`` of a ``stat`` result."""
    return st.st_size, st.st_mtime_ns, st.st_ino


_sig = sig_of


class Snapshots:
    """The snapshots of one guard process (used on the file system thread only).

    Args:
        stat: ``os.stat``-like callable. clock: monotonic seconds. base: the folder to copy into (default: a new
            private temporary folder, removed at exit).
    """

    def __init__(self, stat: StatFn = os.stat, clock: Callable[[], float] = time.monotonic,
                 base: Path | None = None) -> None:
        self._stat, self._clock = stat, clock
        self._base = base
        self._last_saved: dict[str, float] = {}  # path -> clock time of its last reported save
        self._reported: dict[str, tuple[int | None, Signature]] = {}  # path -> (step, signature) of its last save
        self._kept: deque[tuple[float, Path, int]] = deque()  # (taken at, folder, bytes), oldest first
        self._count = 0
        self._logged = False

    def saved(self, path: Path, step: int | None, signature: Signature | None) -> bool:
        """Record a reported save; True when its path was saved before less than ``SNAPSHOT_BELOW_S`` ago (a
        snapshot is wanted)."""
        now = self._clock()
        key = str(path)
        last = self._last_saved.get(key)
        self._last_saved[key] = now
        if signature is None:
            self._reported.pop(key, None)
            return False
        self._reported[key] = (step, signature)
        return last is not None and now - last < SNAPSHOT_BELOW_S and signature[0] <= SNAPSHOT_MAX_BYTES

    def current(self, path: Path) -> bool:
        """``path`` still holds its last reported save (its signature is unchanged; True when none was
        reported)."""
        reported = self._reported.get(str(path))
        if reported is None:
            return True
        try:
            return _sig(self._stat(str(path))) == reported[1]
        except OSError:
            return False

    def take(self, info: CheckpointInfo) -> CheckpointInfo | None:
        """Copy ``info``'s files (each one's last reported save, at ``info.step``) into a new snapshot; returns the
        checkpoint pointing at the copy (``root``: the snapshot, ``source``: the folder saved in), or None when a
        file was saved again or changed meanwhile (not that save any more) or cannot be copied."""
        folder = info.folder
        sigs: dict[str, Signature] = {}
        for rel in info.files:
            reported = self._reported.get(str(folder / rel))
            if reported is None or reported[0] != info.step:
                return None  # no signature to hold the copy to
            sigs[rel] = reported[1]
        target = self._new_folder()
        if target is None:
            return None
        files: dict[str, tuple[int, float]] = {}
        try:
            for rel, sig in sigs.items():
                src, dst = folder / rel, target / rel
                if _sig(self._stat(str(src))) != sig:
                    raise _Changed(rel)
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, dst)
                if _sig(self._stat(str(src))) != sig:
                    raise _Changed(rel)
                st = os.stat(dst)
                files[rel] = (st.st_size, st.st_mtime)
        except (OSError, _Changed) as exc:
            shutil.rmtree(target, ignore_errors=True)
            log.debug("no snapshot of %s (step %s): %s", info.path, info.step, exc)
            return None
        size = sum(size for size, _ in files.values())
        self._kept.append((self._clock(), target, size))
        self._trim()
        if not self._logged:
            self._logged = True
            log.info("%s is saved again within %.0fs: each save is copied to %s as soon as it is reported, and "
                     "secured from there", info.path, SNAPSHOT_BELOW_S, self._base)
        recorded = None
        if info.step_source in (None, "reported"):
            for rel in sorted(files):
                if rel.endswith((".pt", ".pth", ".ckpt")) and (recorded := recorded_step(target / rel)):
                    break
        return dataclasses.replace(info, root=target, source=folder, size_bytes=size,
                                   newest_mtime_s=max(m for _, m in files.values()), recorded=recorded)

    def _new_folder(self) -> Path | None:
        try:
            if self._base is None:
                self._base = Path(tempfile.mkdtemp(prefix="guard-snapshots-"))
                atexit.register(shutil.rmtree, self._base, True)
            self._count += 1
            target = self._base / f"{self._count:08d}"
            target.mkdir(parents=True)
        except OSError as exc:
            log.debug("cannot make a snapshot folder: %s", exc)
            return None
        return target

    def _trim(self) -> None:
        """Drop the oldest snapshots beyond the bounds (``KEEP_S``, ``KEEP_COUNT``, ``KEEP_BYTES``), never the
        newest two."""
        now = self._clock()
        total = sum(size for _, _, size in self._kept)
        while len(self._kept) > 2 and (now - self._kept[0][0] > KEEP_S or len(self._kept) > KEEP_COUNT
                                       or total > KEEP_BYTES):
            _, folder, size = self._kept.popleft()
            total -= size
            shutil.rmtree(folder, ignore_errors=True)

    def close(self) -> None:
        """Remove every snapshot (the guard is done)."""
        if self._base is not None:
            shutil.rmtree(self._base, ignore_errors=True)
        self._kept.clear()


class _Changed(Exception):
    def __init__(self, rel: str) -> None:
        super().__init__(f"{rel} was saved again while it was copied")
