"""One atomic file writer for every file the guard, the ``watch`` tool and the in-job API write whole.

Stdlib only: the in-job API (``guard.checkpoint_saved``) uses it inside the job's processes too.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["write_atomic"]


def write_atomic(path: str | os.PathLike[str], data: bytes, *, mode: int | None = None) -> None:
    """Write ``data`` to ``path`` so that a reader sees the old file or the new one, never a half-written one.

    The bytes go to a temporary file in the same folder, which is flushed, fsynced and then renamed over
    ``path`` (``os.replace``: atomic on POSIX within one file system). The folder must exist.

    Args:
        path: the file to write; replaced when it exists (a symlink is replaced, not followed).
        data: the whole new content.
        mode: permission bits of the new file; None gives what ``open()`` would: 0o666 less the umask.

    Raises:
        OSError: the folder cannot be written; the temporary file is removed then.
    """
    target = Path(path)
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
