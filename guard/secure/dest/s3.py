"""An S3 bucket (or an S3-compatible store: MinIO, Cloudflare R2, Ceph, GCS interoperability) as a destination:
``--push-to s3://BUCKET/PREFIX``.

Layout under ``PREFIX/`` (the folder's, ``guard.secure.dest.base``; S3 has no rename, so the record is one object
that names the checkpoint's objects where they were put, and moving the record is one conditional write)::

    PREFIX/last-checkpoint.json                          the record: run id, step, nodes, place, source, and each
                                                         file's size, SHA-256 and key (relative to PREFIX)
    PREFIX/.guard/staging/<run_id>/step-<N>/node-<k>/... a put's files, each verified (size, SHA-256)
    PREFIX/.guard/staging/<run_id>/step-<N>/node-<k>.json   the node's PartManifest, written after its files
    PREFIX/.guard/previous/last-checkpoint.json         the record before the last move
    PREFIX/.guard/taints/<run_id>.json                   a run's first non-finite step
    PREFIX/.guard/final.json                             the final model's files (they lie at PREFIX/ itself)
    PREFIX/<final model files>                           on PASS

The record is written last, only after every file it names was checked at the destination (a HEAD per file: size
and S3's stored SHA-256 checksum), with ``If-Match: <ETag of the record read>`` (or ``If-None-Match: *`` when there
is none): of two writers, the second gets ``412 Precondition Failed``, reads again and decides again (AWS S3 user
guide, "Conditional writes"). A record is replaced only by a newer step of the same run, or by another run's
checkpoint; ``restore_record`` moves it back after a taint. Staging objects stay while a record (current or
previous) names them; ``discard`` removes the rest, with any unfinished multipart upload.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path, PurePosixPath
from typing import Any, ClassVar

from guard.errors import DestinationError, UsageError
from guard.secure.dest import local
from guard.secure.dest.base import (
    CHECKPOINT_FOLDER,
    Destination,
    FetchedCheckpoint,
    FileSum,
    FinalPushed,
    PartManifest,
    Progress,
    Record,
    Taint,
    part_from_json,
    part_json,
)
from guard.secure.dest.s3io import REQUEST_ATTEMPTS, S3Io, WriteConflict, make_client, s3_error

__all__ = ["S3PartManifest", "S3Record", "S3Store", "parse_s3_url"]

logger = logging.getLogger("guard.secure.s3")

RECORD_NAME = f"{CHECKPOINT_FOLDER}.json"
RECORD_FORMAT = "jobguard-s3-record/1"
#: How long one request may go without progress before it gives up (seconds).
REQUEST_TIMEOUT_S = 60.0
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_NODE_MANIFEST = re.compile(r"node-(\d+)\.json")
_STEP_NODE_MANIFEST = re.compile(r"step-(\d+)/node-(\d+)\.json")


def parse_s3_url(text: str) -> tuple[str, str]:
    """``s3://BUCKET/PREFIX`` -> ``(bucket, prefix)`` (the prefix without slashes at its ends; may be empty).

    Raises:
        UsageError: (``option="--push-to"``) not an ``s3://`` form, a bucket name S3 refuses, a prefix with ``..``.
    """
    raw = text.strip()
    if not raw.startswith("s3://"):
        raise UsageError(f"--push-to {text!r} is not an s3://BUCKET/PREFIX destination", option="--push-to")
    bucket, _, prefix = raw[len("s3://"):].partition("/")
    prefix = prefix.strip("/")
    if not _BUCKET.fullmatch(bucket) or ".." in bucket:
        raise UsageError(f"--push-to {text!r}: {bucket!r} is not a valid bucket name (3-63 lowercase letters, "
                         "digits, dots and hyphens)", option="--push-to", hint="e.g. --push-to s3://my-bucket/run1")
    if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
        raise UsageError(f"--push-to {text!r}: the prefix may not hold empty, '.' or '..' parts", option="--push-to",
                         hint="e.g. --push-to s3://my-bucket/runs/run1")
    return bucket, prefix


@dataclass(frozen=True)
class S3PartManifest(PartManifest):
    """A :class:`PartManifest` with S3's stored checksum of each file (``{rel: checksum}``, composite for multipart
    uploads), which the record's verification compares with each object's HEAD."""

    checksums: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class S3Record(Record):
    """A :class:`Record` with the key of each file, relative to the prefix."""

    keys: Mapping[str, str] = field(default_factory=dict)


def _check_rel(rel: str) -> str:
    path = PurePosixPath(rel)
    if path.is_absolute() or not rel or any(part in ("..", ".", "") for part in rel.split("/")):
        raise DestinationError(f"{rel!r} is not a relative file path inside the checkpoint")
    return str(path)


class S3Store:
    """``s3://BUCKET/PREFIX`` (module docstring). Every verb takes a ``deadline`` (monotonic seconds) and raises
    ``DestinationError`` (``TransientDestinationError`` when a retry may succeed).

    Args:
        bucket: the bucket name.
        prefix: the key prefix (no slashes at its ends; ``""`` for the bucket's top).
        client: a botocore S3 client; default: one from the standard AWS configuration (``s3io.make_client``).
        max_concurrency: requests in flight at once, default 8.
        part_size_bytes: multipart part size, default 16 MiB; files above ``multipart_threshold_bytes`` (default
            64 MiB) go up in parts.
        request_timeout_s: how long one request may wait for an answer, default ``REQUEST_TIMEOUT_S``.
        request_attempts: tries of one request (throttling, 5xx, resets), default ``s3io.REQUEST_ATTEMPTS``.

    Raises:
        DestinationError: boto3 is not installed (the hint names the ``jobguard[s3]`` extra), or the AWS
            configuration is broken (``AWS_PROFILE`` names no profile).
    """

    kind: ClassVar[str] = "s3"
    leaves_staging: ClassVar[bool] = False  # staged objects lie under their run's id (``discard``): nothing to tidy
    leaves_parts_staging: ClassVar[bool] = False  # node parts likewise

    def __init__(self, bucket: str, prefix: str = "", *, client: Any = None, max_concurrency: int = 8,
                 part_size_bytes: int = 16 * 1024 * 1024, multipart_threshold_bytes: int = 64 * 1024 * 1024,
                 request_timeout_s: float = REQUEST_TIMEOUT_S, request_attempts: int = REQUEST_ATTEMPTS) -> None:
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self._session: Any = None
        if client is None:
            client, self._session = make_client(request_timeout_s=request_timeout_s, max_pool=max_concurrency + 4,
                                                attempts=request_attempts)
        self.io = S3Io(client, bucket, str(self), max_concurrency=max_concurrency, part_size_bytes=part_size_bytes,
                       multipart_threshold_bytes=multipart_threshold_bytes)

    @classmethod
    def open(cls, destination: Destination, **options: Any) -> S3Store:
        """The store of a ``Destination`` of kind ``"s3"`` (``options`` are ignored: the standard AWS
        configuration applies). Raises as ``from_url`` and the constructor."""
        return cls.from_url(str(destination))

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> S3Store:
        """The store of ``s3://BUCKET/PREFIX`` (``parse_s3_url``'s errors)."""
        bucket, prefix = parse_s3_url(url)
        return cls(bucket, prefix, **kwargs)

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def close(self) -> None:
        self.io.close()

    # -- keys -------------------------------------------------------------------------------------------------

    def key(self, rel: str) -> str:
        """The full key of ``rel`` (a key relative to the prefix)."""
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def _staging(self, run_id: str, step: int | None = None) -> str:
        return f".guard/staging/{run_id}/" + (f"step-{step}/" if step is not None else "")

    # -- small JSON objects -----------------------------------------------------------------------------------

    def _get_json(self, rel: str, deadline: float) -> tuple[dict[str, Any], str] | None:
        """``(body, ETag)`` of a JSON object, or None when there is none."""
        from botocore.exceptions import ClientError

        def get(**kwargs: Any) -> tuple[bytes, str] | None:
            try:
                answer = self.io.client.get_object(**kwargs)
            except ClientError as err:
                if err.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                    return None
                raise
            return answer["Body"].read(), str(answer["ETag"])

        got = self.io.call(f"read of {rel}", deadline, get, Key=self.key(rel))
        if got is None:
            return None
        try:
            body = json.loads(got[0])
        except ValueError as err:
            raise DestinationError(f"{self}/{rel} is not JSON: {err}", destination=str(self)) from err
        if not isinstance(body, dict):
            raise DestinationError(f"{self}/{rel} is not a JSON object", destination=str(self))
        return body, got[1]

    def _put_json(self, rel: str, body: Mapping[str, Any], deadline: float, **condition: str) -> str:
        """Write a JSON object (SHA-256 checked by the store), optionally ``IfMatch``/``IfNoneMatch``; its ETag."""
        import base64
        import hashlib

        data = json.dumps(body, indent=1, sort_keys=True).encode()
        checksum = base64.b64encode(hashlib.sha256(data).digest()).decode()
        answer = self.io.call(f"write of {rel}", deadline, self.io.client.put_object, Key=self.key(rel), Body=data,
                              ContentType="application/json", ChecksumAlgorithm="SHA256", ChecksumSHA256=checksum,
                              **condition)
        return str(answer["ETag"])

    def _list(self, rel_prefix: str, deadline: float) -> list[str]:
        """Every key under ``rel_prefix`` (relative to the prefix), paginated."""
        def listing() -> list[str]:
            keys: list[str] = []
            for page in self.io.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket,
                                                                                  Prefix=self.key(rel_prefix)):
                keys.extend(obj["Key"] for obj in page.get("Contents", []))
            return keys

        full = self.io.wait_one(f"listing of {self}/{rel_prefix}", deadline,
                                self.io._pool.submit(self._guarded, f"listing of {rel_prefix}", listing))
        cut = len(self.key(""))
        return [k[cut:] for k in full]

    def _guarded(self, what: str, fn: Any) -> Any:
        try:
            return fn()
        except Exception as err:
            raise s3_error(err, what, where=str(self)) from err

    def _delete(self, rels: Sequence[str], deadline: float) -> None:
        for start in range(0, len(rels), 1000):
            batch = [{"Key": self.key(rel)} for rel in rels[start:start + 1000]]
            answer = self.io.call(f"removal under {self}", deadline, self.io.client.delete_objects,
                                  Delete={"Objects": batch, "Quiet": True})
            if answer.get("Errors"):
                first = answer["Errors"][0]
                raise DestinationError(f"could not remove {first.get('Key')} at {self}: {first.get('Code')}",
                                       destination=str(self), hint="this identity needs s3:DeleteObject under the "
                                                                   "prefix")

    # -- the Store verbs --------------------------------------------------------------------------------------

    def probe(self, *, deadline: float) -> None:
        """Preflight: credentials found, the bucket exists, and a probe object under the prefix can be written (the
        record's way: conditionally, with its SHA-256), read back and removed, all before ``deadline``.

        Raises:
            DestinationError: the first step that failed, said with what to do (``guard.secure.dest.s3probe``).
        """
        from guard.secure.dest.s3probe import run_probe

        run_probe(self, deadline)

    def put_part(self, local_dir: Path, files: Sequence[str], *, run_id: str, step: int, node_rank: int,
                 nodes: int, place: str | None, source: str | None, deadline: float,
                 progress: Progress | None = None, requires: Mapping[str, int] | None = None,
                 check: Callable[[], None] | None = None) -> S3PartManifest:
        """Upload ``files`` to ``.guard/staging/<run_id>/step-<step>/node-<node_rank>/``, each verified there,
        then write the node's manifest beside them (``node-<k>.json``); ``check`` runs last (still the save this
        step names, now that its bytes are at the destination). Raises ``DestinationError``, or what ``check``
        raises."""
        base = f"{self._staging(run_id, step)}node-{node_rank}/"
        rels = [_check_rel(rel) for rel in files]
        done = self.io.upload_files(Path(local_dir), [(rel, self.key(base + rel)) for rel in rels], deadline,
                                    progress)
        manifest = S3PartManifest(
            run_id=run_id, step=step, node_rank=node_rank, nodes=nodes,
            files={u.rel: FileSum(u.size_bytes, u.sha256) for u in done}, written_at_s=time.time(), place=place,
            source=source, requires=dict(requires or {}), checksums={u.rel: u.checksum for u in done})
        self._put_json(f"{self._staging(run_id, step)}node-{node_rank}.json", _manifest_json(manifest), deadline)
        logger.info("put step %d node %d of %d: %d files, %d bytes at %s", step, node_rank, nodes, len(done),
                    sum(u.size_bytes for u in done), self)
        if check is not None:
            check()
        return manifest

    def parts(self, *, run_id: str, step: int, deadline: float) -> list[PartManifest]:
        """The node manifests of ``run_id``'s step ``step`` present at the destination (sorted by node)."""
        base = self._staging(run_id, step)
        found: list[PartManifest] = []
        for rel in self._list(base, deadline):
            if _NODE_MANIFEST.fullmatch(rel[len(base):]):
                got = self._get_json(rel, deadline)
                if got is not None:
                    found.append(_manifest_from(got[0]))
        return sorted(found, key=lambda p: p.node_rank)

    def part_steps(self, *, run_id: str, deadline: float) -> dict[int, set[int]]:
        """Which nodes have put a part of which step of ``run_id``: ``{step: {node ranks}}`` (one listing of the
        run's staging place; a node's part counts once its manifest is there)."""
        base = self._staging(run_id)
        found: dict[int, set[int]] = {}
        for rel in self._list(base, deadline):
            match = _STEP_NODE_MANIFEST.fullmatch(rel[len(base):])
            if match:
                found.setdefault(int(match[1]), set()).add(int(match[2]))
        return found

    def write_record(self, parts: Sequence[PartManifest], *, deadline: float,
                     recorded: Callable[[Record], None] | None = None) -> Record:
        """Make the checkpoint of ``parts`` the record (module docstring): verify every file, then one conditional
        write. Returns the record in place (another writer's of the same or a newer step of this run counts);
        ``recorded`` is called when the record now names this run's step (this write, or another node's of it).

        Raises:
            DestinationError: the parts disagree, a file does not verify, or the deadline passed.
        """
        record, checksums = self._record_from(parts, deadline)
        self._verify_record(record, checksums, deadline)
        now = self._move_record(record, deadline, newer_only=True)
        if (now.run_id, now.step) != (record.run_id, record.step):
            logger.info("the record at %s already names step %s of this run: step %s not recorded over it", self,
                        now.step, record.step)
        elif recorded is not None:
            recorded(now)
        return now

    def _verify_record(self, record: S3Record, checksums: Mapping[str, str], deadline: float) -> None:
        self.io.verify([(rel, self.key(record.keys[rel]), fs.size_bytes, checksums[rel])
                        for rel, fs in record.files.items()], deadline)

    def _record_from(self, parts: Sequence[PartManifest], deadline: float,
                     restored_from: int | None = None) -> tuple[S3Record, dict[str, str]]:
        if not parts:
            raise DestinationError("no node's part to record", destination=str(self))
        run_id, step, nodes = parts[0].run_id, parts[0].step, parts[0].nodes
        if any((p.run_id, p.step, p.nodes) != (run_id, step, nodes) for p in parts) or \
                sorted(p.node_rank for p in parts) != list(range(nodes)):
            raise DestinationError(f"the parts of step {step} are not one node each of {nodes}: "
                                   f"{sorted((p.run_id, p.step, p.node_rank) for p in parts)}", destination=str(self))
        if not all(isinstance(p, S3PartManifest) and p.checksums for p in parts):
            parts = self.parts(run_id=run_id, step=step, deadline=deadline)  # S3's checksums are in the manifests
        files: dict[str, FileSum] = {}
        keys: dict[str, str] = {}
        checksums: dict[str, str] = {}
        for part in parts:
            assert isinstance(part, S3PartManifest)
            for rel, fs in part.files.items():
                if rel in files and files[rel] != fs:
                    raise DestinationError(f"{rel} differs between two nodes' parts of step {step}",
                                           destination=str(self), hint="each node must save distinct files")
                files[rel] = fs
                keys[rel] = f"{self._staging(run_id, step)}node-{part.node_rank}/{rel}"
                checksums[rel] = part.checksums[rel]
        first = parts[0]
        return S3Record(step=step, run_id=run_id, files=files, revision="", nodes=nodes, place=first.place,
                        source=first.source, restored_from=restored_from, keys=keys), checksums

    def _move_record(self, record: S3Record, deadline: float, *, newer_only: bool) -> Record:
        while True:
            current = self._get_json(RECORD_NAME, deadline)
            now = _record_from_json(*current) if current else None
            if newer_only and now is not None and now.run_id == record.run_id and now.step is not None \
                    and record.step is not None and now.step >= record.step:
                logger.info("the record at %s is already step %s of run %s", self, now.step, now.run_id)
                return now
            if current is not None and newer_only:
                self._put_json(f".guard/previous/{RECORD_NAME}", current[0], deadline)
            condition = {"IfMatch": current[1]} if current else {"IfNoneMatch": "*"}
            try:
                etag = self._put_json(RECORD_NAME, _record_json(record), deadline, **condition)
            except WriteConflict:
                logger.info("another writer moved the record at %s first: reading it again", self)
                continue
            logger.info("record at %s: step %s of run %s (%d files)", self, record.step, record.run_id,
                        len(record.files))
            return S3Record(**{**record.__dict__, "revision": etag})

    def read_record(self, *, deadline: float) -> Record | None:
        """The current record (an :class:`S3Record`), or None."""
        current = self._get_json(RECORD_NAME, deadline)
        return _record_from_json(*current) if current else None

    def restore_record(self, record: Record, *, deadline: float) -> Record:
        """Move the record back to ``record``'s checkpoint (its parts must still be at the destination: under
        ``record.run_id``, else the previous record's run when that is the same step, the record a resumed run
        was fetched from)."""
        if record.run_id is None or record.step is None:
            raise DestinationError("a record without run id and step cannot be restored", destination=str(self))
        parts = self.parts(run_id=record.run_id, step=record.step, deadline=deadline)
        kept = None if parts else self._get_json(f".guard/previous/{RECORD_NAME}", deadline)
        prior = _record_from_json(*kept) if kept else None
        if prior is not None and prior.step == record.step and prior.run_id:  # another run's (a resumed one)
            parts = self.parts(run_id=prior.run_id, step=prior.step, deadline=deadline)
        if not parts:
            raise DestinationError(f"step {record.step} of run {record.run_id} is no longer at {self}",
                                   destination=str(self))
        now = self.read_record(deadline=deadline)
        target, checksums = self._record_from(parts, deadline, restored_from=now.step if now else None)
        self._verify_record(target, checksums, deadline)
        return self._move_record(target, deadline, newer_only=False)

    def fetch(self, record: Record, into: Path, *, deadline: float) -> FetchedCheckpoint | None:
        """Download ``record``'s checkpoint into ``into`` (at ``record.place``), each file verified against the
        record, and placed as every store places it (``local.place_fetched``: a differing local copy is moved aside
        to a hidden ``.NAME.replaced-<time>-<pid>``). A record known only by its revision (no step, no files) is
        read again first: None when there is none now."""
        if record.step is None and not record.files:
            current = self.read_record(deadline=deadline)
            if current is None:
                return None
            record = current
        if record.step is None:
            raise DestinationError(f"the record at {self} names no step", destination=str(self))
        keys = dict(record.keys) if isinstance(record, S3Record) and record.keys else {}
        if not keys:
            assert record.run_id is not None
            for part in self.parts(run_id=record.run_id, step=record.step, deadline=deadline):
                keys.update({rel: f"{self._staging(part.run_id, part.step)}node-{part.node_rank}/{rel}"
                             for rel in part.files})
        into.mkdir(parents=True, exist_ok=True)
        staging = local.staging_dir(".guard-fetch-", into)  # placed as it is: the folder's default permissions
        try:
            self.io.download_files([(rel, self.key(keys[rel]), fs.size_bytes, fs.sha256)
                                    for rel, fs in record.files.items()], staging, deadline)
            return local.place_fetched(staging, into, record.step, record.revision, sorted(record.files),
                                       sum(fs.size_bytes for fs in record.files.values()), record.place, str(self),
                                       logger)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def put_final(self, local_dir: Path, files: Sequence[str], *, deadline: float,
                  progress: Progress | None = None) -> FinalPushed:
        """The final model's files at ``PREFIX/<rel>``, verified; files of an earlier final model that this one
        does not have are removed, then ``.guard/final.json`` names the new ones (its ETag is the revision)."""
        rels = [_check_rel(rel) for rel in files]
        done = self.io.upload_files(Path(local_dir), [(rel, self.key(rel)) for rel in rels], deadline, progress)
        before = self._get_json(".guard/final.json", deadline)
        stale = sorted(set((before[0].get("files") or {}) if before else {}) - set(rels))
        if stale:
            self._delete(stale, deadline)
        sums = {u.rel: FileSum(u.size_bytes, u.sha256) for u in done}
        etag = self._put_json(".guard/final.json", {"files": {rel: _sum_json(fs) for rel, fs in sums.items()},
                                                    "written_at_s": time.time()}, deadline)
        return FinalPushed(revision=etag, files=sums)

    def tidy(self, *, deadline: float | None = None, nodes: int = 1) -> None:
        """Nothing: a run's staged objects lie under its own run id (``discard`` removes them on request)."""

    def write_taint(self, taint: Taint, *, deadline: float) -> None:
        """``.guard/taints/<run_id>.json``; an earlier first step already recorded for the run is kept."""
        rel = f".guard/taints/{taint.run_id}.json"
        before = self._get_json(rel, deadline)
        if before and isinstance(before[0].get("first_step"), int) and before[0]["first_step"] <= taint.first_step:
            return
        self._put_json(rel, {"run_id": taint.run_id, "first_step": taint.first_step, "witness": taint.witness,
                             "recorded_at_s": taint.recorded_at_s or time.time()}, deadline)

    def taints(self, *, deadline: float) -> list[Taint]:
        """Every taint at the destination."""
        found = []
        for rel in self._list(".guard/taints/", deadline):
            got = self._get_json(rel, deadline)
            if got and isinstance(got[0].get("first_step"), int):
                body = got[0]
                found.append(Taint(str(body.get("run_id")), body["first_step"], str(body.get("witness", "loss")),
                                   float(body.get("recorded_at_s") or 0.0)))
        return found

    def discard(self, *, run_id: str, step: int | None, deadline: float) -> None:
        """Remove ``run_id``'s staging objects (of ``step``, or all) that neither the record nor the previous
        record names, and abort the unfinished multipart uploads there."""
        kept: set[str] = set()  # the step folders a record names
        for rel in (RECORD_NAME, f".guard/previous/{RECORD_NAME}"):
            got = self._get_json(rel, deadline)
            if got is not None:
                record = _record_from_json(*got)
                if record.run_id == run_id and record.step is not None:
                    kept.add(self._staging(run_id, record.step))
        base = self._staging(run_id, step)
        doomed = [rel for rel in self._list(base, deadline) if not any(rel.startswith(k) for k in kept)]
        if doomed:
            self._delete(doomed, deadline)
        uploads = self.io.call(f"listing of unfinished uploads under {self}", deadline,
                               self.io.client.list_multipart_uploads, Prefix=self.key(base))
        for upload in uploads.get("Uploads", []):
            self.io.abort_upload(upload["Key"], upload["UploadId"])
        logger.info("discarded %d staging objects of run %s at %s", len(doomed), run_id, self)


