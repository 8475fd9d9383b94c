"""Node parts at a folder destination: each node of a many-node job puts its own part of a checkpoint, and the
record (``DEST/last-checkpoint``) is assembled from every node's part once all are there (``guard.secure.nodes``).

Layout, beside the record (the destination folder is one the nodes share: NFS, Lustre, a mounted bucket)::

    DEST/.guard/staging/<run_id>/step-<N>/node-<k>/...      node k's files of step N, each verified by SHA-256
    DEST/.guard/staging/<run_id>/step-<N>/node-<k>.json     its manifest, written last (atomically): the part counts
    DEST/.guard/record.lock                                 held while the record moves (``fcntl.flock``)

The record is made of hard links to the parts' files (a copy where the file system has no links) in a fresh
staging folder, its ``guard_manifest.json`` naming the step, the run, the node count and every file's size and
SHA-256, then swapped in as a one-node record is. Two nodes that find the parts whole at once both get the record:
the second one, under the lock, finds it already naming that step of the run and leaves it. Older steps' parts of
the run go once a record names a newer step.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from guard.secure.dest import local
from guard.secure.dest.base import FileSum, PartManifest, part_from_json, part_json
from guard.secure.hubhttp import Mismatch

__all__ = ["PARTS_FOLDER", "assemble", "node_part_steps", "node_parts", "put_node_part", "record_lock",
           "remove_older"]

#: The node parts' place, relative to the destination folder.
PARTS_FOLDER = Path(".guard") / "staging"
_NODE_MANIFEST = re.compile(r"node-(\d+)\.json")
_STEP = re.compile(r"step-(\d+)")


def _step_dir(root: Path, run_id: str, step: int) -> Path:
    return root / PARTS_FOLDER / run_id / f"step-{step}"


def put_node_part(root: Path, local_dir: Path, files: Sequence[str], *, run_id: str, step: int, node_rank: int,
                  nodes: int, place: str | None, source: str | None, requires: Mapping[str, int] | None,
                  check: Callable[[], None] | None, destination: str) -> PartManifest:
    """Copy node ``node_rank``'s ``files`` (relative to ``local_dir``) of ``step`` into the run's part place, verify
    each by size and SHA-256, then write the node's manifest (module docstring). An earlier put of the same part
    (a retry) is replaced.

    Raises:
        Mismatch: a file changed while it was copied, or the copy does not hash as its source.
        PushFailedError: the copied files are not whole by format (this node's part of it).
        OSError: a disk error.
    """
    rels = list(files)
    step_dir = _step_dir(root, run_id, step)
    target = step_dir / f"node-{node_rank}"
    manifest_path = step_dir / f"node-{node_rank}.json"
    with contextlib.suppress(FileNotFoundError):
        manifest_path.unlink()
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    before = local.signatures(local_dir, rels)
    if check is not None:
        check()
    sums = {rel: local.copy_and_hash(local_dir / rel, target / rel) for rel in rels}
    changed = local.changed_since(local_dir, rels, before)
    if changed:
        raise Mismatch([f"{rel} changed while it was copied" for rel in changed])
    local.refuse_torn(f"checkpoint step {step} (node {node_rank}'s part)", target, rels, "copied", destination,
                      parts=True)
    for rel in rels:
        if local.hash_file(target / rel) != sums[rel]:
            raise Mismatch([f"{rel}: the copy at {target} does not hash as its source"])
    for dirpath, _, _ in sorted(os.walk(target), key=lambda w: -len(w[0])):
        local.fsync_dir(Path(dirpath))
    part = PartManifest(run_id=run_id, step=step, node_rank=node_rank, nodes=nodes,
                        files={rel: FileSum(*sums[rel]) for rel in rels}, written_at_s=time.time(), place=place,
                        source=source, requires=dict(requires or {}))
    tmp = step_dir / f".node-{node_rank}.json.{os.getpid()}.tmp"
    with open(tmp, "w") as out:
        json.dump(part_json(part), out)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, manifest_path)
    local.fsync_dir(step_dir)
    return part


def node_parts(root: Path, *, run_id: str, step: int) -> list[PartManifest]:
    """The node manifests of ``run_id``'s step ``step`` at the destination (sorted by node; unreadable ones are
    skipped)."""
    step_dir = _step_dir(root, run_id, step)
    try:
        names = sorted(n for n in os.listdir(step_dir) if _NODE_MANIFEST.fullmatch(n))
    except OSError:
        return []
    found = []
    for name in names:
        try:
            body = json.loads((step_dir / name).read_text())
        except (OSError, ValueError):
            continue
        try:
            found.append(part_from_json(body))
        except (KeyError, TypeError, ValueError, AttributeError):
            continue  # not a node manifest: skipped
    return sorted(found, key=lambda p: p.node_rank)


def node_part_steps(root: Path, *, run_id: str) -> dict[int, set[int]]:
    """``{step: {node ranks whose manifest is there}}`` of ``run_id`` at the destination."""
    base = root / PARTS_FOLDER / run_id
    found: dict[int, set[int]] = {}
    with contextlib.suppress(OSError):
        for step_name in os.listdir(base):
            match = _STEP.fullmatch(step_name)
            if match is None:
                continue
            with contextlib.suppress(OSError):
                nodes = {int(m[1]) for n in os.listdir(base / step_name) if (m := _NODE_MANIFEST.fullmatch(n))}
                if nodes:
                    found[int(match[1])] = nodes
    return found


def assemble(root: Path, parts: Sequence[PartManifest], staging: Path) -> dict[str, FileSum]:
    """Fill ``staging`` with the union of ``parts``' files (hard links to the verified copies, else copies), each
    checked by size against its part's manifest; returns ``{rel: FileSum}``. A file in two parts (replicated) is
    taken once.

    Raises:
        Mismatch: a part's file is gone or not its manifest's size.
    """
    files: dict[str, FileSum] = {}
    for part in parts:
        where = _step_dir(root, part.run_id, part.step) / f"node-{part.node_rank}"
        for rel, summed in part.files.items():
            if rel in files:
                continue
            src, dst = where / rel, staging / rel
            try:
                if src.stat().st_size != summed.size_bytes:
                    raise Mismatch([f"{rel} of node {part.node_rank}'s part is not {summed.size_bytes} bytes"])
                dst.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(src, dst)
                except OSError:
                    shutil.copy2(src, dst)
            except FileNotFoundError as exc:
                raise Mismatch([f"{rel} of node {part.node_rank}'s part is gone"]) from exc
            files[rel] = summed
    return files


@contextlib.contextmanager
def record_lock(root: Path) -> Iterator[None]:
    """Hold ``DEST/.guard/record.lock`` (an exclusive ``fcntl.flock``) while the record moves."""
    path = root / ".guard" / "record.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def remove_older(root: Path, *, run_id: str, step: int) -> None:
    """Remove ``run_id``'s parts of steps before ``step`` (a record names ``step`` now). Never raises."""
    base = root / PARTS_FOLDER / run_id
    with contextlib.suppress(OSError):
        for name in os.listdir(base):
            match = _STEP.fullmatch(name)
            if match is not None and int(match[1]) < step:
                shutil.rmtree(base / name, ignore_errors=True)
