"""Bounded Hub requests: no ``huggingface_hub`` call of the guard waits without a limit.

``huggingface_hub`` 2.4.0's shared HTTP client has ``timeout=None`` (a hung server hangs API calls forever). The
first use installs, with ``huggingface_hub.set_client_factory``, a client whose transport gives every request
default timeouts (``REQUEST_TIMEOUTS_S``) and, while a push or fetch runs (``bounded``), caps each socket operation
and each body chunk at the time left before its deadline; network errors and 408/429/5xx answers then raise at
once (``TransientHubError``) instead of entering the client's own backoff (which sleeps up to 8 s), so that
``guard.secure.securer`` retries them with its own backoff while time remains. The transport also counts the bytes an
upload sends into the push in progress (``PROGRESS``), for the progress lines.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = [
    "PROGRESS",
    "REQUEST_TIMEOUTS_S",
    "DeadlineExceeded",
    "Mismatch",
    "TransientHubError",
    "bounded",
    "cause_hint",
    "classify",
    "failure_cause",
    "fatal_hint",
    "install_request_bounds",
    "parse_retry_after",
    "retry_after_s",
]

logger = logging.getLogger("guard.hub")

#: Per-operation timeouts (seconds) for every Hub request made in this process when the caller gives none.
#: Each socket operation's bound: ``read``/``write`` are also the no-progress bound of a call (connected, then no
#: byte answered or sent for that long: the attempt is given up, logged, and retried while time remains).
REQUEST_TIMEOUTS_S = {"connect": 10.0, "read": 60.0, "write": 60.0, "pool": 10.0}
_RETRY_STATUSES = (408, 429, 500, 502, 503, 504)  # what huggingface_hub's http_backoff retries


class Mismatch(Exception):
    """Verification found differences (one line per file)."""

    def __init__(self, problems: list[str]) -> None:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        super().__init__(f"verification failed: {shown}")
        self.problems = problems


class TransientHubError(Exception):
    """A network error or a 408/429/5xx answer during a bounded call (deliberately not an httpx error, so the
    client's own backoff does not retry it).

    Attributes:
        retry_after_s: the answer's ``Retry-After`` in seconds (RFC 9110 section 10.2.3: delay-seconds or an
            HTTP-date), or None.
        cause: ``rate_limit`` (429), ``unreachable`` (no connection, no answer), ``server`` (408, 5xx).
    """

    def __init__(self, message: str, *, retry_after_s: float | None = None, cause: str = "server") -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.cause = cause


def parse_retry_after(value: str | None, *, now_epoch_s: float | None = None) -> float | None:
    """A ``Retry-After`` header's wait in seconds: delay-seconds (``"271"``) or an HTTP-date (the seconds from now
    to it, at least 0); None when absent or malformed."""
    if not value:
        return None
    text = value.strip()
    if text.isdigit():
        return float(text)
    import email.utils
    import time as _time

    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError):
        return None
    now = _time.time() if now_epoch_s is None else now_epoch_s
    return max(0.0, when.timestamp() - now)


class DeadlineExceeded(Exception):
    """A bounded call reached its deadline."""



_BOUNDS_LOCK = threading.Lock()
_ACTIVE_BOUNDS: list[Callable[[], float]] = []
_INSTALLED = False


#: The push in progress (``telemetry.Progress``); the transport counts the bytes it sends into it.
PROGRESS: list[Any] = []


def _remaining_s() -> float | None:
    with _BOUNDS_LOCK:
        bounds = list(_ACTIVE_BOUNDS)
    return min(fn() for fn in bounds) if bounds else None


@contextlib.contextmanager
def bounded(remaining_s: Callable[[], float]) -> Iterator[None]:
    with _BOUNDS_LOCK:
        _ACTIVE_BOUNDS.append(remaining_s)
    try:
        yield
    finally:
        with _BOUNDS_LOCK:
            _ACTIVE_BOUNDS.remove(remaining_s)


def install_request_bounds() -> None:
    """Make ``huggingface_hub``'s shared HTTP client bounded (idempotent; see the module docstring).

    Uses ``huggingface_hub.set_client_factory`` (1.x with httpx, 2.x with httpx2); with an older client (requests),
    logs a warning and leaves it alone.
    """
    global _INSTALLED
    if _INSTALLED:
        return
    try:
        try:
            import httpx2 as httpx  # huggingface_hub 2.x
        except ImportError:  # pragma: no cover - huggingface_hub 1.x uses httpx, the same API
            import httpx  # type: ignore[no-redef]
        from huggingface_hub import set_client_factory
        from huggingface_hub.utils.tqdm import disable_progress_bars
    except ImportError:  # pragma: no cover - depends on the installed client
        logger.warning("huggingface_hub has no set_client_factory: Hub requests are not bounded by the deadline")
        _INSTALLED = True
        return
    try:  # the default client's request hook (offline mode, request ids); private, so optional
        from huggingface_hub.utils._http import hf_request_event_hook
        hooks = [hf_request_event_hook]
    except ImportError:  # pragma: no cover
        hooks = []

    class _DeadlineStream(httpx.SyncByteStream):
        def __init__(self, inner: Any, what: str, upload: bool = False) -> None:
            self._inner, self._what, self._upload = inner, what, upload

        def __iter__(self) -> Iterator[bytes]:
            for chunk in self._inner:
                left = _remaining_s()
                if left is not None and left <= 0:
                    raise DeadlineExceeded(f"deadline reached during {self._what}")
                if self._upload and PROGRESS:
                    PROGRESS[-1].update(PROGRESS[-1].done_bytes + len(chunk))
                yield chunk

        def close(self) -> None:
            if hasattr(self._inner, "close"):
                self._inner.close()

    class _BoundedTransport(httpx.HTTPTransport):
        def handle_request(self, request: Any) -> Any:
            left = _remaining_s()
            what = f"{request.method} {request.url.path}"
            timeouts = dict(request.extensions.get("timeout") or {})
            for key, default_s in REQUEST_TIMEOUTS_S.items():
                value = timeouts.get(key)
                value = default_s if value is None else min(value, default_s)  # the bound caps a longer ask
                timeouts[key] = value if left is None else max(min(value, left), 0.001)
            request.extensions["timeout"] = timeouts
            if left is None:
                return super().handle_request(request)
            if left <= 0:
                raise DeadlineExceeded(f"deadline reached before {what}")
            request.stream = _DeadlineStream(request.stream, what, upload=request.method in ("PUT", "POST"))
            try:
                response = super().handle_request(request)
            except httpx.TransportError as err:
                left = _remaining_s()
                if left is not None and left <= 0:
                    raise DeadlineExceeded(f"deadline reached during {what}") from err
                if isinstance(err, (httpx.ReadTimeout, httpx.WriteTimeout)):  # connected, then nothing moved
                    kind = "read" if isinstance(err, httpx.ReadTimeout) else "write"
                    bound_s = timeouts.get(kind) or REQUEST_TIMEOUTS_S[kind]
                    logger.warning("no progress for %.0fs on %s (%s): giving this attempt up", bound_s, what,
                                   "no answer" if kind == "read" else "nothing could be sent")
                    raise TransientHubError(f"no progress for {bound_s:.0f}s on {what} ({type(err).__name__})",
                                            cause="unreachable") from err
                raise TransientHubError(f"{type(err).__name__} on {what}: {err}", cause="unreachable") from err
            if response.status_code in _RETRY_STATUSES:
                with contextlib.suppress(Exception):
                    response.read()
                response.close()
                message = response.headers.get("X-Error-Message", "")
                wait_s = parse_retry_after(response.headers.get("Retry-After"))
                after = f" (Retry-After {wait_s:.0f}s)" if wait_s is not None else ""
                raise TransientHubError(f"HTTP {response.status_code} on {what}{': ' + message if message else ''}"
                                        f"{after}", retry_after_s=wait_s,
                                        cause="rate_limit" if response.status_code == 429 else "server")
            response.stream = _DeadlineStream(response.stream, what)
            return response

    def factory() -> Any:
        return httpx.Client(event_hooks={"request": hooks}, follow_redirects=True,
                            timeout=httpx.Timeout(**REQUEST_TIMEOUTS_S), transport=_BoundedTransport())

    set_client_factory(factory)
    disable_progress_bars()
    _INSTALLED = True


def classify(err: BaseException) -> tuple[str, str]:
    """-> (``"deadline"|"transient"|"mismatch"|"fatal"``, one-line description), looking through wrapped causes."""
    seen: BaseException | None = err
    chain: list[BaseException] = []
    while seen is not None and len(chain) < 10:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    for kind, cls in (("deadline", DeadlineExceeded), ("transient", TransientHubError), ("mismatch", Mismatch)):
        for item in chain:
            if isinstance(item, cls):
                return kind, str(item)
    for item in chain:
        status = getattr(getattr(item, "response", None), "status_code", None)
        if isinstance(status, int):
            text = getattr(item, "server_message", None) or (str(item).strip().splitlines() or [type(item).__name__])[0]
            text = text.strip().removeprefix(f"{status} ")
            return ("transient" if status in _RETRY_STATUSES else "fatal"), f"HTTP {status}: {text}"
        if isinstance(item, OSError) and "Consistency check failed" in str(item):  # a truncated download
            return "transient", str(item).splitlines()[0]
    return "fatal", f"{type(err).__name__}: {err}"


def retry_after_s(err: BaseException) -> float | None:
    """The ``Retry-After`` wait an error carries (a ``TransientHubError`` in its chain, or an HTTP error's
    response), or None."""
    seen: BaseException | None = err
    for _ in range(10):
        if seen is None:
            break
        if isinstance(seen, TransientHubError) and seen.retry_after_s is not None:
            return seen.retry_after_s
        headers = getattr(getattr(seen, "response", None), "headers", None)
        if headers is not None and hasattr(headers, "get"):
            found = parse_retry_after(headers.get("Retry-After"))
            if found is not None:
                return found
        seen = seen.__cause__ or seen.__context__
    return None


def failure_cause(description: str) -> str:
    """What an attempt's failure says about the Hub, for the hint: ``rate_limit`` (HTTP 429), ``auth`` (401, 403),
    ``unreachable`` (no connection, DNS, no answer), else ``other``."""
    if "HTTP 429" in description:
        return "rate_limit"
    if description.startswith(("HTTP 401", "HTTP 403")) or " HTTP 401" in description or " HTTP 403" in description:
        return "auth"
    if any(marker in description for marker in ("ConnectError", "ConnectTimeout", "Name or service not known",
                                                "nodename nor servname", "Temporary failure in name resolution",
                                                "RemoteProtocolError", "ReadTimeout", "ReadError",
                                                "Connection refused", "WriteTimeout", "PoolTimeout",
                                                "no progress for")):
        return "unreachable"
    return "other"


def cause_hint(cause: str, *, retry_after: float | None = None) -> str | None:
    """The hint for a push that failed for ``cause`` (``failure_cause``), or None for ``other``."""
    if cause == "rate_limit":
        asked = f" (it asked to wait {retry_after:.0f}s)" if retry_after is not None else ""
        return (f"the Hub is rate-limiting this account's commits{asked}: fewer commits get through, so raise "
                "--push-interval (the least time between two background pushes) or push fewer checkpoints; the "
                "checkpoint is still on local disk")
    if cause == "unreachable":
        return ("the Hub could not be reached (DNS, connection, or no answer): check the network, a proxy and "
                "HF_ENDPOINT, and the Hub's status; the checkpoint is still on local disk")
    if cause == "auth":
        return "the Hub refused the token: set HF_TOKEN to a valid token that can write to the destination"
    return None


#: A Hub without Xet storage answers the Xet token route 404 (or 501), and ``hf_xet`` (used whenever it is installed,
#: whatever the Hub) then fails with ``... (404 Not Found), domain: .../xet-write-token/main`` (huggingface_hub #4507).
_NO_XET = re.compile(r"\b(404|501)\b.*xet-(write|read)-token|xet-(write|read)-token.*\b(404|501)\b")


def fatal_hint(description: str) -> str:
    """The hint for a push that failed for good with ``description`` (``classify``'s text)."""
    if _NO_XET.search(description):
        return ("this Hub has no Xet storage (its xet-write-token route answered 404), and huggingface_hub uploads "
                "through Xet whenever hf_xet is installed: set HF_HUB_DISABLE_XET=1 to upload over plain HTTP "
                "(LFS) instead; the checkpoint is still on local disk")
    if description.startswith("HTTP 401"):
        return "set HF_TOKEN to a valid token that can write to the destination"
    if description.startswith(("HTTP 403", "HTTP 404")):
        return "use a token with write access to the destination's namespace (role write, or fine-grained repo.write)"
    if description.split(":")[0].endswith(("OSError", "FileNotFoundError", "PermissionError", "IsADirectoryError")):
        return "check the local disk and the destination folder"
    return "check the destination and the network; the checkpoint is still on local disk"
