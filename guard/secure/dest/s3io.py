"""S3 transfers for ``guard.secure.dest.s3``: the client, its errors as ``DestinationError``, and checksummed
uploads and downloads bounded by a deadline.

The client is botocore's, through ``boto3`` (the ``jobguard[s3]`` extra; chosen by measurement, docs/design.md
"S3 client"). It reads the user's standard configuration and nothing else: ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_PROFILE``, ``AWS_ENDPOINT_URL`` (or
``AWS_ENDPOINT_URL_S3``) for S3-compatible stores, and the rest of botocore's credential chain (config files, SSO,
container and instance roles). botocore reads the region from ``AWS_DEFAULT_REGION`` only; ``AWS_REGION`` (the
name the other AWS SDKs read) is passed on when that one is unset.

Integrity (AWS S3 user guide, "Checking object integrity"): every object is sent with its SHA-256
(``ChecksumAlgorithm=SHA256`` and the ``x-amz-checksum-sha256`` value computed here while reading the file once),
which S3 checks against the bytes it received (``BadDigest`` otherwise) and stores; a file above
``multipart_threshold_bytes`` goes up in parts (in parallel, each part with its own SHA-256), and S3 stores the
*composite* checksum, the SHA-256 of the parts' digests (``"<base64>-<parts>"``). After each upload, a ``HEAD``
with ``ChecksumMode=ENABLED`` must give back the size and the checksum computed here, or the file does not verify.
A download hashes what it writes and compares it with the record's SHA-256.

Bounds: every request runs on the store's thread pool and is waited for at most until the deadline; a request
still running then is abandoned (the worker child that runs securing is killed at the deadline anyway), and the
request itself gives up after ``request_timeout_s`` without progress. botocore's standard retry mode retries a
request up to ``REQUEST_ATTEMPTS`` times on throttling (503 SlowDown), 5xx and resets; what still fails is a
``TransientDestinationError`` and the caller decides.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import hashlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from guard.errors import DestinationError, TransientDestinationError

__all__ = ["INSTALL_HINT", "REQUEST_ATTEMPTS", "S3Io", "Uploaded", "WriteConflict", "composite_checksum", "make_client",
           "s3_error"]

logger = logging.getLogger("guard.secure.s3")
T = TypeVar("T")

#: Attempts per request in botocore's standard retry mode (throttling, 5xx, resets), within the deadline.
REQUEST_ATTEMPTS = 3
#: S3's limits on a multipart upload (AWS S3 user guide, "Amazon S3 multipart upload limits").
MAX_PARTS = 10_000
MIN_PART_BYTES = 5 * 1024 * 1024
_MIB = 1024 * 1024
INSTALL_HINT = 'install the S3 client: pip install "jobguard[s3]" (boto3)'


class WriteConflict(TransientDestinationError):
    """A conditional write lost to another writer (``412 PreconditionFailed``, ``409 ConditionalRequestConflict``):
    read again and decide again."""


def _b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode("ascii")


def composite_checksum(part_digests: Iterable[bytes]) -> str:
    """S3's composite SHA-256 of a multipart object: base64 of the SHA-256 of the parts' digests, ``-<parts>``."""
    digests = list(part_digests)
    return f"{_b64(hashlib.sha256(b''.join(digests)).digest())}-{len(digests)}"


def _same_checksum(stored: str | None, sent: str) -> bool:
    """Whether a HEAD's checksum is the one sent (some servers leave the ``-<parts>`` suffix out)."""
    return stored is not None and stored.split("-")[0] == sent.split("-")[0]


def make_client(*, request_timeout_s: float, max_pool: int, attempts: int = REQUEST_ATTEMPTS) -> tuple[Any, Any]:
    """``(client, session)``: a botocore S3 client from the standard AWS configuration (module docstring), each
    request tried up to ``attempts`` times (botocore's standard retry mode).

    Raises:
        DestinationError: boto3 is not installed, or ``AWS_PROFILE`` names no profile.
    """
    try:
        import boto3
        from botocore.config import Config
        from botocore.exceptions import BotoCoreError
    except ImportError as err:
        raise DestinationError(f"--push-to s3://... needs boto3, not installed here ({err})",
                               hint=INSTALL_HINT) from err
    region = None if os.environ.get("AWS_DEFAULT_REGION") else os.environ.get("AWS_REGION") or None
    try:
        session = boto3.session.Session(region_name=region)
        config = Config(connect_timeout=min(10.0, request_timeout_s), read_timeout=request_timeout_s,
                        retries={"mode": "standard", "total_max_attempts": max(1, attempts)},
                        max_pool_connections=max_pool, request_checksum_calculation="when_required",
                        response_checksum_validation="when_required")
        return session.client("s3", config=config), session
    except BotoCoreError as err:
        raise s3_error(err, "the S3 client's configuration") from err


