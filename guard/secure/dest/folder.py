"""A folder as a destination (``--push-to /abs/path``, ``./rel``, ``file://...``): a local disk, NFS, a mounted bucket.

Layout (kept by every version of the guard; resume reads it back)::

    DEST/last-checkpoint/                         the record: the secured checkpoint, with guard_manifest.json
                                                  (step, source, output_dir, place, each file's size and sha256)
    DEST/.last-checkpoint.tmp-<pid>-XXXX/         a put's staging copy, swapped in by the record
    DEST/.last-checkpoint.previous-<pid>/         the previous copy while the fallback swap runs
    DEST/.last-checkpoint.kept/                   the record before the last one (``restore_record`` swaps it back)
    DEST/.guard-final-journal.json                the final push's renames, while they run
    DEST/.guard/staging/<run_id>/step-<N>/node-<k>/  many nodes: each node's part (``folder_parts``)
    DEST/<final model files>                      on PASS

The atomic steps (the swap, the final push's journaled renames) and the recovery from a push killed between them
are ``guard.secure.dest.folder_swap``'s; node parts are ``guard.secure.dest.folder_parts``'s.

- **put** (``put_part``): a copy into the staging folder beside the target (unchanged files hard-linked from the
  previous secured copy when its manifest vouches for them), each file hashed while copied, the copy checked by
  format, the manifest written, everything fsynced, then every file verified again against the hashes.
- **record** (``write_record``): the staging folder swapped in atomically as ``last-checkpoint``
  (``folder_swap.swap_in``: ``renameat2(RENAME_EXCHANGE)`` on Linux, else two renames); killed at any point, the
  next run finds the previous copy or the new one, never neither (``folder_swap.recover``).
- **restore** (``restore_record``): after a taint reached the record, the copy the last swap replaced, kept aside
  until the record can no longer turn suspect (``release_kept``), the next record or the run's end, is swapped back
  (``folder_swap.swap_back``): nothing is copied again.
- **fetch**: a verified copy of ``last-checkpoint`` against its manifest, placed where the job looks for it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from guard.core.durations import format_size
from guard.errors import DestinationError
from guard.secure.dest import folder_parts, folder_swap, local
from guard.secure.dest.base import (
    CHECKPOINT_FOLDER,
    MANIFEST_NAME,
    Destination,
    FetchedCheckpoint,
    FileSum,
    FinalPushed,
    PartManifest,
    Progress,
    Record,
)
from guard.secure.hubhttp import Mismatch

__all__ = ["FolderCopy", "FolderPart", "FolderStore"]

logger = logging.getLogger("guard.secure.folder")



@dataclass(frozen=True)
class FolderCopy:
    """What the last push to a folder destination wrote: bytes copied, and unchanged files (and their bytes) taken
    from the previous secured copy by a hard link instead."""

    copied_bytes: int
    reused_bytes: int
    reused_files: int


@dataclass(frozen=True)
class FolderPart(PartManifest):
    """A put at a folder destination: ``staging`` is the verified copy (with its manifest) that ``write_record``
    swaps in."""

    staging: Path | None = None


class FolderStore:
    """``DEST`` (module docstring). Verbs raise ``OSError`` (a disk error), ``Mismatch`` (a copy that does not hash
    as its source: retried once by the securer), ``PushFailedError`` (a torn copy) or ``DestinationError``.

    Args:
        root: the destination folder (absolute); created on the first put.
        log: where to log (default ``guard.secure.folder``).
    """

    kind: ClassVar[str] = "folder"
    leaves_staging: ClassVar[bool] = True  # a killed push's staging folder (``tidy``)
    leaves_parts_staging: ClassVar[bool] = False  # node parts: tidied with the rest (``leaves_staging``)

    def __init__(self, root: Path, *, log: logging.Logger | None = None) -> None:
        self.root = root
        self._log = log or logger
        #: What the last ``put_part`` wrote (None before the first).
        self.last_copy: FolderCopy | None = None

    @classmethod
    def open(cls, destination: Destination, **options: Any) -> FolderStore:
        """The store of a ``Destination`` of kind ``"folder"`` (``options``: ``log``; others are ignored)."""
        assert destination.path is not None
        return cls(destination.path, log=options.get("log"))

    def __str__(self) -> str:
        return str(self.root)

    # -- put and record ---------------------------------------------------------------------------------------

    def put_part(self, local_dir: Path, files: Sequence[str], *, run_id: str, step: int, node_rank: int,
                 nodes: int, place: str | None, source: str | None, deadline: float,
                 progress: Progress | None = None, requires: Mapping[str, int] | None = None,
                 check: Callable[[], None] | None = None) -> PartManifest:
        """Copy ``files`` into a fresh staging folder beside ``last-checkpoint`` and verify them there (module
        docstring); ``check`` runs once the files' first signatures are taken, before any byte is copied (a
        rewrite after it is seen by comparing the signatures after the copy). With ``nodes`` > 1 it is one node's
        part of a many-node checkpoint, kept under the run's part place with its manifest (``folder_parts``).

        Raises:
            Mismatch: a file changed while it was copied, or the copy does not hash as its source.
            PushFailedError: the copied files are not whole by format.
            OSError: a disk error (no space, permissions).
        """
        folder, rels = Path(local_dir), list(files)
        self.root.mkdir(parents=True, exist_ok=True)
        if nodes > 1:  # one node's part of a many-node checkpoint (guard.secure.dest.folder_parts)
            return folder_parts.put_node_part(self.root, folder, rels, run_id=run_id, step=step, node_rank=node_rank,
                                              nodes=nodes, place=place, source=source, requires=requires,
                                              check=check, destination=str(self))
        target = self.root / CHECKPOINT_FOLDER
        folder_swap.remove_stale_staging(self.root, self._log)
        staging = local.staging_dir(f"{folder_swap.STAGING_PREFIX}{os.getpid()}-", self.root)
        kept = False
        try:
            before = local.signatures(folder, rels)
            if check is not None:
                check()
            sums, linked = self._copy(folder, rels, target, staging)
            changed = local.changed_since(folder, rels, before)
            if changed:  # a job that saves in place (torch.save over ckpt.pt) wrote it again meanwhile: torn copy
                raise Mismatch([f"{rel} changed while it was copied" for rel in changed])
            # the copy that would become the secured one, checked by format before anything is swapped
            local.refuse_torn(f"checkpoint step {step}", staging, rels, "copied", str(self))
            manifest = {"step": step, **local.placed_source(source, place),
                        "files": {rel: {"size": size, "sha256": sha} for rel, (size, sha) in sums.items()}}
            with open(staging / MANIFEST_NAME, "w") as out:
                json.dump(manifest, out, indent=1)
                out.flush()
                os.fsync(out.fileno())
            for dirpath, _, _ in sorted(os.walk(staging), key=lambda w: -len(w[0])):
                local.fsync_dir(Path(dirpath))
            self._verify_staged(folder, staging, rels, sums, linked)
            kept = True
        finally:
            if not kept:
                shutil.rmtree(staging, ignore_errors=True)
        return FolderPart(run_id=run_id, step=step, node_rank=node_rank, nodes=nodes,
                          files={rel: FileSum(*sums[rel]) for rel in rels}, written_at_s=time.time(), place=place,
                          source=source, staging=staging)

    def _copy(self, folder: Path, files: list[str], target: Path,
              staging: Path) -> tuple[dict[str, tuple[int, str]], list[str]]:
        """Each file into ``staging``: hard-linked from the previous secured copy when its manifest vouches for it
        (``_reuse_unchanged``), else copied and hashed. Returns ``({rel: (size, sha256)}, linked files)``."""
        previous = _manifest_files(target)
        sums: dict[str, tuple[int, str]] = {}
        linked: list[str] = []
        for rel in files:
            reused = _reuse_unchanged(folder / rel, target / rel, staging / rel, previous.get(rel))
            if reused is not None:
                sums[rel] = reused
                linked.append(rel)
            else:
                sums[rel] = local.copy_and_hash(folder / rel, staging / rel)
        reused_bytes = sum(sums[rel][0] for rel in linked)
        self.last_copy = FolderCopy(copied_bytes=sum(size for size, _ in sums.values()) - reused_bytes,
                                    reused_bytes=reused_bytes, reused_files=len(linked))
        if linked:
            self._log.info("%d unchanged files (%s) linked from the previous %s, %d copied (%s)",
                           len(linked), format_size(reused_bytes), CHECKPOINT_FOLDER, len(files) - len(linked),
                           format_size(self.last_copy.copied_bytes))
        return sums, linked

    def _verify_staged(self, folder: Path, staging: Path, files: list[str], sums: dict[str, tuple[int, str]],
                       linked: list[str]) -> None:
        """Verified before the swap: a push killed at any point leaves the previous last-checkpoint in place."""
        try:
            _verify_folder(staging, {rel: sums[rel] for rel in files}, exclude={MANIFEST_NAME})
        except Mismatch:
            if not linked:
                raise
            # The previous secured copy no longer matched its manifest (changed on the destination's disk): the
            # files taken from it are copied from the checkpoint instead, then everything is verified again.
            self._log.warning("the previous %s does not match its manifest: copying its %d files again",
                              CHECKPOINT_FOLDER, len(linked))
            for rel in linked:
                (staging / rel).unlink()
                if local.copy_and_hash(folder / rel, staging / rel) != sums[rel]:
                    raise Mismatch([f"{rel} changed while it was copied"]) from None
            self.last_copy = FolderCopy(copied_bytes=sum(size for size, _ in sums.values()), reused_bytes=0,
                                        reused_files=0)
            _verify_folder(staging, {rel: sums[rel] for rel in files}, exclude={MANIFEST_NAME})

    def write_record(self, parts: Sequence[PartManifest], *, deadline: float,
                     recorded: Callable[[Record], None] | None = None) -> Record:
        """Swap the staged copy of ``parts`` (one ``FolderPart``) in as ``last-checkpoint``; ``recorded`` is
        called once it is in place, before the previous copy is removed. The staging folder is gone afterwards
        either way.

        Raises:
            DestinationError: not one ``FolderPart`` of this store.
            OSError: the swap failed (the previous copy stays the record).
        """
        part = parts[0] if len(parts) == 1 else None
        if not isinstance(part, FolderPart) or part.staging is None:
            if parts and all(p.nodes > 1 for p in parts):
                return self._record_node_parts(parts, recorded)
            raise DestinationError(f"a folder destination records one node's staged part, not {len(parts)} parts",
                                   destination=str(self))
        target = self.root / CHECKPOINT_FOLDER
        try:
            old = folder_swap.swap_in(part.staging, target)
            local.fsync_dir(self.root)
            record = Record(step=part.step, run_id=part.run_id, files=part.files, revision=str(target),
                            place=part.place, source=part.source)
            if recorded is not None:
                recorded(record)
            if old is not None:  # kept aside: a taint reaching this record swaps it back (restore_record)
                folder_swap.keep_aside(old, self.root)
        finally:
            shutil.rmtree(part.staging, ignore_errors=True)
        return record

    def restore_record(self, record: Record, *, deadline: float) -> Record:
        """Swap back the record before the last one (kept aside by ``write_record``) when it is ``record.step``
        (``folder_swap.swap_back``); returns it as ``read_record`` reads it.

        Raises:
            DestinationError: no copy of that step is kept here (the caller pushes it again).
            OSError: the swap failed (the record stays as it was).
        """
        if record.step is None:
            raise DestinationError("a record without a step cannot be restored", destination=str(self))
        try:
            target = folder_swap.swap_back(self.root, record.step, self._log)
        except FileNotFoundError as exc:
            raise DestinationError(str(exc), destination=str(self)) from None
        files = _manifest_files(target)
        return Record(step=record.step, run_id=record.run_id, revision=str(target), restored_from=record.restored_from,
                      files={rel: FileSum(*sum_) for rel, sum_ in files.items()})

    def parts(self, *, run_id: str, step: int, deadline: float) -> list[PartManifest]:
        """The node manifests of ``run_id``'s checkpoint ``step`` here (``folder_parts``)."""
        return folder_parts.node_parts(self.root, run_id=run_id, step=step)

    def part_steps(self, *, run_id: str, deadline: float) -> dict[int, set[int]]:
        """Which nodes have put a part of which step of ``run_id`` here: ``{step: {node ranks}}``."""
        return folder_parts.node_part_steps(self.root, run_id=run_id)

    def _record_node_parts(self, parts: Sequence[PartManifest],
                           recorded: Callable[[Record], None] | None) -> Record:
        """The record made of every node's part (``folder_parts``: linked into a staging folder with its manifest,
        swapped in under the record lock); a record already naming this step of the run (another node's) stands."""
        first = parts[0]
        target = self.root / CHECKPOINT_FOLDER
        staging = local.staging_dir(f"{folder_swap.STAGING_PREFIX}{os.getpid()}-", self.root)
        try:
            files = folder_parts.assemble(self.root, parts, staging)
            manifest = {"step": first.step, "run_id": first.run_id, "nodes": first.nodes,
                        **local.placed_source(first.source, first.place),
                        "files": {rel: {"size": fs.size_bytes, "sha256": fs.sha256} for rel, fs in files.items()}}
            with open(staging / MANIFEST_NAME, "w") as out:
                json.dump(manifest, out, indent=1)
                out.flush()
                os.fsync(out.fileno())
            local.fsync_dir(staging)
            record = Record(step=first.step, run_id=first.run_id, files=files, revision=str(target),
                            nodes=first.nodes, place=first.place, source=first.source)
            with folder_parts.record_lock(self.root):
                current = local.read_manifest(target) if target.is_dir() else {}
                if current.get("run_id") == first.run_id and isinstance(current.get("step"), int) \
                        and current["step"] >= first.step:
                    self._log.info("the record at %s already names step %s of this run", self, current["step"])
                    if recorded is not None and current["step"] == first.step:
                        recorded(record)
                    return record if current["step"] == first.step else Record(
                        step=current["step"], run_id=first.run_id, files={}, revision=str(target), nodes=first.nodes)
                old = folder_swap.swap_in(staging, target)
                local.fsync_dir(self.root)
                if recorded is not None:
                    recorded(record)
            if old is not None:
                folder_swap.keep_aside(old, self.root)
            folder_parts.remove_older(self.root, run_id=first.run_id, step=first.step)
            return record
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def read_record(self, *, deadline: float) -> Record | None:
        """``last-checkpoint`` (after ``folder_swap.recover``) with its manifest's step (else its
        ``trainer_state.json``'s) and placement; None when there is none. ``files`` stays empty (fetch reads the
        manifest)."""
        source = self._secured()
        if source is None:
            return None
        manifest = local.read_manifest(source)
        step = manifest.get("step")
        output_dir, place = local.placed(manifest)
        return Record(step=step if isinstance(step, int) else local.step_from_trainer_state(source), run_id=None,
                      files={}, revision=str(source), place=place, source=output_dir)

    def _secured(self) -> Path | None:
        """``last-checkpoint`` once what a killed push left is recovered (``folder_swap.recover``), or None when
        absent."""
        if self.root.is_dir():
            folder_swap.recover(self.root, self._log)
        source = self.root / CHECKPOINT_FOLDER
        return source if source.is_dir() else None

    # -- fetch, final, tidy -----------------------------------------------------------------------------------

    def fetch(self, record: Record, into: Path, *, deadline: float) -> FetchedCheckpoint | None:
        """Copy ``last-checkpoint`` (whatever ``record`` says: the folder holds one) into ``into``, every file
        checked against the manifest, and place it (``local.place_fetched``); None when there is none.

        Raises:
            Mismatch: a file is missing or differs from the manifest.
            HubError: the step cannot be told.
            OSError: a disk error.
        """
        source = self._secured()
        if source is None:
            return None
        manifest = local.read_manifest(source)
        recorded = manifest.get("files") or {}
        files = sorted(set(recorded) | {rel for rel in local.list_files(source) if rel != MANIFEST_NAME})
        staging = Path(tempfile.mkdtemp(prefix=".guard-fetch-", dir=into))
        try:
            fetched, problems = staging / CHECKPOINT_FOLDER, []
            for rel in files:
                if not (source / rel).is_file():
                    problems.append(f"{rel} missing")
                    continue
                size, sha = local.copy_and_hash(source / rel, fetched / rel)
                want = recorded.get(rel)
                if want is not None and (want.get("size"), want.get("sha256")) != (size, sha):
                    problems.append(f"{rel} differs from the manifest")
                elif want is None and local.hash_file(fetched / rel) != (size, sha):
                    problems.append(f"{rel} differs from its copy")
            if problems:
                raise Mismatch(problems)
            step = local.step_from_trainer_state(fetched)
            if step is None and isinstance(manifest.get("step"), int):
                step = manifest["step"]
            size_total = sum((fetched / rel).stat().st_size for rel in files)
            return local.place_fetched(fetched, into, step, str(source), files, size_total,
                                       local.placed(manifest)[1], str(self), self._log)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def put_final(self, local_dir: Path, files: Sequence[str], *, deadline: float,
                  progress: Progress | None = None) -> FinalPushed:
        """The final model's files at ``DEST/``: every changed file is first copied beside its place
        (``.NAME.guard-tmp``) and verified; then a journal of the renames is written and fsynced, the renames done,
        the journal removed. Killed before the journal, nothing changed; after it, the next run finishes the renames
        (``folder_swap.recover``): never a mixed model. Returns ``FinalPushed(revision=DEST)``.

        Raises:
            Mismatch: a file changed while it was copied, or does not verify in place.
            OSError: a disk error.
        """
        root, folder = self.root, Path(local_dir)
        root.mkdir(parents=True, exist_ok=True)
        folder_swap.recover(root, self._log)
        sums: dict[str, tuple[int, str]] = {}
        staged: dict[str, Path] = {}
        try:
            for rel in files:
                src, dst = folder / rel, root / rel
                sums[rel] = local.hash_file(src)
                if dst.is_file() and local.hash_file(dst) == sums[rel]:
                    continue  # unchanged
                tmp = dst.with_name(f".{dst.name}.guard-tmp")
                staged[rel] = tmp
                if local.copy_and_hash(src, tmp) != sums[rel]:
                    raise Mismatch([f"{rel} changed while it was copied"])
            for tmp in staged.values():  # each copy hashes as its source, which was checked whole by format
                local.fsync_dir(tmp.parent)
            if staged:
                folder_swap.journaled_renames(root, staged)
                staged = {}
        finally:
            for tmp in staged.values():
                with contextlib.suppress(OSError):
                    tmp.unlink()
        _verify_folder(root, sums, exclude=None)
        return FinalPushed(revision=str(root), files={rel: FileSum(*sum_) for rel, sum_ in sums.items()})

    def release_kept(self) -> None:
        """The record can no longer turn suspect: the one before it, kept aside, goes (``folder_swap.drop_kept``)."""
        folder_swap.drop_kept(self.root)

    def tidy(self, *, deadline: float | None = None, nodes: int = 1) -> None:
        """What a push killed part way left here (a staging folder, a previous copy aside:
        ``folder_swap.remove_stale_staging``), and the record before the last one (``folder_swap.drop_kept``: the
        run is over, no taint can reach its record any more); a push whose process still lives keeps its own.
        Local files: ``deadline`` is not needed. Raises ``OSError``."""
        if self.root.is_dir():
            folder_swap.remove_stale_staging(self.root, self._log)
            folder_swap.drop_kept(self.root)



