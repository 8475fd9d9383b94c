"""One interface for every destination (a folder, a Hub repo, an S3 bucket): what securing needs, nothing more.

A destination is a :class:`Store`. Securing a checkpoint is two moves, and the second one is the record:

1. **put** (``Store.put_part``): one node's files of one checkpoint go to a staging place of their own at the
   destination (never where the record points), each verified there by size and SHA-256; then the node's
   :class:`PartManifest` (run id, step, node k of n, files, sizes, sha256) is written beside them, and only then.
   Killed at any point, a put leaves the record as it was.
2. **record** (``Store.write_record``): once every node's part of that step of this run is there (``PartsStore.parts``)
   and the format's own completeness rule is met by their union (the caller checks it), the record
   (``DEST/last-checkpoint``) moves once, atomically and conditionally: a folder swap, one Hub commit, one
   conditional S3 write. Two writers never interleave it; a record never moves back to an older step of the same
   run except through ``restore_record``.

The securing plan decides when each move happens (a push is provisional until its step's losses are read); the
stores know nothing of the plan. Every verb is given a ``deadline`` (monotonic seconds) and raises
:class:`DestinationError` (or a subclass) when it cannot finish; :class:`TransientDestinationError` means "the
same call may succeed if tried again" (a reset, a timeout, 408/429/5xx, S3's 503 SlowDown): only the caller
(``guard.secure.securer``) decides about retrying. Progress is one callback, ``(bytes_done, bytes_total)``, the
same for every store.

The stores: ``guard.secure.dest.folder.FolderStore`` (also a :class:`PartsStore`: node parts,
``guard.secure.dest.folder_parts``), ``guard.secure.dest.hub.HubStore`` (also a :class:`PartsStore`:
``guard.secure.dest.hub_parts``) and ``guard.secure.dest.s3.S3Store`` (also a :class:`SharedStore`: node parts,
taints, probe, restore), each opened from a :class:`Destination` by ``guard.secure.dest.open_store``. A new
destination is one module with a class implementing :class:`Store` (and an ``open(destination, **options)``
classmethod) plus one line in ``guard.secure.dest.STORES``.

Everything here is plain data and a ``typing.Protocol``: this module imports the standard library only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

__all__ = [
    "CHECKPOINT_FOLDER",
    "MANIFEST_NAME",
    "Destination",
    "FetchedCheckpoint",
    "FileSum",
    "FinalPushed",
    "PartManifest",
    "PartsStore",
    "Progress",
    "Record",
    "SharedStore",
    "Store",
    "Taint",
    "part_from_json",
    "part_json",
    "pushed_text",
]

#: The record's name at every destination (the folder swapped in, the Hub path, the S3 record's stem).
CHECKPOINT_FOLDER = "last-checkpoint"
#: The manifest the guard writes into a secured checkpoint (step, run id, each file's size and sha256).
MANIFEST_NAME = "guard_manifest.json"

#: ``(bytes_done, bytes_total)``: called as a transfer moves (from the transfer's own thread; must return at once).
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class Destination:
    """Where secured checkpoints go (``--push-to``, parsed by ``guard.secure.dest.parse_destination``).

    Attributes:
        kind: ``"hub"``, ``"folder"`` or ``"s3"`` (a key of ``guard.secure.dest.STORES``).
        repo_id: ``"NS/NAME"`` (hub), else None.
        repo_type: ``"model"`` or ``"dataset"`` (hub), else None.
        path: the folder, absolute (folder), else None.
        url: ``s3://BUCKET/PREFIX`` in its canonical form (s3), else None.
    """

    kind: str
    repo_id: str | None = None
    repo_type: str | None = None
    path: Path | None = None
    url: str | None = None

    def __str__(self) -> str:
        if self.kind == "folder":
            return str(self.path)
        if self.kind == "s3":
            return str(self.url)
        return f"hf://{'datasets/' if self.repo_type == 'dataset' else ''}{self.repo_id}"


@dataclass(frozen=True)
class FileSum:
    """One file as verified: its size in bytes and its SHA-256 (lowercase hex)."""

    size_bytes: int
    sha256: str


@dataclass(frozen=True)
class PartManifest:
    """One node's part of one checkpoint, written at the destination after every one of its files was verified
    there.

    Attributes:
        run_id: the run that saved it (``SecureSettings.run_id``: the same on every node of a job).
        step: the checkpoint's training step (optimizer steps).
        node_rank: this node's index, ``0 <= node_rank < nodes``.
        nodes: how many nodes the job has.
        files: ``{relative path: FileSum}``, paths relative to the checkpoint folder (posix).
        written_at_s: when the manifest was written (epoch seconds, the writer's clock).
        place: where the checkpoint lay relative to the job's output folder (``"checkpoint-20"``, ``"."``), or None.
        source: the job's output folder (relative to its working folder when inside it), or None.
        requires: what the checkpoint's format says the whole checkpoint must hold, as far as this node can tell
            (``{relative path: least size in bytes}``: the files a DCP ``.metadata`` names with ``offset + length``,
            every data-parallel rank's DeepSpeed ZeRO file, every rank's ``rng_state_<r>.pth``); the record is
            written only when the union of every node's ``files`` holds all of every part's ``requires``.
    """

    run_id: str
    step: int
    node_rank: int
    nodes: int
    files: Mapping[str, FileSum]
    written_at_s: float
    place: str | None = None
    source: str | None = None
    requires: Mapping[str, int] = field(default_factory=dict)


def part_json(part: PartManifest) -> dict[str, Any]:
    """``part`` as JSON data, the layout every store writes a node manifest in: its fields, each file as
    ``{"size_bytes": N, "sha256": HEX}``."""
    return {"run_id": part.run_id, "step": part.step, "node_rank": part.node_rank, "nodes": part.nodes,
            "files": {rel: {"size_bytes": fs.size_bytes, "sha256": fs.sha256} for rel, fs in part.files.items()},
            "written_at_s": part.written_at_s, "place": part.place, "source": part.source,
            "requires": dict(part.requires)}


def part_from_json(body: Mapping[str, Any]) -> PartManifest:
    """The :class:`PartManifest` ``part_json`` wrote.

    Raises:
        KeyError, TypeError, ValueError, AttributeError: ``body`` is not such a manifest.
    """
    files = body["files"]
    place, source = body.get("place"), body.get("source")
    return PartManifest(
        run_id=str(body["run_id"]), step=int(body["step"]), node_rank=int(body["node_rank"]), nodes=int(body["nodes"]),
        files={str(rel): FileSum(int(f["size_bytes"]), str(f["sha256"])) for rel, f in files.items()},
        written_at_s=float(body.get("written_at_s") or 0.0), place=str(place) if place is not None else None,
        source=str(source) if source is not None else None,
        requires={str(k): int(v) for k, v in (body.get("requires") or {}).items()})


@dataclass(frozen=True)
class Record:
    """What ``DEST/last-checkpoint`` names: the secured checkpoint.

    Attributes:
        step: its training step; None when the destination does not say (written by something else).
        run_id: the run that secured it; None for a record of an older guard (or none at all).
        files: ``{relative path: FileSum}`` of every file of it (every node's part); empty when not recorded.
        revision: what to fetch: the Hub commit id of the record, the folder's path, the S3 record's ETag.
        nodes: how many nodes' parts it unites (1 on one node).
        place: where it lay relative to the job's output folder (``"checkpoint-20"``; ``"."``: loose files at its top).
        source: the job's output folder it came from, or None.
        restored_from: the step of the record it replaced when a taint moved it back, else None.
    """

    step: int | None
    run_id: str | None
    files: Mapping[str, FileSum]
    revision: str
    nodes: int = 1
    place: str | None = None
    source: str | None = None
    restored_from: int | None = None


@dataclass(frozen=True)
class Taint:
    """A run's first non-finite step (loss, gradient norm or saved weights), recorded at the destination and beside
    the output folder: no checkpoint of ``run_id`` at or after ``first_step`` is ever secured or resumed from."""

    run_id: str
    first_step: int
    witness: str = "loss"  # "loss", "grad_norm", "weights"
    recorded_at_s: float = 0.0


@dataclass(frozen=True)
class FetchedCheckpoint:
    """A verified copy of the record's checkpoint placed where the job looks for it (``path``)."""

    path: Path
    step: int
    revision: str
    files: tuple[str, ...]
    size_bytes: int


@dataclass(frozen=True)
class FinalPushed:
    """The final model's files at the destination's root, verified: ``revision`` as in :class:`Record`."""

    revision: str
    files: Mapping[str, FileSum] = field(default_factory=dict)


class Store(Protocol):
    """A destination, as securing uses it: put, record, read, fetch, the final model, tidy. Each verb is bounded
    by ``deadline`` (monotonic seconds) and raises ``guard.errors.DestinationError``
    (``TransientDestinationError`` when a retry may succeed) or, for the folder and Hub stores, what their transport
    raises (``OSError``, ``huggingface_hub``'s errors, ``guard.secure.hubhttp.Mismatch``), which the securer
    classifies (``guard.secure.hubhttp.classify``).

    ``kind`` is ``"folder"``, ``"hub"`` or ``"s3"``; ``str(store)`` is its canonical ``--push-to`` form.
    ``leaves_staging``: a put killed part way can leave something that only ``tidy`` removes (a folder's staging
    folder); when False, ``tidy`` does nothing and the guard does not make the store to call it (an S3 store's
    client took 0.28 s after the VERDICT), unless ``leaves_parts_staging`` and the job had several nodes: node
    parts that no record takes stay until ``tidy`` (a Hub repo's ``.guard/staging/``).
    """

    kind: ClassVar[str]
    leaves_staging: ClassVar[bool]
    leaves_parts_staging: ClassVar[bool]

    def put_part(self, local_dir: Path, files: Sequence[str], *, run_id: str, step: int, node_rank: int,
                 nodes: int, place: str | None, source: str | None, deadline: float,
                 progress: Progress | None = None, requires: Mapping[str, int] | None = None,
                 check: Callable[[], None] | None = None) -> PartManifest:
        """Upload ``files`` (relative to ``local_dir``) to this step's staging place, verify each one there (size
        and SHA-256), then write and return the node's manifest (with ``requires``, ``PartManifest.requires``: kept
        by a ``SharedStore``). Never touches what the record names. ``check``
        (raises when the local files are no longer that save) runs once during the put, at the point the store
        can still tell a rewrite after it (folder, Hub: before any byte goes; S3: once every file verified)."""
        ...

    def write_record(self, parts: Sequence[PartManifest], *, deadline: float,
                     recorded: Callable[[Record], None] | None = None) -> Record:
        """Make the checkpoint made of ``parts`` (one per node, all of one run and step) the record, atomically and
        only if the current record is not already this step or a newer one of the same run; returns the record
        now in place (which may be another writer's of the same checkpoint: that is success too). ``recorded`` is
        called with the new record the moment it is in place, before any cleanup (also when another node moved it
        to this same step; not when a newer step stays). Staging places of older steps of this run may be removed
        afterwards."""
        ...

    def read_record(self, *, deadline: float) -> Record | None:
        """The current record, or None when nothing is secured there."""
        ...

    def fetch(self, record: Record, into: Path, *, deadline: float) -> FetchedCheckpoint | None:
        """Download the checkpoint ``record`` names into ``into`` (at ``record.place``), every file verified
        against the record; a differing local copy is moved aside, never deleted. A ``record`` known only by its
        ``revision`` (``read_record``'s, passed back) is enough. None when it is no longer there."""
        ...

    def put_final(self, local_dir: Path, files: Sequence[str], *, deadline: float,
                  progress: Progress | None = None) -> FinalPushed:
        """The final model's files at the destination's root, verified (never a mix of two models)."""
        ...

    def tidy(self, *, deadline: float | None = None, nodes: int = 1) -> None:
        """After the run: remove what a put killed part way left where nothing else will (a folder's staging
        folders of dead processes), and, for a job of several ``nodes``, the node parts no record takes (a Hub
        repo's). ``deadline`` (monotonic seconds): no request outlives it; None: the store's own bound. Raises
        ``OSError`` at most."""
        ...


@runtime_checkable
class PartsStore(Store, Protocol):
    """A store that keeps node parts (a folder, S3, a Hub repo): each node of a many-node job puts its own part of a
    checkpoint (``put_part`` with ``nodes`` > 1) and ``write_record`` takes every node's part once all are there."""

    def parts(self, *, run_id: str, step: int, deadline: float) -> list[PartManifest]:
        """The node manifests of ``run_id``'s checkpoint ``step`` present at the destination (any order)."""
        ...

    def part_steps(self, *, run_id: str, deadline: float) -> dict[int, set[int]]:
        """Which nodes have put a part of which step of ``run_id``: ``{step: {node ranks}}``."""
        ...


@runtime_checkable
class SharedStore(PartsStore, Protocol):
    """A store that several nodes and runs share (S3 today): node parts, taints, probing, restoring a record."""

    def probe(self, *, deadline: float) -> None:
        """Preflight: the destination is reachable, exists (or can be created) and this identity can write and
        delete there (a probe object written and removed). Raises with a hint saying what to do."""
        ...

    def restore_record(self, record: Record, *, deadline: float) -> Record:
        """Move the record back to ``record`` (an older one this run secured, still at the destination): after a
        taint reached a checkpoint already recorded."""
        ...

    def write_taint(self, taint: Taint, *, deadline: float) -> None:
        """Record ``taint`` at the destination (kept beside the record; several runs' taints may be there)."""
        ...

    def taints(self, *, deadline: float) -> list[Taint]:
        """Every taint recorded at the destination."""
        ...

    def discard(self, *, run_id: str, step: int | None, deadline: float) -> None:
        """Remove ``run_id``'s staging places (``step`` None: all of them) that no record names: what a killed
        put left behind."""
        ...


def pushed_text(destination: str, revision: str) -> str:
    """The VERDICT's ``pushed=`` value (the contract: ``DEST@REVISION``, the Hub commit id or the folder written):
    ``user/repo@<commit>`` for the Hub, ``s3://BUCKET/PREFIX@<ETag>`` for S3; for a folder destination, whose revision
    is the folder written (``DEST/last-checkpoint`` for a checkpoint, ``DEST`` itself for the final model), that
    folder alone: ``DEST@DEST/last-checkpoint`` would say the destination twice."""
    return revision if Path(revision).is_absolute() else f"{destination}@{revision}"