def s3_error(err: BaseException, what: str, *, where: str = "") -> DestinationError:
    """``err`` (botocore's) as a ``DestinationError`` with a hint; transient for resets, timeouts, throttling and
    5xx (``TransientDestinationError``)."""
    from botocore.exceptions import (
        BotoCoreError,
        ClientError,
        ConnectionError,
        HTTPClientError,
        NoCredentialsError,
        PartialCredentialsError,
        ProfileNotFound,
    )

    if isinstance(err, DestinationError):
        return err
    if isinstance(err, ClientError):
        status = int(err.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        code = str(err.response.get("Error", {}).get("Code") or status)
        text = f"{what}: {code} (HTTP {status}){' at ' + where if where else ''}"
        if code in ("PreconditionFailed", "ConditionalRequestConflict") or status == 412:
            return WriteConflict(text, destination=where or None, hint="another writer wrote it first")
        if status in (408, 429) or status >= 500 or code in ("SlowDown", "RequestTimeout", "Throttling"):
            return TransientDestinationError(text, destination=where or None,
                                             hint="the store is throttling or failing: it is retried while time "
                                                  "remains")
        if status == 403 or code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            return DestinationError(text, destination=where or None,
                                    hint="check the AWS credentials (AWS_ACCESS_KEY_ID, AWS_PROFILE...) and that "
                                         "this identity may list, read, write and delete under the prefix")
        if code == "NoSuchBucket":
            return DestinationError(text, destination=where or None,
                                    hint="create the bucket first (aws s3 mb s3://BUCKET) or fix --push-to; "
                                         "for an S3-compatible store set AWS_ENDPOINT_URL")
        return DestinationError(text, destination=where or None)
    if isinstance(err, NoCredentialsError | PartialCredentialsError | ProfileNotFound):
        return DestinationError(f"{what}: {err}", destination=where or None,
                                hint="set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN), or "
                                     "AWS_PROFILE, or run with an instance or container role")
    if isinstance(err, ConnectionError | HTTPClientError):
        return TransientDestinationError(f"{what}: {type(err).__name__}: {err}", destination=where or None,
                                         hint="check AWS_ENDPOINT_URL (or AWS_REGION) and the network")
    if isinstance(err, BotoCoreError):
        return DestinationError(f"{what}: {type(err).__name__}: {err}", destination=where or None)
    if isinstance(err, OSError):
        return DestinationError(f"{what}: {err}", destination=where or None)
    return DestinationError(f"{what}: {type(err).__name__}: {err}", destination=where or None)


@dataclass(frozen=True)
class Uploaded:
    """One file at its key, verified there: size, SHA-256 (hex) of the bytes sent, and S3's stored checksum."""

    rel: str
    key: str
    size_bytes: int
    sha256: str
    checksum: str


class S3Io:
    """Checksummed, deadline-bounded transfers to one bucket (see the module docstring).

    Args:
        client: a botocore S3 client.
        bucket: the bucket.
        where: the destination as the user wrote it, for messages.
        max_concurrency: requests in flight at once (files and parts), default 8.
        part_size_bytes: the part size of a multipart upload (raised to fit S3's 10,000 parts), default 16 MiB.
        multipart_threshold_bytes: files above this size go up in parts, default 64 MiB.
    """

    def __init__(self, client: Any, bucket: str, where: str, *, max_concurrency: int = 8,
                 part_size_bytes: int = 16 * _MIB, multipart_threshold_bytes: int = 64 * _MIB) -> None:
        self.client = client
        self.bucket = bucket
        self.where = where
        self.max_concurrency = max(1, max_concurrency)
        self.part_size_bytes = max(MIN_PART_BYTES, part_size_bytes)
        self.multipart_threshold_bytes = max(self.part_size_bytes, multipart_threshold_bytes)
        self._pool = cf.ThreadPoolExecutor(max_workers=self.max_concurrency + 2, thread_name_prefix="guard-s3")
        self._progress_lock = threading.Lock()

    def close(self) -> None:
        """Stop taking requests; one still running is abandoned (it ends on its own timeout)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- one request ------------------------------------------------------------------------------------------

    def call(self, what: str, deadline: float, fn: Callable[..., T], /, **kwargs: Any) -> T:
        """``fn(Bucket=bucket, **kwargs)`` on the pool, waited for until ``deadline``.

        Raises:
            DestinationError: the deadline passed first (or the request failed: ``s3_error``).
        """
        return self.wait_one(what, deadline, self._pool.submit(self._request, what, fn, kwargs))

    def _request(self, what: str, fn: Callable[..., T], kwargs: dict[str, Any]) -> T:
        try:
            return fn(Bucket=self.bucket, **kwargs)
        except Exception as err:
            raise s3_error(err, what, where=self.where) from err

    def wait_one(self, what: str, deadline: float, future: cf.Future[T]) -> T:
        try:
            return future.result(timeout=max(0.0, deadline - time.monotonic()))
        except cf.TimeoutError:
            future.cancel()
            raise DestinationError(f"{what} did not finish before the deadline", destination=self.where,
                                   hint="a slow or stalled S3 endpoint: check the network, or give the job more "
                                        "time (--timeout, --margin)") from None

    def wait_all(self, what: str, deadline: float, futures: Iterable[cf.Future[T]]) -> list[T]:
        """Every future's result, in order; the first failure (or the deadline) cancels the rest and raises."""
        pending = list(futures)
        try:
            return [self.wait_one(what, deadline, fut) for fut in pending]
        except BaseException:
            for fut in pending:
                fut.cancel()
            raise

    # -- uploads ----------------------------------------------------------------------------------------------

    def upload_files(self, local_dir: Path, items: list[tuple[str, str]], deadline: float,
                     progress: Callable[[int, int], None] | None = None) -> list[Uploaded]:
        """Upload ``(rel, key)`` pairs of files under ``local_dir``, each verified at its key; small files in
        parallel, large ones in parallel parts. Returns them in the order given.

        Raises:
            DestinationError: a request failed, a file does not verify, or the deadline passed.
        """
        sizes = {rel: (local_dir / rel).stat().st_size for rel, _ in items}
        total, done = sum(sizes.values()), [0]

        def moved(n: int) -> None:
            if progress is not None:
                with self._progress_lock:
                    done[0] += n
                    progress(done[0], total)

        results: dict[str, cf.Future[Uploaded]] = {}
        small = [(rel, key) for rel, key in items if sizes[rel] <= self.multipart_threshold_bytes]
        large = [(rel, key) for rel, key in items if sizes[rel] > self.multipart_threshold_bytes]
        in_flight: set[cf.Future[Uploaded]] = set()
        try:
            for rel, key in small:
                self._bound(in_flight, deadline, f"upload to {self.where}")
                fut = self._pool.submit(self._put_small, local_dir / rel, rel, key, moved)
                results[rel] = fut
                in_flight.add(fut)
            for rel, key in large:
                done_large: cf.Future[Uploaded] = cf.Future()
                done_large.set_result(self._put_large(local_dir / rel, rel, key, deadline, moved))
                results[rel] = done_large
            return self.wait_all(f"upload to {self.where}", deadline, (results[rel] for rel, _ in items))
        except BaseException:
            for fut in results.values():
                fut.cancel()
            raise

    def _bound(self, in_flight: set[cf.Future[Any]], deadline: float, what: str) -> None:
        """Wait until fewer than ``max_concurrency`` of ``in_flight`` run; raise the first failure."""
        while len(in_flight) >= self.max_concurrency:
            done, _ = cf.wait(in_flight, timeout=max(0.0, deadline - time.monotonic()),
                              return_when=cf.FIRST_COMPLETED)
            if not done:
                raise DestinationError(f"{what} did not finish before the deadline", destination=self.where,
                                       hint="a slow or stalled S3 endpoint: check the network, or give the job "
                                            "more time (--timeout, --margin)")
            for fut in done:
                in_flight.discard(fut)
                fut.result()  # raises the request's DestinationError

    def _put_small(self, path: Path, rel: str, key: str, moved: Callable[[int], None]) -> Uploaded:
        data = path.read_bytes()
        digest = hashlib.sha256(data).digest()
        checksum = _b64(digest)
        self._request(f"upload of {rel}", self.client.put_object,
                      {"Key": key, "Body": data, "ChecksumAlgorithm": "SHA256", "ChecksumSHA256": checksum})
        self._verify(rel, key, len(data), checksum)
        moved(len(data))
        return Uploaded(rel, key, len(data), digest.hex(), checksum)

    def _part_size(self, size: int) -> int:
        need = math.ceil(size / MAX_PARTS)
        return max(self.part_size_bytes, math.ceil(need / _MIB) * _MIB)

    def _put_large(self, path: Path, rel: str, key: str, deadline: float, moved: Callable[[int], None]) -> Uploaded:
        what = f"multipart upload of {rel}"
        part_size = self._part_size(path.stat().st_size)
        upload_id = self.call(what, deadline, self.client.create_multipart_upload, Key=key,
                              ChecksumAlgorithm="SHA256")["UploadId"]
        try:
            whole, digests, parts = hashlib.sha256(), [], []
            in_flight: set[cf.Future[Any]] = set()
            size = 0
            with open(path, "rb") as src:
                while chunk := src.read(part_size):
                    if time.monotonic() >= deadline:
                        raise DestinationError(f"{what} did not finish before the deadline", destination=self.where)
                    whole.update(chunk)
                    digest = hashlib.sha256(chunk).digest()
                    digests.append(digest)
                    size += len(chunk)
                    self._bound(in_flight, deadline, what)
                    fut = self._pool.submit(self._put_part, what, key, upload_id, len(digests), chunk, digest, moved)
                    in_flight.add(fut)
                    parts.append(fut)
            etags = self.wait_all(what, deadline, parts)
            listed = [{"PartNumber": n + 1, "ETag": etag, "ChecksumSHA256": _b64(d)}
                      for n, (etag, d) in enumerate(zip(etags, digests, strict=True))]
            self.call(what, deadline, self.client.complete_multipart_upload, Key=key, UploadId=upload_id,
                      MultipartUpload={"Parts": listed})
        except BaseException:
            self.abort_upload(key, upload_id)
            raise
        checksum = composite_checksum(digests)
        self.wait_one(what, deadline, self._pool.submit(self._verify, rel, key, size, checksum))
        return Uploaded(rel, key, size, whole.hexdigest(), checksum)

    def _put_part(self, what: str, key: str, upload_id: str, number: int, chunk: bytes, digest: bytes,
                  moved: Callable[[int], None]) -> str:
        answer = self._request(f"{what} (part {number})", self.client.upload_part,
                               {"Key": key, "UploadId": upload_id, "PartNumber": number, "Body": chunk,
                                "ChecksumAlgorithm": "SHA256", "ChecksumSHA256": _b64(digest)})
        moved(len(chunk))
        return str(answer["ETag"])

    def abort_upload(self, key: str, upload_id: str) -> None:
        """Best effort, a few seconds at most: an unfinished multipart upload is billed until aborted."""
        fut = self._pool.submit(self._request, "abort of a multipart upload", self.client.abort_multipart_upload,
                                {"Key": key, "UploadId": upload_id})
        try:
            fut.result(timeout=5.0)
        except (DestinationError, cf.TimeoutError) as err:
            logger.info("could not abort the multipart upload of %s (%s): discard removes it later", key, err)

    def _verify(self, rel: str, key: str, size: int, checksum: str) -> None:
        head = self._request(f"check of {rel}", self.client.head_object, {"Key": key, "ChecksumMode": "ENABLED"})
        stored_size, stored = int(head.get("ContentLength", -1)), head.get("ChecksumSHA256")
        if stored_size != size or not _same_checksum(stored, checksum):
            raise DestinationError(
                f"{rel} does not verify at {self.where}: {stored_size} bytes, SHA-256 checksum {stored!r}; sent "
                f"{size} bytes, {checksum!r}", destination=self.where,
                hint="another writer replaced it, or the store does not keep SHA-256 checksums (an S3-compatible "
                     "store must support ChecksumAlgorithm=SHA256)")

    def verify(self, items: list[tuple[str, str, int, str]], deadline: float) -> None:
        """Check ``(rel, key, size, checksum)`` objects by HEAD, in parallel. Raises ``DestinationError``."""
        futures = [self._pool.submit(self._verify, rel, key, size, checksum) for rel, key, size, checksum in items]
        self.wait_all(f"verification at {self.where}", deadline, futures)

    # -- downloads --------------------------------------------------------------------------------------------

    def download_files(self, items: list[tuple[str, str, int, str]], into: Path, deadline: float) -> None:
        """Download ``(rel, key, size, sha256 hex)`` objects to ``into/rel``, each hashed as written and compared.

        Raises:
            DestinationError: a request failed, a file differs from its record, or the deadline passed.
        """
        futures = [self._pool.submit(self._get, rel, key, size, sha, into / rel) for rel, key, size, sha in items]
        self.wait_all(f"download from {self.where}", deadline, futures)

    def _get(self, rel: str, key: str, size: int, sha256: str, target: Path) -> None:
        answer = self._request(f"download of {rel}", self.client.get_object, {"Key": key})
        target.parent.mkdir(parents=True, exist_ok=True)
        hasher, written = hashlib.sha256(), 0
        try:
            with open(target, "wb") as out:
                for chunk in answer["Body"].iter_chunks(_MIB):
                    hasher.update(chunk)
                    out.write(chunk)
                    written += len(chunk)
                out.flush()
                os.fsync(out.fileno())
        except Exception as err:
            raise s3_error(err, f"download of {rel}", where=self.where) from err
        if (written, hasher.hexdigest()) != (size, sha256):
            raise DestinationError(f"{rel} at {self.where} differs from the record: {written} bytes, sha256 "
                                   f"{hasher.hexdigest()[:12]}..., recorded {size} bytes, {sha256[:12]}...",
                                   destination=self.where, hint="the object was replaced after the record was "
                                                                "written; the record no longer holds")
