"""A local Hub-compatible HTTP server for tests and benchmarks (stdlib ``http.server``, one thread per connection).

It speaks the part of the Hub HTTP API that ``huggingface_hub`` 2.4.0 calls (whoami-v2, repos create/delete,
repo info, tree, paths-info, preupload, commit, LFS batch/PUT/verify, resolve, list models/datasets, refs,
commits, auth-check, branch/tag); the endpoint list and the client's pitfalls are in
``shared/reference/hub-protocol.md``. The endpoints are in ``tests/hubroutes.py``; the data model and the
permission rules in ``tests/hubstate.py``.

How tests point the client here (chosen: **in-process, endpoint passed explicitly**):

- ``huggingface_hub`` reads ``HF_ENDPOINT`` at import time and freezes the download URL template, and under
  pytest some other module may import it first. So in-process code passes the endpoint explicitly:
  ``HfApi(endpoint=hub.url, token=TOKENS["write"])`` and its methods (``api.hf_hub_download``,
  ``api.snapshot_download`` pass ``endpoint`` through). Never patch ``constants.ENDPOINT``.
- ``HF_HUB_DISABLE_XET`` and ``HF_HUB_DISABLE_TELEMETRY`` are read on each call: in-process tests set
  ``huggingface_hub.constants.HF_HUB_DISABLE_XET = False`` (Xet on, the client's default; ``xet=False`` for a
  test of the plain LFS path) and ``HF_HUB_DISABLE_TELEMETRY = True`` (``with client_constants():``);
  ``client_env()`` gives the environment for code imported later.
- Subprocesses (the guard end to end) get ``hub.env(token=...)`` merged into their environment, which sets
  ``HF_ENDPOINT`` before their first import.

Seeded state (see ``docs/design.md``): tokens ``TOKENS["write"|"read"|"fine_alice"|"other"|"invalid"]``; users
alice (org acme, role write) and bob; public models ``acme/tiny-gpt2`` and ``alice/existing-model``, the gated model
``acme/gated-model`` (files readable by bob only), public datasets ``acme/tiny-text``, ``acme/wikitext-mini``,
``acme/wikitext-small``. Every repo starts with an "initial commit" holding ``.gitattributes``; seeded repos then get
a second commit with a few small files.

Faults: ``inject(status=..., count=..., methods=..., path_contains=...)`` makes the next ``count`` matching requests
answer ``status`` (default: write methods); ``inject(latency_s=...)`` delays every matching request until
``reset_faults()``; ``set_down(True)`` accepts connections and closes them without an answer, which the client sees
at once as a connection error (``RemoteProtocolError``/``ReadError``). ``requests`` logs ``(method, path, status)``
of every request (status 0: dropped while down).

Xet: the server is also the Hub's Xet storage (``tests/xetcas.py``, under ``/cas``), so ``hf_xet`` uploads and
downloads LFS files through it; the same faults apply to its routes (``path_contains="/cas/"``). ``xet = False``
answers the Xet token routes as a Hub without Xet does (404); ``silent_xet_storage()`` names a storage that never
answers. Files uploaded over plain LFS are served over plain HTTP (no ``X-Xet-Hash``).

Not implemented: pagination (``Link: rel="next"``), multipart LFS transfers, pull requests.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from tests.hubroutes import Routes
from tests.hubstate import TOKENS, CommitRecord, HttpError, HubState, Repo, now_iso
from tests.xetcas import XetCas

__all__ = ["TOKENS", "CommitRecord", "HubServer", "RequestRecord", "client_constants", "client_env"]

_WRITE_METHODS = ("POST", "PUT", "DELETE")
_TINY_GPT2_CONFIG = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 8, "n_head": 2,
                     "n_layer": 1, "n_positions": 64, "vocab_size": 64, "bos_token_id": 0, "eos_token_id": 0}


def client_env(hub_url: str | None = None, *, xet: bool = True) -> dict[str, str]:
    """Environment for ``huggingface_hub`` talking to the local server (set it before the first import).

    Args:
        hub_url: the server's URL (``HF_ENDPOINT``), if given.
        xet: False turns the client's Xet transfer off (``HF_HUB_DISABLE_XET=1``); default on, the client's own
            default (an empty ``HF_HUB_DISABLE_XET`` is false: it overrides a ``1`` inherited from the shell).

    Returns:
        ``HF_HUB_DISABLE_XET``, ``HF_HUB_DISABLE_TELEMETRY=1``, ``HF_HUB_OFFLINE=0`` and, when given,
        ``HF_ENDPOINT``.
    """
    env = {"HF_HUB_DISABLE_XET": "" if xet else "1", "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_OFFLINE": "0"}
    if hub_url:
        env["HF_ENDPOINT"] = hub_url
    return env


@contextlib.contextmanager
def client_constants(*, xet: bool = True) -> Iterator[None]:
    """Set, for the ``with`` block, the ``huggingface_hub.constants`` that are read on each call: Xet on (the
    client's default; ``xet=False`` turns it off), telemetry off (no calls to other hosts), offline mode off (the
    tests' conftest sets ``HF_HUB_OFFLINE=1`` against the real Hub). Restores them afterwards."""
    from huggingface_hub import constants

    names = ("HF_HUB_DISABLE_XET", "HF_HUB_DISABLE_TELEMETRY", "HF_HUB_OFFLINE")
    saved = {name: getattr(constants, name) for name in names}
    for name, value in zip(names, (not xet, True, False), strict=True):
        setattr(constants, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(constants, name, value)


class RequestRecord(NamedTuple):
    """One logged request: method, raw path (no query string), answered status (0: dropped while down)."""

    method: str
    path: str
    status: int


@dataclass
class _Fault:
    status: int | None
    count: int | None  # None: until reset_faults()
    methods: tuple[str, ...] | None
    path_contains: str | None
    latency_s: float
    headers: dict[str, str] | None = None

    def matches(self, method: str, path: str) -> bool:
        return ((self.methods is None or method in self.methods)
                and (self.path_contains is None or self.path_contains in path))


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: every answer carries Content-Length, every body is drained
    disable_nagle_algorithm = True
    timeout = 120  # an idle keep-alive connection is dropped after this
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # the stdlib signature
        pass

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    # -- plumbing ---------------------------------------------------------------------------------------------

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            parts = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _dispatch(self, method: str) -> None:
        hub = self.server.hub
        path = urlsplit(self.path).path
        if hub._down:
            self.close_connection = True  # no answer at all: the client sees a dropped connection
            hub._log(method, path, 0)
            return
        status = 500
        hub._begin()
        try:
            body = self._read_body()
            fault = hub._take_fault(method, path)
            if fault is not None and fault.latency_s > 0:
                hub._wake.wait(fault.latency_s)
            if fault is not None and fault.status is not None:
                error = HttpError(fault.status, f"injected fault {fault.status}")
                error.extra_headers = dict(fault.headers or {})
                raise error
            status, payload, headers = Routes(hub, self, method, body).route()
        except HttpError as err:
            status, headers = err.status, {"X-Error-Message": err.message, **getattr(err, "extra_headers", {})}
            if err.code:
                headers["X-Error-Code"] = err.code
            payload = {"error": err.message}
        except Exception as err:  # a bug in the server: answer 500 rather than hang the client
            status, headers, payload = 500, {"X-Error-Message": repr(err)}, {"error": repr(err)}
        finally:
            hub._log(method, path, status)
            hub._end()
        self._send(method, status, payload, headers)

    def _send(self, method: str, status: int, payload: Any, headers: dict[str, str]) -> None:
        if isinstance(payload, (bytes, memoryview)):
            data = payload
            headers.setdefault("Content-Type", "application/octet-stream")
        else:
            data = b"" if payload is None else json.dumps(payload).encode()
            headers.setdefault("Content-Type", "application/json")
        headers.setdefault("Content-Length", str(len(data)))
        try:
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.end_headers()
            if method != "HEAD" and data:
                self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client gave up (e.g. its timeout ran out during injected latency)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    request_queue_size = 64
    hub: HubServer

    def verify_request(self, request: Any, client_address: Any) -> bool:
        if self.hub._down:
            self.hub._log("CONNECT", "", 0)
            return False  # accepted, then closed without a byte: a connection error for the client
        return True

    def process_request(self, request: socket.socket, client_address: Any) -> None:
        with self.hub._lock:
            self.hub._connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: socket.socket) -> None:
        with self.hub._lock:
            self.hub._connections.discard(request)
        super().shutdown_request(request)


class HubServer:
    """The local Hub, serving from a background thread on ``127.0.0.1`` and a free port.

    Example:
        ```python
        with HubServer() as hub:
            api = HfApi(endpoint=hub.url, token=TOKENS["write"])
            hub.inject(status=500, count=2)      # the next 2 write requests answer 500
        ```
    """

    def __init__(self, *, seed: bool = True) -> None:
        self._state = HubState()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when the last request in progress is answered
        self._in_progress = 0
        self._faults: list[_Fault] = []
        self._wake = threading.Event()
        self._down = False
        self._connections: set[socket.socket] = set()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self.requests: list[RequestRecord] = []
        self.url = ""
        #: Xet: True serves it (the token routes and ``/cas``, tests/xetcas.py); False answers the token routes 404,
        #: as a Hub without Xet does (huggingface_hub #4507)
        self.xet = True
        self.cas = XetCas()
        self.xet_storage_url: str | None = None  # another storage the token routes name (silent_xet_storage)
        self._silent: list[socket.socket] = []
        if seed:
            self._seed()

    # -- lifecycle --------------------------------------------------------------------------------------------

    def start(self) -> HubServer:
        """Bind ``127.0.0.1`` on a free port and serve from a daemon thread; sets ``url``."""
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.hub = self
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="hubserver", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and drop every open connection (keep-alive ones included)."""
        self._wake.set()
        for sock in self._silent:
            with contextlib.suppress(OSError):
                sock.close()
        self._silent.clear()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            with self._lock:
                open_connections = list(self._connections)
            for conn in open_connections:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
            self._server = None

    def silent_xet_storage(self) -> str:
        """Point the xet token routes at a local address that accepts connections and never answers (a hung
        storage backend); returns its URL. Closed by ``stop``. From then on LFS files are served as Xet-backed
        (``X-Xet-Hash`` and ``X-Xet-Refresh-Route`` on resolve), so that downloads go through hf_xet too."""
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        self._silent.append(listener)

        def hold() -> None:  # accept and keep every connection open, reading nothing, answering nothing
            while True:
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return
                self._silent.append(conn)

        threading.Thread(target=hold, name="silent-xet", daemon=True).start()
        self.xet_storage_url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        return self.xet_storage_url

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def env(self, *, token: str | None = None, hf_home: str | os.PathLike[str] | None = None,
            xet: bool = True) -> dict[str, str]:
        """Environment variables that point a new process's ``huggingface_hub`` here (merge into ``os.environ``);
        ``xet=False`` turns the client's Xet transfer off (``client_env``)."""
        env = client_env(self.url, xet=xet)
        if token is not None:
            env["HF_TOKEN"] = token
        if hf_home is not None:
            env["HF_HOME"] = os.fspath(hf_home)
        return env

    # -- faults and the request log ---------------------------------------------------------------------------

    def inject(self, status: int | None = None, *, count: int | None = None, latency_s: float = 0.0,
               methods: tuple[str, ...] | None = None, path_contains: str | None = None,
               headers: dict[str, str] | None = None) -> None:
        """Add a fault for the requests that match ``methods`` and ``path_contains``.

        Args:
            status: answer this status instead of serving (with ``X-Error-Message``); None: serve normally.
            count: how many matching requests take the fault; default 1 with a ``status``, else until reset.
            latency_s: seconds each matching request waits before it is answered.
            methods: HTTP methods that match; default the write methods (POST, PUT, DELETE) for a status fault,
                every method for pure latency.
            path_contains: only requests whose raw path contains this string match.
            headers: extra headers of a status fault's answer (``{"Retry-After": "271"}``).
        """
        if status is None and latency_s <= 0:
            raise ValueError("inject() needs a status or a latency_s")
        if methods is None and status is not None:
            methods = _WRITE_METHODS
        if count is None and status is not None:
            count = 1
        with self._lock:
            self._faults.append(_Fault(status, count, methods, path_contains, latency_s, headers))

    def reset_faults(self, settle_s: float = 5.0) -> None:
        """Remove every fault, wake requests waiting on injected latency, and come back up.

        Waits up to ``settle_s`` seconds for the requests in progress (those just woken) to be logged, so that
        a request a test gave up on is not logged into the next test's ``requests``.
        """
        with self._lock:
            self._faults.clear()
            self._down = False
            self._wake.set()
            self._wake = threading.Event()
            self._idle.wait_for(lambda: self._in_progress == 0, timeout=settle_s)

    def _begin(self) -> None:
        with self._lock:
            self._in_progress += 1

    def _end(self) -> None:
        with self._lock:
            self._in_progress -= 1
            if self._in_progress == 0:
                self._idle.notify_all()

    def set_down(self, down: bool = True) -> None:
        """While down, every connection and request is dropped without an answer."""
        self._down = down

    def _take_fault(self, method: str, path: str) -> _Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.matches(method, path) and (fault.count is None or fault.count > 0):
                    if fault.count is not None:
                        fault.count -= 1
                    return fault
        return None

    def _log(self, method: str, path: str, status: int) -> None:
        with self._lock:
            self.requests.append(RequestRecord(method, path, status))

    def _xet_uploaded(self, repo: tuple[str, str], files: dict[str, bytes]) -> None:
        """Files a shard registered through a write token of ``repo`` ((type, id)): sha256 -> bytes. They become
        LFS objects of the repo, which a commit's ``lfsFile`` then names by that sha256."""
        with self._state.lock:
            for sha256, data in files.items():
                self._state.lfs_store.setdefault(sha256, data)
            found = self._state.repos.get((repo[0], repo[1]))
            if found is not None:
                found.lfs_oids.update(files)

    # -- helpers for tests ------------------------------------------------------------------------------------

    def _repo(self, repo_id: str, repo_type: str) -> Repo:
        repo = self._state.repos.get((repo_type, repo_id))
        if repo is None:
            raise KeyError(f"no {repo_type} repo {repo_id}")
        return repo

    def repo_files(self, repo_id: str, repo_type: str = "model", revision: str = "main") -> dict[str, bytes]:
        """path -> content served at ``revision`` (``.gitattributes`` included)."""
        with self._state.lock:
            record = self._repo(repo_id, repo_type).resolve(revision)
            return {path: stored.data for path, stored in record.files.items()}

    @contextlib.contextmanager
    def dated(self, date: str) -> Iterator[None]:
        """Commits made meanwhile are dated ``date`` (the Hub's format, ``2024-05-01T12:00:00.000Z``): a repo's
        history made long ago."""
        with self._state.lock:
            self._state.clock = lambda: date
        try:
            yield
        finally:
            with self._state.lock:
                self._state.clock = now_iso

    def commits(self, repo_id: str, repo_type: str = "model") -> list[CommitRecord]:
        """Every commit of the repo, oldest first (``[-1]`` is the newest); each has ``added``/``deleted``."""
        with self._state.lock:
            repo = self._repo(repo_id, repo_type)
            return [repo.commits[oid] for oid in repo.log]

    def repo_exists(self, repo_id: str, repo_type: str = "model") -> bool:
        return (repo_type, repo_id) in self._state.repos

    def is_private(self, repo_id: str, repo_type: str = "model") -> bool:
        return self._repo(repo_id, repo_type).private

    def corrupt(self, repo_id: str, path: str, *, repo_type: str = "model", revision: str = "main") -> None:
        """Flip one byte of a stored file; its recorded size, sha256 and git oid stay as they were."""
        self._state.corrupt(self._repo(repo_id, repo_type), path, revision)

    def add_repo(self, repo_id: str, files: dict[str, bytes] | None = None, *, repo_type: str = "model",
                 private: bool = False, gated: str | bool = False, granted: tuple[str, ...] = ()) -> str:
        """Create a repo directly (initial commit plus one commit with ``files``); returns the head commit id."""
        repo = self._state.create_repo(repo_type, repo_id, private=private, gated=gated, granted=set(granted))
        if not files:
            return repo.branches["main"]
        add = {p: (d, HubState.upload_mode(p, len(d), d[:512]) == "lfs", None) for p, d in files.items()}
        return self._state.commit(repo, "main", title="Add files", author=repo.namespace, add=add).oid

    def _seed(self) -> None:
        config = json.dumps(_TINY_GPT2_CONFIG, indent=2).encode()
        weights = b"\0" * 64  # a binary blob: stored as LFS, like real weights
        self.add_repo("acme/tiny-gpt2", {"config.json": config, "model.safetensors": weights,
                                         "README.md": b"# tiny-gpt2\n"})
        self.add_repo("alice/existing-model", {"config.json": config, "README.md": b"# existing-model\n"})
        self.add_repo("acme/gated-model", {"config.json": config, "model.safetensors": weights},
                      gated="manual", granted=("bob",))
        text = b"".join(b"line %d of a tiny corpus\n" % i for i in range(20))
        for name in ("tiny-text", "wikitext-mini", "wikitext-small"):
            self.add_repo(f"acme/{name}", {"README.md": f"# {name}\n".encode(), "data/train.txt": text,
                                           "data/test.txt": text[:200]}, repo_type="dataset")
