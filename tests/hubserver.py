"""A local Hub-compatible HTTP server for tests and benchmarks (stdlib ``http.server``, one thread per connection).

It speaks the part of the Hub HTTP API that ``huggingface_hub`` 2.4.0 calls (whoami-v2, repos create/delete,
repo info, tree, paths-info, preupload, commit, LFS batch/PUT/verify, resolve, list models/datasets, refs,
commits, auth-check, branch/tag); the endpoint list and the client's pitfalls are in
``shared/reference/hub-protocol.md``. The data model and permission rules live in ``tests/hubstate.py``.

How tests point the client here (chosen: **in-process, endpoint passed explicitly**):

- ``huggingface_hub`` reads ``HF_ENDPOINT`` at import time and freezes the download URL template, and under
  pytest some other module may import it first. So in-process code passes the endpoint explicitly:
  ``HfApi(endpoint=hub.url, token=TOKENS["write"])`` and its methods (``api.hf_hub_download``,
  ``api.snapshot_download`` pass ``endpoint`` through). Never patch ``constants.ENDPOINT``.
- ``HF_HUB_DISABLE_XET`` and ``HF_HUB_DISABLE_TELEMETRY`` are read on each call: in-process tests set
  ``huggingface_hub.constants.HF_HUB_DISABLE_XET = True`` (xet uploads cannot work here) and
  ``HF_HUB_DISABLE_TELEMETRY = True`` (``with client_constants():``); ``client_env()`` gives the environment for
  code imported later.
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

Not implemented: pagination (``Link: rel="next"``), multipart LFS transfers, pull requests, xet (501).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import http.server
import json
import os
import re
import secrets
import socket
import threading
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple
from urllib.parse import parse_qs, unquote, urlsplit

from tests.hubstate import TOKENS, CommitRecord, HttpError, HubState, Identity, Repo

__all__ = ["TOKENS", "CommitRecord", "HubServer", "RequestRecord", "client_constants", "client_env"]

_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space"}
_WRITE_METHODS = ("POST", "PUT", "DELETE")
_TINY_GPT2_CONFIG = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 8, "n_head": 2,
                     "n_layer": 1, "n_positions": 64, "vocab_size": 64, "bos_token_id": 0, "eos_token_id": 0}


def client_env(hub_url: str | None = None) -> dict[str, str]:
    """Environment for ``huggingface_hub`` talking to the local server (set it before the first import).

    Returns:
        ``HF_HUB_DISABLE_XET=1``, ``HF_HUB_DISABLE_TELEMETRY=1``, ``HF_HUB_OFFLINE=0`` and, when given,
        ``HF_ENDPOINT``.
    """
    env = {"HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_OFFLINE": "0"}
    if hub_url:
        env["HF_ENDPOINT"] = hub_url
    return env


@contextlib.contextmanager
def client_constants() -> Iterator[None]:
    """Set, for the ``with`` block, the ``huggingface_hub.constants`` that are read on each call: xet off (the
    local Hub cannot take xet uploads), telemetry off (no calls to other hosts), offline mode off (the tests'
    conftest sets ``HF_HUB_OFFLINE=1`` against the real Hub). Restores them afterwards."""
    from huggingface_hub import constants

    names = ("HF_HUB_DISABLE_XET", "HF_HUB_DISABLE_TELEMETRY", "HF_HUB_OFFLINE")
    saved = {name: getattr(constants, name) for name in names}
    for name, value in zip(names, (True, True, False)):
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

    def matches(self, method: str, path: str) -> bool:
        return ((self.methods is None or method in self.methods)
                and (self.path_contains is None or self.path_contains in path))


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: every answer carries Content-Length, every body is drained
    disable_nagle_algorithm = True
    timeout = 120  # an idle keep-alive connection is dropped after this
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
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
        try:
            body = self._read_body()
            fault = hub._take_fault(method, path)
            if fault is not None and fault.latency_s > 0:
                hub._wake.wait(fault.latency_s)
            if fault is not None and fault.status is not None:
                raise HttpError(fault.status, f"injected fault {fault.status}")
            status, payload, headers = _Routes(hub, self, method, body).route()
        except HttpError as err:
            status, headers = err.status, {"X-Error-Message": err.message}
            if err.code:
                headers["X-Error-Code"] = err.code
            payload = {"error": err.message}
        except Exception as err:  # a bug in the server: answer 500 rather than hang the client
            status, headers, payload = 500, {"X-Error-Message": repr(err)}, {"error": repr(err)}
        hub._log(method, path, status)
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


class _Routes:
    """One request: parse the path, check auth, call the matching endpoint. Returns (status, payload, headers)."""

    def __init__(self, hub: HubServer, handler: _Handler, method: str, body: bytes) -> None:
        self.hub, self.state, self.method, self.body = hub, hub._state, method, body
        self.headers = handler.headers
        split = urlsplit(handler.path)
        self.raw = split.path.strip("/").split("/")
        self.query = parse_qs(split.query)
        self.ident: Identity | None = None

    def json(self) -> Any:
        try:
            return json.loads(self.body or b"{}")
        except ValueError as err:
            raise HttpError(400, f"invalid JSON body: {err}") from err

    def flag(self, name: str) -> bool:
        return self.query.get(name, [""])[0].lower() in ("1", "true")

    def route(self) -> tuple[int, Any, dict[str, str]]:
        raw, method = self.raw, self.method
        if raw[0] == "_lfs" and method == "PUT" and len(raw) == 2:
            return self.lfs_put(raw[1])  # presigned-style URL: no Authorization header, the id is the secret
        self.ident = HubState.identify(self.headers.get("Authorization"))
        if raw[0] == "api" and len(raw) >= 2:
            return self.route_api(raw[1:])
        prefix = raw[0] if raw[0] in ("datasets", "spaces") else None
        rest = raw[1:] if prefix else raw
        repo_type = _TYPES[prefix] if prefix else "model"
        if len(rest) >= 3 and rest[1].endswith(".git") and rest[2:] == ["info", "lfs", "objects", "batch"]:
            return self.lfs_batch(repo_type, f"{rest[0]}/{rest[1][:-4]}")
        if len(rest) >= 3 and rest[1].endswith(".git") and rest[2:] == ["info", "lfs", "objects", "verify"]:
            return self.lfs_verify(repo_type, f"{rest[0]}/{rest[1][:-4]}")
        if len(rest) >= 5 and rest[2] == "resolve" and method in ("GET", "HEAD"):
            path = "/".join(unquote(s) for s in rest[4:])
            return self.resolve(repo_type, f"{rest[0]}/{rest[1]}", unquote(rest[3]), path)
        raise HttpError(404, f"no route for {method} /{'/'.join(raw)}")

    def route_api(self, raw: list[str]) -> tuple[int, Any, dict[str, str]]:
        method, head = self.method, raw[0]
        if raw == ["whoami-v2"]:
            if self.ident is None:
                raise HttpError(401, "Invalid username or password.")
            return 200, self.ident.whoami(), {}
        if raw == ["repos", "create"] and method == "POST":
            return self.create_repo()
        if raw == ["repos", "delete"] and method == "DELETE":
            return self.delete_repo()
        if raw == ["validate-yaml"] and method == "POST":
            return 200, {"errors": [], "warnings": []}, {}
        if head in _TYPES and len(raw) == 1 and method == "GET":
            return self.list_repos(_TYPES[head])
        if head in _TYPES and len(raw) >= 3:
            repo_type, repo_id, rest = _TYPES[head], f"{raw[1]}/{raw[2]}", raw[3:]
            op = rest[0] if rest else ""
            rev = unquote(rest[1]) if len(rest) > 1 else "main"
            table = {
                ("GET", ""): lambda: self.repo_info(repo_type, repo_id, "main"),
                ("GET", "revision"): lambda: self.repo_info(repo_type, repo_id, rev),
                ("GET", "tree"): lambda: self.tree(repo_type, repo_id, rev, "/".join(unquote(s) for s in rest[2:])),
                ("POST", "paths-info"): lambda: self.paths_info(repo_type, repo_id, rev),
                ("POST", "preupload"): lambda: self.preupload(repo_type, repo_id, rev),
                ("POST", "commit"): lambda: self.commit(repo_type, repo_id, rev),
                ("GET", "refs"): lambda: self.refs(repo_type, repo_id),
                ("GET", "commits"): lambda: self.list_commits(repo_type, repo_id, rev),
                ("GET", "auth-check"): lambda: self.auth_check(repo_type, repo_id, rest[1:] == ["write"]),
                ("POST", "branch"): lambda: self.create_ref(repo_type, repo_id, "branch", rev),
                ("POST", "tag"): lambda: self.create_ref(repo_type, repo_id, "tag", rev),
            }
            if (method, op) in table:
                return table[(method, op)]()
            if op in ("xet-write-token", "xet-read-token"):
                raise HttpError(501, "xet is not supported by the local Hub: set HF_HUB_DISABLE_XET=1")
        raise HttpError(404, f"no route for {method} /api/{'/'.join(raw)}")

    # -- repos ------------------------------------------------------------------------------------------------

    def _repo_url(self, repo: Repo) -> str:
        return f"{self.hub.url}/{repo.url_prefix}{repo.repo_id}"

    def create_repo(self) -> tuple[int, Any, dict[str, str]]:
        if self.ident is None:
            raise HttpError(401, "You must be authenticated to create a repo")
        body = self.json()
        repo_type = body.get("type") or "model"
        namespace = body.get("organization") or self.ident.user
        repo_id = f"{namespace}/{body.get('name', '')}"
        if not re.fullmatch(r"[\w.-]+/[\w.-]+", repo_id):
            raise HttpError(400, f"invalid repo name {repo_id!r}")
        with self.state.lock:
            existing = self.state.repos.get((repo_type, repo_id))
            if existing is not None:
                raise_409 = {"error": "You already created this repo", "url": self._repo_url(existing)}
                return 409, raise_409, {"X-Error-Message": "You already created this repo"}
            if not self.ident.can_write(namespace, repo_id):
                raise HttpError(403, f"You don't have the rights to create a {repo_type} under the namespace "
                                     f"{namespace!r}")
            private = body.get("visibility") == "private" or body.get("private") is True
            repo = self.state.create_repo(repo_type, repo_id, private=private)
        return 200, {"url": self._repo_url(repo), "name": repo_id, "id": repo_id}, {}

    def delete_repo(self) -> tuple[int, Any, dict[str, str]]:
        body = self.json()
        repo_type = body.get("type") or "model"
        repo_id = f"{body.get('organization') or (self.ident.user if self.ident else '')}/{body.get('name', '')}"
        with self.state.lock:
            self.state.writable_repo(repo_type, repo_id, self.ident)
            del self.state.repos[(repo_type, repo_id)]
        return 200, {}, {}

    def _info(self, repo: Repo, record: CommitRecord, *, siblings: bool = True) -> dict:
        info = {"_id": repo.repo_id, "id": repo.repo_id, "author": repo.namespace, "sha": record.oid,
                "private": repo.private, "gated": repo.gated, "disabled": False, "lastModified": record.date,
                "createdAt": repo.created_at, "tags": [], "downloads": 0, "likes": 0}
        if siblings:
            info["siblings"] = [
                {"rfilename": path, "size": f.size, "blobId": f.git_oid,
                 **({"lfs": {"sha256": f.sha256, "size": f.size, "pointerSize": f.pointer_size}} if f.lfs else {})}
                for path, f in sorted(record.files.items())]
        return info

    def repo_info(self, repo_type: str, repo_id: str, rev: str) -> tuple[int, Any, dict[str, str]]:
        with self.state.lock:
            repo = self.state.get_repo(repo_type, repo_id, self.ident)
            return 200, self._info(repo, repo.resolve(rev)), {}

    def list_repos(self, repo_type: str) -> tuple[int, Any, dict[str, str]]:
        search = self.query.get("search", [""])[0].lower()
        author = self.query.get("author", [None])[0]
        limit = int(self.query.get("limit", ["0"])[0] or 0)
        full = self.flag("full") or "siblings" in self.query.get("expand", []) + self.query.get("expand[]", [])
        out = []
        with self.state.lock:
            for (kind, repo_id), repo in sorted(self.state.repos.items()):
                visible = not repo.private or (self.ident is not None and self.ident.can_read(repo.namespace, repo_id))
                if kind == repo_type and visible and search in repo_id.lower() and author in (None, repo.namespace):
                    out.append(self._info(repo, repo.resolve("main"), siblings=full))
        return 200, out[:limit] if limit > 0 else out, {}

    def refs(self, repo_type: str, repo_id: str) -> tuple[int, Any, dict[str, str]]:
        with self.state.lock:
            repo = self.state.get_repo(repo_type, repo_id, self.ident)
            def fmt(kind: str, refs: dict[str, str]) -> list[dict]:
                return [{"name": n, "ref": f"refs/{kind}/{n}", "targetCommit": oid} for n, oid in sorted(refs.items())]
            out = {"branches": fmt("heads", repo.branches), "tags": fmt("tags", repo.tags), "converts": []}
            if self.flag("include_prs"):
                out["pullRequests"] = []
            return 200, out, {}

    def list_commits(self, repo_type: str, repo_id: str, rev: str) -> tuple[int, Any, dict[str, str]]:
        with self.state.lock:
            repo = self.state.get_repo(repo_type, repo_id, self.ident)
            history = repo.history(repo.resolve(rev).oid)
        return 200, [{"id": c.oid, "title": c.title, "message": c.message, "date": c.date,
                      "authors": [{"user": c.author}]} for c in history], {}

    def auth_check(self, repo_type: str, repo_id: str, write: bool) -> tuple[int, Any, dict[str, str]]:
        with self.state.lock:
            repo = (self.state.writable_repo if write else self.state.get_repo)(repo_type, repo_id, self.ident)
            if not write:
                HubState.check_gate(repo, self.ident)
        return 200, {}, {}

    def create_ref(self, repo_type: str, repo_id: str, kind: str, name: str) -> tuple[int, Any, dict[str, str]]:
        body = self.json()
        with self.state.lock:
            repo = self.state.writable_repo(repo_type, repo_id, self.ident)
            if kind == "branch":
                if name in repo.branches:
                    raise HttpError(409, f"Branch {name} already exists")
                repo.branches[name] = repo.resolve(body.get("startingPoint") or "main").oid
            else:  # POST tag/{revision} {"tag": name}
                tag = body.get("tag", "")
                if tag in repo.tags:
                    raise HttpError(409, f"Tag {tag} already exists")
                repo.tags[tag] = repo.resolve(name).oid
        return 200, {}, {}

    # -- files ------------------------------------------------------------------------------------------------

    def _readable_commit(self, repo_type: str, repo_id: str, rev: str) -> tuple[Repo, CommitRecord]:
        repo = self.state.get_repo(repo_type, repo_id, self.ident)
        return repo, repo.resolve(rev)

    @staticmethod
    def _folders(files: dict) -> set[str]:
        return {"/".join(p.split("/")[:i]) for p in files for i in range(1, p.count("/") + 1)}

    def _entry(self, repo: Repo, record: CommitRecord, path: str, expand: bool) -> dict | None:
        if path in record.files:
            stored = record.files[path]
            return stored.entry(path, repo.commits[stored.commit] if expand else None)
        if path in self._folders(record.files):
            oid = self.state.new_oid(record.oid, path)
            return {"type": "directory", "oid": oid, "size": 0, "path": path}
        return None

    def tree(self, repo_type: str, repo_id: str, rev: str, path: str) -> tuple[int, Any, dict[str, str]]:
        recursive, expand = self.flag("recursive"), self.flag("expand")
        with self.state.lock:
            repo, record = self._readable_commit(repo_type, repo_id, rev)
            prefix = path.strip("/") + "/" if path.strip("/") else ""
            if prefix and prefix[:-1] not in self._folders(record.files):
                raise HttpError(404, f"Entry not found: {path}", "EntryNotFound")
            names = sorted(set(record.files) | self._folders(record.files))
            out = []
            for name in names:
                if not name.startswith(prefix) or (not recursive and "/" in name[len(prefix):]):
                    continue
                out.append(self._entry(repo, record, name, expand))
        return 200, out, {}

    def paths_info(self, repo_type: str, repo_id: str, rev: str) -> tuple[int, Any, dict[str, str]]:
        form = parse_qs(self.body.decode())
        expand = form.get("expand", ["false"])[0].lower() in ("1", "true")
        with self.state.lock:
            repo, record = self._readable_commit(repo_type, repo_id, rev)
            entries = [self._entry(repo, record, p.strip("/"), expand) for p in form.get("paths", [])]
        return 200, [e for e in entries if e is not None], {}

    def resolve(self, repo_type: str, repo_id: str, rev: str, path: str) -> tuple[int, Any, dict[str, str]]:
        with self.state.lock:
            repo, record = self._readable_commit(repo_type, repo_id, rev)
            HubState.check_gate(repo, self.ident)
            stored = record.files.get(path)
            if stored is None:
                raise HttpError(404, f"Entry not found: {path}", "EntryNotFound")
        etag = stored.sha256 if stored.lfs else stored.git_oid
        headers = {"X-Repo-Commit": record.oid, "ETag": f'"{etag}"', "Accept-Ranges": "bytes"}
        if stored.lfs:
            headers.update({"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(stored.size)})
        data = memoryview(stored.data)
        match = re.fullmatch(r"bytes=(\d*)-(\d*)", self.headers.get("Range", ""))
        if match and self.method == "GET":
            start = int(match[1] or 0)
            end = min(int(match[2]) if match[2] else len(data) - 1, len(data) - 1)
            if start > end:
                raise HttpError(416, "Requested range not satisfiable")
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            return 206, data[start:end + 1], headers
        return 200, data, headers

    # -- uploads ----------------------------------------------------------------------------------------------

    def _gitignore(self, record: CommitRecord, payload: dict) -> str | None:
        if "gitIgnore" in payload:
            return payload["gitIgnore"]
        stored = record.files.get(".gitignore")
        return stored.data.decode(errors="replace") if stored else None

    def preupload(self, repo_type: str, repo_id: str, rev: str) -> tuple[int, Any, dict[str, str]]:
        if self.flag("create_pr"):
            raise HttpError(400, "pull requests are not supported by the local Hub")
        payload = self.json()
        with self.state.lock:
            repo = self.state.writable_repo(repo_type, repo_id, self.ident)
            record = repo.resolve(rev)
            gitignore = self._gitignore(record, payload)
            out = []
            for item in payload.get("files", []):
                path = item["path"]
                mode = HubState.upload_mode(path, int(item["size"]), base64.b64decode(item.get("sample", "")))
                answer = {"path": path, "uploadMode": mode, "shouldIgnore": HubState.ignored(path, gitignore)}
                if path in record.files:
                    existing = record.files[path]
                    answer["oid"] = existing.sha256 if existing.lfs else existing.git_oid
                out.append(answer)
        return 200, {"files": out, "commitOid": record.oid}, {}

    def lfs_batch(self, repo_type: str, repo_id: str) -> tuple[int, Any, dict[str, str]]:
        payload = self.json()
        if payload.get("operation") != "upload":
            raise HttpError(400, "only LFS uploads are supported by the local Hub")
        objects = []
        with self.state.lock:
            repo = self.state.writable_repo(repo_type, repo_id, self.ident)
            for obj in payload.get("objects", []):
                oid, size = obj["oid"], int(obj["size"])
                item: dict = {"oid": oid, "size": size}
                if oid not in repo.lfs_oids:  # no "actions": the object is already stored
                    upload_id = secrets.token_hex(16)
                    self.state.uploads[upload_id] = ((repo_type, repo_id), oid, size)
                    base = f"{self.hub.url}/{repo.url_prefix}{repo_id}.git/info/lfs/objects"
                    item["actions"] = {"upload": {"href": f"{self.hub.url}/_lfs/{upload_id}", "header": {}},
                                       "verify": {"href": f"{base}/verify", "header": {}}}
                objects.append(item)
        return 200, {"transfer": "basic", "objects": objects, "hash_algo": "sha256"}, {}

    def lfs_put(self, upload_id: str) -> tuple[int, Any, dict[str, str]]:
        with self.state.lock:
            pending = self.state.uploads.get(upload_id)
        if pending is None:
            raise HttpError(403, "unknown or expired upload URL")
        key, oid, size = pending
        if len(self.body) != size or hashlib.sha256(self.body).hexdigest() != oid:
            raise HttpError(400, f"content does not match oid {oid} and size {size}")
        with self.state.lock:
            self.state.lfs_store.setdefault(oid, bytes(self.body))
            self.state.uploads.pop(upload_id, None)
            repo = self.state.repos.get(key)
            if repo is not None:
                repo.lfs_oids.add(oid)
        return 200, None, {"ETag": f'"{oid}"'}

    def lfs_verify(self, repo_type: str, repo_id: str) -> tuple[int, Any, dict[str, str]]:
        payload = self.json()
        with self.state.lock:
            repo = self.state.writable_repo(repo_type, repo_id, self.ident)
            oid = payload.get("oid")
            if oid not in repo.lfs_oids or len(self.state.lfs_store[oid]) != int(payload.get("size", -1)):
                raise HttpError(404, f"LFS object {oid} not found")
        return 200, {}, {}

    def commit(self, repo_type: str, repo_id: str, rev: str) -> tuple[int, Any, dict[str, str]]:
        if self.flag("create_pr"):
            raise HttpError(400, "pull requests are not supported by the local Hub")
        try:
            items = [json.loads(line) for line in self.body.splitlines() if line.strip()]
        except ValueError as err:
            raise HttpError(400, f"invalid ndjson: {err}") from err
        if not items or items[0].get("key") != "header":
            raise HttpError(400, "the first ndjson line must be the header")
        header = items[0]["value"]
        add: dict[str, tuple[bytes, bool, str | None]] = {}
        delete: list[str] = []
        delete_folders: list[str] = []
        with self.state.lock:
            repo = self.state.writable_repo(repo_type, repo_id, self.ident)
            for item in items[1:]:
                key, value = item.get("key"), item.get("value", {})
                if key == "file":
                    try:
                        add[value["path"]] = (base64.b64decode(value["content"], validate=True), False, None)
                    except (binascii.Error, KeyError) as err:
                        raise HttpError(400, f"bad file line: {err}") from err
                elif key == "lfsFile":
                    oid = value.get("oid", "")
                    if oid not in repo.lfs_oids:
                        raise HttpError(422, f"LFS object {oid} was not uploaded to {repo_id}")
                    data = self.state.lfs_store[oid]
                    if value.get("size") is not None and int(value["size"]) != len(data):
                        raise HttpError(422, f"LFS object {oid} has size {len(data)}, not {value['size']}")
                    add[value["path"]] = (data, True, oid)
                elif key == "deletedFile":
                    delete.append(value["path"])
                elif key == "deletedFolder":
                    delete_folders.append(value["path"])
                else:
                    raise HttpError(400, f"unknown ndjson key {key!r}")
            record = self.state.commit(
                repo, rev, title=header.get("summary", ""), message=header.get("description", ""),
                author=self.ident.user if self.ident else "anonymous", add=add, delete=tuple(delete),
                delete_folders=tuple(delete_folders), parent=header.get("parentCommit"))
        return 200, {"commitOid": record.oid, "commitUrl": f"{self._repo_url(repo)}/commit/{record.oid}",
                     "pullRequestUrl": None, "success": True}, {}


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
        self._faults: list[_Fault] = []
        self._wake = threading.Event()
        self._down = False
        self._connections: set[socket.socket] = set()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self.requests: list[RequestRecord] = []
        self.url = ""
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
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            with self._lock:
                open_connections = list(self._connections)
            for conn in open_connections:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
            self._server = None

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def env(self, *, token: str | None = None, hf_home: str | os.PathLike[str] | None = None) -> dict[str, str]:
        """Environment variables that point a new process's ``huggingface_hub`` here (merge into ``os.environ``)."""
        env = client_env(self.url)
        if token is not None:
            env["HF_TOKEN"] = token
        if hf_home is not None:
            env["HF_HOME"] = os.fspath(hf_home)
        return env

    # -- faults and the request log ---------------------------------------------------------------------------

    def inject(self, status: int | None = None, *, count: int | None = None, latency_s: float = 0.0,
               methods: tuple[str, ...] | None = None, path_contains: str | None = None) -> None:
        """Add a fault for the requests that match ``methods`` and ``path_contains``.

        Args:
            status: answer this status instead of serving (with ``X-Error-Message``); None: serve normally.
            count: how many matching requests take the fault; default 1 with a ``status``, else until reset.
            latency_s: seconds each matching request waits before it is answered.
            methods: HTTP methods that match; default the write methods (POST, PUT, DELETE) for a status fault,
                every method for pure latency.
            path_contains: only requests whose raw path contains this string match.
        """
        if status is None and latency_s <= 0:
            raise ValueError("inject() needs a status or a latency_s")
        if methods is None and status is not None:
            methods = _WRITE_METHODS
        if count is None and status is not None:
            count = 1
        with self._lock:
            self._faults.append(_Fault(status, count, methods, path_contains, latency_s))

    def reset_faults(self) -> None:
        """Remove every fault, wake requests waiting on injected latency, and come back up."""
        with self._lock:
            self._faults.clear()
            self._down = False
            self._wake.set()
            self._wake = threading.Event()

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
