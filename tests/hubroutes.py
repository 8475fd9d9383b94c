"""The endpoints of the local Hub test server (``tests/hubserver.py``): one ``Routes`` object per request.

Each endpoint follows what ``huggingface_hub`` 2.4.0 sends and parses (``shared/reference/hub-protocol.md``); the
state and the permission rules are in ``tests/hubstate.py``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
import secrets
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote, urlsplit

from tests.hubstate import CommitRecord, HttpError, HubState, Identity, Repo, StoredFile

if TYPE_CHECKING:
    from http.server import BaseHTTPRequestHandler

    from tests.hubserver import HubServer

__all__ = ["Routes"]

TYPES = {"models": "model", "datasets": "dataset", "spaces": "space"}


class Routes:
    """One request: parse the path, check auth, call the matching endpoint. Returns (status, payload, headers)."""

    def __init__(self, hub: HubServer, handler: BaseHTTPRequestHandler, method: str, body: bytes) -> None:
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
        if raw[0] == "cas" and self.hub.xet:
            return self.hub.cas.route(self, raw[1:])  # the Xet storage: its own access tokens (tests/xetcas.py)
        self.ident = HubState.identify(self.headers.get("Authorization"))
        if raw[0] == "api" and len(raw) >= 2:
            return self.route_api(raw[1:])
        prefix = raw[0] if raw[0] in ("datasets", "spaces") else None
        rest = raw[1:] if prefix else raw
        repo_type = TYPES[prefix] if prefix else "model"
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
        if head in TYPES and len(raw) == 1 and method == "GET":
            return self.list_repos(TYPES[head])
        if head in TYPES and len(raw) >= 3:
            repo_type, repo_id, rest = TYPES[head], f"{raw[1]}/{raw[2]}", raw[3:]
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
                return self.xet_token(repo_type, repo_id, write=op == "xet-write-token")
        raise HttpError(404, f"no route for {method} /api/{'/'.join(raw)}")

    def xet_token(self, repo_type: str, repo_id: str, *, write: bool) -> tuple[int, Any, dict[str, str]]:
        """Xet connection info (``huggingface_hub.utils._xet``: headers ``X-Xet-Cas-Url``, ``X-Xet-Access-Token``,
        ``X-Xet-Token-Expiration``; the body ``{casUrl, accessToken, exp}`` of hub-docs ``docs/xet/auth.md``).

        ``hub.xet`` False: 404 with no error code, as a Hub without Xet answers (an unknown route; huggingface_hub
        #4507). ``hub.xet_storage_url`` set (``silent_xet_storage``): that URL. Else this server's own storage
        (``/cas``, ``tests/xetcas.py``) with a token scoped to the repo, after the same checks as a read or a
        write of the repo."""
        if not self.hub.xet:
            raise HttpError(404, "Not Found")
        with self.state.lock:
            if write:
                self.state.writable_repo(repo_type, repo_id, self.ident)
            else:
                HubState.check_gate(self.state.get_repo(repo_type, repo_id, self.ident), self.ident)
        url = self.hub.xet_storage_url
        if url is not None:
            token, expires = "xet-local-token", int(time.time()) + 3600
        else:
            url = f"{self.hub.url}/cas"
            token, expires = self.hub.cas.mint(repo_type, repo_id, write=write)
        return 200, {"casUrl": url, "accessToken": token, "exp": expires}, {
            "X-Xet-Cas-Url": url, "X-Xet-Access-Token": token, "X-Xet-Token-Expiration": str(expires)}

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
            item = stored.entry(path, repo.commits[stored.commit] if expand else None)
            xet_hash = self._xet_hash(stored) if stored.lfs and self.hub.xet_storage_url is None else None
            if xet_hash is not None:
                item["xetHash"] = xet_hash  # as the real Hub lists a Xet-backed file
            return item
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
            xet_hash = self._xet_hash(stored)
            if xet_hash is not None:
                # Xet-backed, as on the real Hub: the client downloads through hf_xet from the storage the read
                # token route names (``huggingface_hub.utils._xet.parse_xet_file_data_from_response``).
                headers.update({"X-Xet-Hash": xet_hash, "X-Xet-Refresh-Route":
                                f"{self.hub.url}/api/{repo_type}s/{repo_id}/xet-read-token/{record.oid}"})
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

    def _xet_hash(self, stored: StoredFile) -> str | None:
        """The Xet file id the resolve answer names (``X-Xet-Hash``), or None: served over plain HTTP.

        With ``silent_xet_storage`` every LFS file is named (the storage never answers anyway). Else a file
        uploaded through this server's Xet storage, while the bytes served are the ones uploaded (``corrupt``
        changes the served bytes only; its file is then served over plain HTTP, so that the client sees them).
        Files uploaded over plain LFS have no xet hash (computing one takes BLAKE3, not in the standard library)."""
        if not self.hub.xet:
            return None
        if self.hub.xet_storage_url is not None:
            return stored.sha256
        file_id = self.hub.cas.file_id_for(stored.sha256)
        if file_id is None or self.state.lfs_store.get(stored.sha256) is not stored.data:
            return None
        return file_id

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
                    # also a copy (``CommitOperationCopy`` of an LFS or Xet file): huggingface_hub sends the source's
                    # sha256 with no size (``_commit_api._prepare_commit_payload``) and the Hub points the new path
                    # at the object it already stores, no byte sent again; an object never uploaded to this repo is
                    # refused (a copy from another repo is duplicated into it first, ``HfApi._duplicate_lfs_files``).
                    # A regular file's copy is downloaded by the client and sent as a ``file`` line.
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
