"""State of the local Hub test server (``tests/hubserver.py``): tokens, users, repos, commits, permissions.

Pure data and rules, no HTTP: the server's handler translates requests into calls on ``HubState`` and its
``HttpError`` exceptions into responses. Facts about the real Hub that are emulated here (the whoami-v2 token
shapes, the initial ``.gitattributes`` commit, LFS pointer oids, git blob oids) come from
``shared/reference/hub-protocol.md``.
"""

from __future__ import annotations

import fnmatch
import hashlib
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone

__all__ = ["TOKENS", "USERS", "CommitRecord", "HttpError", "HubState", "Identity", "git_blob_oid", "now_iso"]

#: Seeded tokens. Each looks like a real Hub token (``hf_`` + 30 or more letters) so masking applies to them.
TOKENS: dict[str, str] = {
    "write": "hf_AliceWriteRoleTokenForTheLocalHubTests",
    "read": "hf_AliceReadRoleTokenForTheLocalHubTestsX",
    "fine_alice": "hf_AliceFineGrainedTokenForTheLocalHubTests",
    "other": "hf_BobWriteRoleTokenForTheLocalHubTestsXX",
    "invalid": "hf_ThisTokenIsUnknownToTheLocalHubTestsXX",
}

#: Seeded users: name -> (full name, {org: role in org}).
USERS: dict[str, tuple[str, dict[str, str]]] = {"alice": ("Alice", {"acme": "write"}), "bob": ("Bob", {})}
ORGS = frozenset({"acme"})

_FINE_ALICE = {
    "canReadGatedRepos": False,
    "global": [],
    "scoped": [{"entity": {"type": "user", "name": "alice"}, "permissions": ["repo.content.read", "repo.write"]}],
}
#: token -> (user, role, fineGrained block or None)
_TOKEN_INFO: dict[str, tuple[str, str, dict | None]] = {
    TOKENS["write"]: ("alice", "write", None),
    TOKENS["read"]: ("alice", "read", None),
    TOKENS["fine_alice"]: ("alice", "fineGrained", _FINE_ALICE),
    TOKENS["other"]: ("bob", "write", None),
}

GITATTRIBUTES = b"".join(
    f"{pattern} filter=lfs diff=lfs merge=lfs -text\n".encode()
    for pattern in ("*.bin", "*.ckpt", "*.h5", "*.msgpack", "*.npy", "*.npz", "*.onnx", "*.pkl", "*.pt",
                    "*.pth", "*.safetensors", "*.parquet", "*.arrow", "*.gz", "*.zip", "*.tar")
)
_LFS_PATTERNS = tuple(line.split()[0].decode() for line in GITATTRIBUTES.splitlines())
LFS_THRESHOLD_BYTES = 10 * 1024 * 1024  # the real Hub refuses regular files over 10 MB


def now_iso() -> str:
    """The current UTC time in the Hub's format (``2024-05-01T12:00:00.000Z``)."""
    now = datetime.now(timezone.utc)
    return now.strftime("%Y-%m-%dT%H:%M:%S.") + f"{now.microsecond // 1000:03d}Z"


def git_blob_oid(data: bytes) -> str:
    """The git blob sha1 of ``data`` (``git hash-object``): what the Hub reports as a regular file's oid."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


class HttpError(Exception):
    """An error answer: status, message (``X-Error-Message``) and the Hub's ``X-Error-Code`` when it has one."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


@dataclass(frozen=True)
class Identity:
    """Who a token belongs to."""

    token: str
    user: str
    role: str  # "read" | "write" | "fineGrained"
    fine_grained: dict | None

    def orgs(self) -> dict[str, str]:
        return USERS[self.user][1]

    def member_of(self, namespace: str) -> bool:
        return namespace == self.user or namespace in self.orgs()

    def _scoped(self, namespace: str, repo_id: str | None, permission: str) -> bool:
        block = self.fine_grained or {}
        if permission in block.get("global", []):
            return True
        for scope in block.get("scoped", []):
            entity = scope["entity"]
            if permission not in scope["permissions"]:
                continue
            if entity["type"] in ("user", "org") and entity["name"] == namespace:
                return True
            if entity["type"] in ("model", "dataset", "space") and entity["name"] == repo_id:
                return True
        return False

    def can_read(self, namespace: str, repo_id: str) -> bool:
        if not self.member_of(namespace):
            return False
        if self.role == "fineGrained":
            return any(self._scoped(namespace, repo_id, p) for p in ("repo.content.read", "repo.write"))
        return True

    def can_write(self, namespace: str, repo_id: str | None) -> bool:
        if not self.member_of(namespace):
            return False
        if self.role == "write":
            return namespace == self.user or self.orgs().get(namespace) in ("write", "admin")
        if self.role == "fineGrained":
            return self._scoped(namespace, repo_id, "repo.write")
        return False

    def whoami(self) -> dict:
        access_token: dict = {"displayName": f"{self.user}-{self.role}", "role": self.role,
                              "createdAt": "2024-01-01T00:00:00.000Z"}
        if self.fine_grained is not None:
            access_token["fineGrained"] = self.fine_grained
        return {
            "type": "user", "id": hashlib.sha1(self.user.encode()).hexdigest()[:24], "name": self.user,
            "fullname": USERS[self.user][0], "email": f"{self.user}@example.com", "emailVerified": True,
            "canPay": False, "isPro": False,
            "orgs": [{"type": "org", "name": org, "fullname": org.title(), "roleInOrg": role}
                     for org, role in self.orgs().items()],
            "auth": {"type": "access_token", "accessToken": access_token},
        }