def _verify_folder(target: Path, expected: dict[str, tuple[int, str]], exclude: set[str] | None) -> None:
    """Raise ``Mismatch`` unless every file of ``expected`` hashes as recorded (and, with ``exclude``, the folder
    holds nothing else but those names)."""
    problems = [f"{rel} differs" for rel, want in expected.items()
                if not (target / rel).is_file() or local.hash_file(target / rel) != want]
    if exclude is not None:  # the checkpoint folder must hold exactly these files
        allowed = set(expected) | exclude
        problems += [f"{rel} unexpected" for rel in local.list_files(target) if rel not in allowed]
    if problems:
        raise Mismatch(problems)


def _manifest_files(secured: Path) -> dict[str, tuple[int, str]]:
    """``{rel: (size, sha256)}`` from the manifest of a secured ``last-checkpoint`` folder; empty when it has none
    (or it cannot be read)."""
    try:
        recorded = local.read_manifest(secured)["files"]
        return {str(rel): (int(entry["size"]), str(entry["sha256"])) for rel, entry in recorded.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def _reuse_unchanged(src: Path, previous: Path, dst: Path, recorded: tuple[int, str] | None) -> tuple[int, str] | None:
    """Hard-link ``previous`` (the same file in the previous secured copy) to ``dst`` when ``src`` has the size and
    sha256 its manifest ``recorded``; returns ``(size, sha256)`` then, else None (the caller copies). Reading
    ``src`` once to hash it replaces writing it again; the link is verified with every other file afterwards.
    None too where the file system refuses hard links."""
    if recorded is None:
        return None
    try:
        if src.stat().st_size != recorded[0] or previous.stat().st_size != recorded[0]:
            return None
    except OSError:
        return None
    found = local.hash_file(src)
    if found != recorded:
        return None
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.link(previous, dst, follow_symlinks=False)
    except OSError:  # EPERM, EXDEV, EMLINK, ENOTSUP: no hard links here
        return None
    return found
