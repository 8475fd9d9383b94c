"""Storage checks: the folders the job writes to are writable, the disk has room, ``/dev/shm`` is not tiny.

Writability is tested by creating (and removing) a temporary file, not with ``os.access``: a read-only mount or
an ACL can refuse a write that the permission bits allow, and root passes every ``os.access`` test.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from guard.preflight._common import fmt_bytes, hf_hub_cache, hf_offline
from guard.preflight._models import CheckResult, Status

__all__ = [
    "DEFAULT_MIN_FREE_BYTES",
    "SHM_MIN_BYTES",
    "check_free_space",
    "check_shm",
    "check_writable",
    "estimate_free_bytes",
]

NAME = "storage"

#: Free space asked for when neither ``--min-free-disk`` nor the model size is known (warn only).
DEFAULT_MIN_FREE_BYTES = 10 * 1000**3
#: ``/dev/shm`` below this is a warning: Docker's default is 64 MB, and PyTorch DataLoader workers pass batches
#: through shared memory ("bus error" / "No space left on device" in workers).
SHM_MIN_BYTES = 1024**3

DiskUsage = Callable[[str], Any]  # shutil.disk_usage: returns (total, used, free) in bytes


class _Probe(NamedTuple):
    ok: bool
    tested: Path  # the folder that was written to (the nearest existing one)
    error: str | None


def _nearest_existing(path: Path) -> Path:
    current = path
    while not current.exists():
        if current.parent == current:
            break
        current = current.parent
    return current


def _probe(path: Path) -> _Probe:
    """Try to create and remove a file in ``path``, or in its nearest existing parent when it does not exist."""
    target = _nearest_existing(path.expanduser().absolute())
    if not target.is_dir():
        return _Probe(False, target, f"{target} is not a folder")
    try:
        fd, name = tempfile.mkstemp(prefix=".guard-preflight-", dir=target)
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        reason = "read-only file system" if exc.errno == errno.EROFS else (exc.strerror or str(exc))
        return _Probe(False, target, reason)
    return _Probe(True, target, None)


def check_writable(label: str, path: Path, *, hint: str) -> CheckResult:
    """A row saying whether the job can write to ``path`` (created later if it does not exist yet).

    Args:
        label: what the folder is, e.g. ``"output folder"``.
        path: the folder.
        hint: what to do when it is not writable.
    """
    probe = _probe(path)
    if probe.ok:
        where = "" if probe.tested == path.expanduser().absolute() else f" (will be created in {probe.tested})"
        return CheckResult(NAME, "pass", f"{label} {path} writable{where}")
    return CheckResult(NAME, "fail", f"{label} {path} not writable: {probe.error}", hint)


def check_cache(environ: Mapping[str, str]) -> CheckResult:
    """The Hugging Face cache folder (``HF_HUB_CACHE``/``HF_HOME``) is writable.

    Not writable while offline is a warning (a read-only, pre-filled shared cache works offline); online it
    fails, because downloads go there.
    """
    cache = hf_hub_cache(environ)
    row = check_writable("Hugging Face cache", cache, hint="point HF_HOME (or HF_HUB_CACHE) at a writable folder")
    offline = hf_offline(environ)
    if row.status == "fail" and offline:
        return CheckResult(NAME, "warn", f"{row.seen} ({offline}: only cached files are read)",
                           "fine for a pre-filled shared cache; otherwise point HF_HOME at a writable folder")
    return row


def estimate_free_bytes(model_size_bytes: int | None) -> int:
    """Free space to ask for: about 7 x the model's weights, else ``DEFAULT_MIN_FREE_BYTES``.

    A checkpoint holds the weights and the optimizer state (Adam: two more tensors per weight, about 3 x the
    weights), two checkpoints coexist while the newest is written, and the final model adds one more copy.
    """
    if not model_size_bytes:
        return DEFAULT_MIN_FREE_BYTES
    return int(model_size_bytes) * 7


def check_free_space(
    path: Path,
    *,
    min_free_bytes: int | None,
    model_size_bytes: int | None,
    disk_usage: DiskUsage = shutil.disk_usage,
) -> CheckResult:
    """Free space where the job writes checkpoints.

    Args:
        path: the output folder (or the current folder); its nearest existing parent is measured.
        min_free_bytes: ``--min-free-disk`` in bytes: fail below it. None: ``estimate_free_bytes``, warn only.
        model_size_bytes: the model's weight files in bytes, when known (from the Hub).
        disk_usage: ``shutil.disk_usage`` or a stand-in.
    """
    target = _nearest_existing(path.expanduser().absolute())
    try:
        free = int(disk_usage(str(target)).free)
    except OSError as exc:
        return CheckResult(NAME, "warn", f"free space of {target} unknown: {exc.strerror or exc}",
                           "check the folder exists and is mounted")
    bad: Status
    if min_free_bytes is not None:
        need, source, bad = min_free_bytes, "--min-free-disk", "fail"
    elif model_size_bytes:
        need, source, bad = estimate_free_bytes(model_size_bytes), (
            f"estimate: 7 x the model's {fmt_bytes(model_size_bytes)}"), "warn"
    else:
        need, source, bad = DEFAULT_MIN_FREE_BYTES, "default; model size unknown", "warn"
    seen = f"{fmt_bytes(free)} free at {target}; need {fmt_bytes(need)} ({source})"
    if free >= need:
        return CheckResult(NAME, "pass", seen)
    return CheckResult(NAME, bad, seen, "free some space, write checkpoints elsewhere (--output-dir), "
                       "or keep fewer checkpoints (save_total_limit)")


def check_shm(path: Path = Path("/dev/shm"), *, disk_usage: DiskUsage = shutil.disk_usage) -> CheckResult:
    """``/dev/shm`` of at least 1 GiB: smaller breaks DataLoader workers (Docker's default is 64 MB)."""
    if not path.is_dir():
        return CheckResult(NAME, "n/a", f"no {path} on this system")
    try:
        total = int(disk_usage(str(path)).total)
    except OSError as exc:
        return CheckResult(NAME, "warn", f"size of {path} unknown: {exc.strerror or exc}", None)
    seen = f"{path} is {fmt_bytes(total)}"
    if total >= SHM_MIN_BYTES:
        return CheckResult(NAME, "pass", seen)
    return CheckResult(
        NAME, "warn", f"{seen}, under 1 GiB: DataLoader workers (num_workers > 0) will crash with 'bus error'",
        "docker run --shm-size=8g (or --ipc=host); Kubernetes: mount an emptyDir with medium: Memory at /dev/shm",
    )
