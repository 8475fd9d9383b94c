"""The probe of an S3 destination (``S3Store.probe``, run by preflight before the job starts).

Four requests, in order, each a step a push takes later: ``HEAD`` of the bucket (it exists, these credentials are
accepted), a ``PUT`` of a small probe object under the prefix with ``If-None-Match: *`` and its SHA-256 (the way the
record is written), a ``GET`` of it, and its removal (``DeleteObjects``, as ``discard`` removes staging). The first
that fails is said as one line naming the step and what to do: the bucket does not exist, the credentials are
refused, this identity may not write, read or delete under the prefix, the store refuses conditional writes, or the
endpoint cannot be reached or does not answer in time.

HTTP facts (AWS S3 API reference, ``HeadBucket``): a HEAD answer has no body, so botocore gives the status as the
error code (``"404"``, ``"403"``, ``"301"``); a bucket in another region answers ``301`` (or ``400`` with an
``x-amz-bucket-region`` header).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from guard.errors import DestinationError, TransientDestinationError

__all__ = ["run_probe"]

_CREDENTIALS_HINT = ("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN), or AWS_PROFILE, or "
                     "run with an instance or container role")
#: botocore's exceptions for a request that reached no server or got no answer (``botocore.exceptions``).
_UNREACHABLE = ("EndpointConnectionError", "ConnectTimeoutError", "ProxyConnectionError")
_NO_ANSWER = ("ReadTimeoutError", "ConnectionClosedError")


def run_probe(store: Any, deadline: float) -> None:
    """Probe ``store`` (a ``guard.secure.dest.s3.S3Store``, typed ``Any``: that module calls this one) as the module
    docstring says, before ``deadline`` (monotonic seconds); the probe object is removed.

    Raises:
        DestinationError: the first step that failed, with a hint saying what to do.
    """
    session = getattr(store, "_session", None)
    if session is not None and session.get_credentials() is None:
        raise DestinationError(f"no AWS credentials found for {store}", destination=str(store),
                               hint=_CREDENTIALS_HINT)
    rel = f".guard/probe-{uuid.uuid4().hex[:12]}.json"
    step = "bucket"
    try:
        store.io.call(f"bucket {store.bucket}", deadline, store.io.client.head_bucket)
        step = "write"
        store._put_json(rel, {"probe": True, "at_s": time.time()}, deadline, IfNoneMatch="*")
        step = "read"
        got = store._get_json(rel, deadline)
        if got is None or got[0].get("probe") is not True:
            raise DestinationError(f"a probe object written at {store}/{rel} could not be read back",
                                   destination=str(store), hint="check the store's consistency and permissions")
        step = "delete"
        store._delete([rel], deadline)
    except DestinationError as err:
        raise _failure(store, step, err) from err


def _status(err: DestinationError) -> tuple[int, str]:
    """``(HTTP status, error code)`` of the botocore ``ClientError`` behind ``err``; ``(0, "")`` without one."""
    cause: Any = err.__cause__
    response = getattr(cause, "response", None)
    if not isinstance(response, dict):
        return 0, ""
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    return status, str(response.get("Error", {}).get("Code") or status)


def _failure(store: Any, step: str, err: DestinationError) -> DestinationError:
    """``err`` of ``step`` said as what was wrong and what to do; transient when ``err`` was."""
    endpoint = str(getattr(store.io.client.meta, "endpoint_url", "") or "the S3 endpoint")
    where, bucket = str(store), store.bucket
    status, code = _status(err)
    cause = type(err.__cause__).__name__ if err.__cause__ is not None else ""

    def said(message: str, hint: str) -> DestinationError:
        kind = TransientDestinationError if err.transient else DestinationError
        return kind(message, destination=where, hint=hint)

    if "before the deadline" in err.message or cause in _NO_ANSWER:
        return said(f"no answer from {endpoint} in time (the probe's {step} request, {where})",
                    "check AWS_ENDPOINT_URL and the network (a proxy, a firewall); or --skip-check "
                    "destination=REASON to run anyway (the pushes will retry)")
    if cause in _UNREACHABLE:
        return said(f"{endpoint} cannot be connected to ({cause}, {where})",
                    "check AWS_ENDPOINT_URL (or AWS_REGION) and the network")
    if step == "bucket" and (status == 404 or code == "NoSuchBucket"):
        return said(f"bucket {bucket} does not exist at {endpoint}",
                    f"create it first (aws s3 mb s3://{bucket}) or fix the bucket in --push-to; an S3-compatible "
                    "store (MinIO, R2, GCS) needs AWS_ENDPOINT_URL")
    if step == "bucket" and (status in (301, 307) or code in ("PermanentRedirect", "AuthorizationHeaderMalformed")):
        return said(f"bucket {bucket} is in another region than the client's ({code})",
                    "set AWS_REGION to the bucket's region")
    if status == 403 or code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
        if step == "bucket":
            return said(f"{endpoint} refused these credentials for bucket {bucket} (HTTP 403 {code})",
                        "check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE): an unknown or deleted "
                        "key is refused; the identity needs s3:ListBucket on the bucket")
        action = {"write": "s3:PutObject", "read": "s3:GetObject", "delete": "s3:DeleteObject"}[step]
        return said(f"this identity may not {step} under {where} ({code})",
                    f"grant {action} on arn:aws:s3:::{bucket}/{store.key('*')}")
    if step == "write" and (status in (400, 501) or code == "NotImplemented"):
        return said(f"{endpoint} refused a conditional write under {where} ({code}): the record of a checkpoint "
                    "is written with If-None-Match / If-Match", "use a store that supports S3's conditional writes")
    if step == "delete":
        return said(f"this identity may not delete under {where}: {err.message}",
                    f"grant s3:DeleteObject on arn:aws:s3:::{bucket}/{store.key('*')}")
    return said(f"the probe's {step} request at {where} failed: {err.message}", err.hint)
