"""One atomic file writer for every file the guard, the ``watch`` tool and the in-job API write whole.

Stdlib only: the in-job API (``guard.checkpoint_saved``) uses it inside the job's processes too.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

__all__ = ["write_atomic"]


def write_atomic(path: str | os.PathLike[str], data: bytes, *, mode: int | None = None) -> None:
    """Write ``data`` to ``path`` so that a reader sees the old file or the new one, never a half-written one.

    The bytes go to a temporary file in the same folder, which is flushed, fsynced and then renamed over
    ``path`` (``os.replace``: atomic on POSIX within one file system). The folder must exist.

    Args:
        path: the file to write; replaced when it exists (a symlink is replaced, not followed). A path that is not
            a regular file (``/dev/null``, a FIFO with a reader) is written in place instead: replacing it would
            put a regular file where the device was (as root, for every process on the machine).
        data: the whole new content.
        mode: permission bits of the new file; None gives what ``open()`` would: 0o666 less the umask.

    Raises:
        OSError: the folder cannot be written (the temporary file is removed then); a FIFO without a reader
            (``ENXIO``) or one that is full.
    """
    target = Path(path)
    try:
        kind = os.lstat(target).st_mode
    except OSError:
        kind = stat.S_IFREG  # not there yet (or not readable: mkstemp below says why)
    if not (stat.S_ISREG(kind) or stat.S_ISLNK(kind)):
        _write_in_place(target, data)  # /dev/null, a FIFO: a rename would put a regular file in its place
        return
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode if mode is not None else 0o666 & ~_umask())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    """The process's umask (read by setting it and putting it back: there is no getter before Python 3.13)."""
    current = os.umask(0)
    os.umask(current)
    return current


def _write_in_place(target: Path, data: bytes) -> None:
    """Write ``data`` to a file that is not a regular one, without blocking: ``O_NONBLOCK`` (a FIFO with no reader
    fails with ``ENXIO`` instead of waiting for one). Raises ``OSError``."""
    fd = os.open(target, os.O_WRONLY | os.O_NONBLOCK)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