@dataclass(frozen=True)
class StoredFile:
    """One file version. ``size``, ``sha256`` and ``git_oid`` are what the Hub *recorded*; ``data`` is what it
    serves (``HubServer.corrupt`` changes ``data`` only)."""

    data: bytes = field(repr=False)
    size: int
    sha256: str
    git_oid: str  # git blob sha1 of the content (regular) or of the LFS pointer (lfs)
    lfs: bool
    commit: str  # the commit that wrote this version

    @classmethod
    def make(cls, data: bytes, *, lfs: bool, commit: str, sha256: str | None = None) -> StoredFile:
        sha = sha256 or hashlib.sha256(data).hexdigest()
        oid = git_blob_oid(_lfs_pointer(sha, len(data)) if lfs else data)
        return cls(data=data, size=len(data), sha256=sha, git_oid=oid, lfs=lfs, commit=commit)

    @property
    def pointer_size(self) -> int:
        return len(_lfs_pointer(self.sha256, self.size))

    def entry(self, path: str, expand_commit: CommitRecord | None = None) -> dict:
        """The tree / paths-info entry of this file (``lfs.oid`` is the sha256, ``oid`` the git oid)."""
        item: dict = {"type": "file", "oid": self.git_oid, "size": self.size, "path": path}
        if self.lfs:
            item["lfs"] = {"oid": self.sha256, "size": self.size, "pointerSize": self.pointer_size}
        if expand_commit is not None:
            item["lastCommit"] = {"id": expand_commit.oid, "title": expand_commit.title, "date": expand_commit.date}
        return item


@dataclass(frozen=True)
class CommitRecord:
    """One commit: a full snapshot of the files plus what it changed (``added`` includes modified files)."""

    oid: str
    parent: str | None
    title: str
    message: str
    author: str
    date: str
    files: dict[str, StoredFile] = field(repr=False)
    added: tuple[str, ...]
    deleted: tuple[str, ...]


@dataclass
class Repo:
    repo_type: str  # "model" | "dataset" | "space"
    repo_id: str
    private: bool
    gated: str | bool = False
    granted: set[str] = field(default_factory=set)
    created_at: str = field(default_factory=now_iso)
    commits: dict[str, CommitRecord] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)  # commit oids, oldest first
    branches: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    lfs_oids: set[str] = field(default_factory=set)

    @property
    def namespace(self) -> str:
        return self.repo_id.split("/")[0]

    @property
    def url_prefix(self) -> str:
        return "" if self.repo_type == "model" else f"{self.repo_type}s/"

    def resolve(self, revision: str) -> CommitRecord:
        """A branch, a tag or a commit id (40 hex) -> the commit; ``RevisionNotFound`` otherwise."""
        oid = self.branches.get(revision) or self.tags.get(revision)
        if oid is None and revision in self.commits:
            oid = revision
        if oid is None:
            raise HttpError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return self.commits[oid]

    def history(self, oid: str) -> list[CommitRecord]:
        """The commit and its ancestors, newest first."""
        out = []
        current: str | None = oid
        while current is not None:
            out.append(self.commits[current])
            current = self.commits[current].parent
        return out


