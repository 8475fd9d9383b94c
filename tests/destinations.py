"""One end-to-end test, every destination: a folder, or an S3 bucket on a real S3 server (moto, tests/s3server.py).

A test parametrized with the ``destination`` fixture of tests/conftest.py
(``@pytest.mark.parametrize("destination", ["folder", "s3"], indirect=True)``) gets a :class:`Destination`:
``push_to`` for ``--push-to``, ``env`` for the guard's process (the standard AWS variables for S3), and readers of
what the destination holds, read back through the destination itself (the folder's files and manifest; the S3
record, then the objects it names), never from the VERDICT.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from s3server import MotoServer
from s3server import env as s3_env

__all__ = ["Destination", "make_destination"]


@dataclass
class Destination:
    """Where a test's guard secures to.

    Attributes:
        kind: ``"folder"`` or ``"s3"``.
        push_to: the ``--push-to`` value.
        env: variables for the guard's process.
        root: the folder (folder), else None.
        store: an ``S3Store`` of the bucket and prefix (s3), else None.
    """

    kind: str
    push_to: str
    env: dict[str, str] = field(default_factory=dict)
    root: Path | None = None
    store: Any = None

    def secured_step(self) -> int | None:
        """The step the destination's record names (-1: none known), None while it names no checkpoint."""
        if self.root is not None:
            from conftest import secured_step

            return secured_step(self.root)
        record = self.store.read_record(deadline=time.monotonic() + 60)
        if record is None:
            return None
        return int(record.step) if record.step is not None else -1

    def checkpoint_files(self) -> set[str]:
        """The files of the secured checkpoint, relative to it (the guard's own manifest left out)."""
        if self.root is not None:
            folder = self.root / "last-checkpoint"
            return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()} - {"guard_manifest.json"}
        record = self.store.read_record(deadline=time.monotonic() + 60)
        return set(record.files) if record is not None else set()

    def final_files(self) -> set[str]:
        """The files at the destination's top (a final model's), the guard's own bookkeeping left out."""
        if self.root is not None:
            return {p.name for p in self.root.iterdir() if p.is_file() and not p.name.startswith(".")}
        keys = self.store._list("", time.monotonic() + 60)
        return {key for key in keys if "/" not in key and key != "last-checkpoint.json"}


def make_destination(kind: str, tmp_path: Path, moto: MotoServer | None) -> Destination:
    """A fresh destination of ``kind`` (``"folder"``: ``tmp_path/dest``; ``"s3"``: a new bucket of ``moto``)."""
    if kind == "folder":
        return Destination("folder", str(tmp_path / "dest"), root=tmp_path / "dest")
    from guard.secure.dest.s3 import S3Store

    assert moto is not None
    bucket = moto.bucket()
    return Destination("s3", f"s3://{bucket}/runs/e2e", env=s3_env(moto.url),
                       store=S3Store(bucket, "runs/e2e", client=moto.client()))