# ---------------------------------------------------------------------------------------------------------------
# JSON forms
# ---------------------------------------------------------------------------------------------------------------


def _sum_json(fs: FileSum) -> dict[str, Any]:
    return {"size_bytes": fs.size_bytes, "sha256": fs.sha256}


def _manifest_json(m: S3PartManifest) -> dict[str, Any]:
    body = part_json(m)  # the layout every store writes, and each file's stored checksum
    for rel, entry in body["files"].items():
        entry["checksum"] = m.checksums.get(rel)
    return body


def _manifest_from(body: Mapping[str, Any]) -> S3PartManifest:
    try:
        part = part_from_json(body)
        checksums = {rel: str(f["checksum"]) for rel, f in body["files"].items() if f.get("checksum")}
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise DestinationError(f"a node manifest at the destination is malformed: {err!r}") from err
    return S3PartManifest(**{f.name: getattr(part, f.name) for f in fields(PartManifest)}, checksums=checksums)


def _record_json(r: S3Record) -> dict[str, Any]:
    return {"format": RECORD_FORMAT, "run_id": r.run_id, "step": r.step, "nodes": r.nodes, "place": r.place,
            "source": r.source, "restored_from": r.restored_from, "written_at_s": time.time(),
            "files": {rel: {**_sum_json(fs), "key": r.keys[rel]} for rel, fs in sorted(r.files.items())}}


def _record_from_json(body: Mapping[str, Any], etag: str) -> S3Record:
    try:
        files = body.get("files") or {}
        return S3Record(
            step=body.get("step"), run_id=body.get("run_id"),
            files={rel: FileSum(int(f["size_bytes"]), str(f["sha256"])) for rel, f in files.items()},
            revision=etag, nodes=int(body.get("nodes") or 1), place=body.get("place"), source=body.get("source"),
            restored_from=body.get("restored_from"), keys={rel: str(f["key"]) for rel, f in files.items()})
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise DestinationError(f"the record {RECORD_NAME} at the destination is malformed: {err!r}") from err