class HubState:
    """Every repo and LFS object of one server, guarded by one lock (the handler threads share it)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.repos: dict[tuple[str, str], Repo] = {}
        self.lfs_store: dict[str, bytes] = {}  # sha256 -> content (shared by repos)
        self.uploads: dict[str, tuple[tuple[str, str], str, int]] = {}  # upload id -> (repo key, oid, size)
        self._counter = itertools.count(1)
        self.clock: Callable[[], str] = now_iso  # a commit's date (``HubServer.dated``)

    # -- identities and lookups ------------------------------------------------------------------------------

    @staticmethod
    def identify(authorization: str | None) -> Identity | None:
        """``Authorization: Bearer <token>`` -> Identity; no header -> None; unknown token -> 401."""
        if not authorization:
            return None
        token = authorization.removeprefix("Bearer ").strip()
        if token not in _TOKEN_INFO:
            raise HttpError(401, "Invalid credentials in Authorization header")
        user, role, fine = _TOKEN_INFO[token]
        return Identity(token, user, role, fine)

    def get_repo(self, repo_type: str, repo_id: str, ident: Identity | None) -> Repo:
        """The repo if the caller may see it; else ``RepoNotFound`` (401 anonymous, 404 authenticated)."""
        repo = self.repos.get((repo_type, repo_id))
        if repo is None or (repo.private and (ident is None or not ident.can_read(repo.namespace, repo_id))):
            raise HttpError(401 if ident is None else 404, "Repository not found", "RepoNotFound")
        return repo

    def writable_repo(self, repo_type: str, repo_id: str, ident: Identity | None) -> Repo:
        repo = self.get_repo(repo_type, repo_id, ident)
        if ident is None:
            raise HttpError(401, "You must be authenticated to write to this repo")
        if not ident.can_write(repo.namespace, repo_id):
            raise HttpError(403, f"You don't have write access to {repo_id}")
        return repo

    @staticmethod
    def check_gate(repo: Repo, ident: Identity | None) -> None:
        """File content of a gated repo needs access granted to the user (only ``granted``, as seeded)."""
        if repo.gated and (ident is None or ident.user not in repo.granted):
            raise HttpError(401 if ident is None else 403,
                            f"Access to model {repo.repo_id} is restricted. You must have access to it.", "GatedRepo")

    # -- repos and commits ------------------------------------------------------------------------------------

    def new_oid(self, *parts: str) -> str:
        seed = ":".join((*parts, str(next(self._counter)), now_iso()))
        return hashlib.sha1(seed.encode()).hexdigest()

    def create_repo(self, repo_type: str, repo_id: str, *, private: bool, gated: str | bool = False,
                    granted: set[str] | None = None) -> Repo:
        with self.lock:
            repo = Repo(repo_type, repo_id, private, gated, set(granted or ()))
            oid = self.new_oid(repo_id, "initial")
            files = {".gitattributes": StoredFile.make(GITATTRIBUTES, lfs=False, commit=oid)}
            repo.commits[oid] = CommitRecord(oid, None, "initial commit", "", "system", now_iso(), files,
                                             (".gitattributes",), ())
            repo.log.append(oid)
            repo.branches["main"] = oid
            self.repos[(repo_type, repo_id)] = repo
            return repo

    def commit(self, repo: Repo, branch: str, *, title: str, message: str = "", author: str = "system",
               add: dict[str, tuple[bytes, bool, str | None]] | None = None, delete: tuple[str, ...] = (),
               delete_folders: tuple[str, ...] = (), parent: str | None = None) -> CommitRecord:
        """Make a commit on ``branch``. ``add``: path -> (content, is_lfs, sha256 or None)."""
        with self.lock:
            if branch not in repo.branches:
                raise HttpError(404, f"Invalid rev id: {branch}", "RevisionNotFound")
            head = repo.commits[repo.branches[branch]]
            if parent is not None and parent != head.oid:
                raise HttpError(412, "A commit has happened since. Please refresh and try again.")
            oid = self.new_oid(repo.repo_id, head.oid, title)
            files = dict(head.files)
            deleted: list[str] = []
            for path in delete:
                if path not in files:
                    raise HttpError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
                del files[path]
                deleted.append(path)
            for folder in delete_folders:
                prefix = folder.rstrip("/") + "/"
                gone = [p for p in files if p.startswith(prefix)]
                if not gone:
                    raise HttpError(404, f"A folder with this name doesn't exist: {folder}", "EntryNotFound")
                for path in gone:
                    del files[path]
                deleted.extend(gone)
            for path, (data, lfs, sha256) in (add or {}).items():
                files[path] = StoredFile.make(data, lfs=lfs, commit=oid, sha256=sha256)
            record = CommitRecord(oid, head.oid, title, message, author, self.clock(), files,
                                  tuple(add or ()), tuple(p for p in deleted if p not in (add or {})))
            repo.commits[oid] = record
            repo.log.append(oid)
            repo.branches[branch] = oid
            return record

    def corrupt(self, repo: Repo, path: str, revision: str = "main") -> None:
        """Flip the first byte of the stored content at ``revision`` (recorded size and hashes unchanged)."""
        with self.lock:
            record = repo.resolve(revision)
            stored = record.files[path]
            if not stored.data:
                raise ValueError(f"{path} is empty: nothing to corrupt")
            flipped = bytes([stored.data[0] ^ 0xFF]) + stored.data[1:]
            record.files[path] = replace(stored, data=flipped)

    # -- upload rules -----------------------------------------------------------------------------------------

    @staticmethod
    def upload_mode(path: str, size: int, sample: bytes) -> str:
        """``lfs`` for files over 10 MB, binary samples and LFS-tracked names; empty files are regular."""
        if size == 0:
            return "regular"
        name = path.rsplit("/", 1)[-1]
        if size > LFS_THRESHOLD_BYTES or b"\0" in sample or any(fnmatch.fnmatch(name, p) for p in _LFS_PATTERNS):
            return "lfs"
        return "regular"

    @staticmethod
    def ignored(path: str, gitignore: str | None) -> bool:
        """A small subset of .gitignore: glob lines matched on the path or its file name; ``dir/`` prefixes."""
        for line in (gitignore or "").splitlines():
            pattern = line.strip()
            if not pattern or pattern.startswith(("#", "!")):
                continue
            if pattern.endswith("/"):
                if path.startswith(pattern.lstrip("/")) or f"/{pattern}" in f"/{path}":
                    return True
            elif fnmatch.fnmatch(path, pattern.lstrip("/")) or fnmatch.fnmatch(path.rsplit("/", 1)[-1], pattern):
                return True
        return False
