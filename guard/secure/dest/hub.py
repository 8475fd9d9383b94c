"""A Hub repo as a destination (``--push-to hf://NS/NAME``, ``hf://datasets/NS/NAME``, ``NS/NAME``).

- **put** (``put_part``): one ``create_commit`` titled ``UPLOAD_COMMIT_TITLE`` into ``last-checkpoint/`` that also
  deletes what was there before (what ``upload_folder(delete_patterns=...)`` does, but always one commit: with
  ``hf_xet`` installed ``upload_folder`` switches to a multi-commit pipeline). Verification reads
  ``get_paths_info`` at that commit: LFS files carry their sha256, compared with the sha256 the client computed
  while uploading (no second read); regular files (small, at most 10 MB on the Hub) carry their git blob sha1,
  compared with ``git_hash`` of the local bytes. Nothing is downloaded again.
- **record** (``write_record``): a second commit, titled ``CHECKPOINT_COMMIT_TITLE``, adds the manifest
  (``guard_manifest.json``: step, placement, the verified commit, each file's size and sha256) with
  ``parent_commit`` the verified upload: on top of exactly that commit, or not at all. An upload commit is never a
  record (``read_record``).
- **node parts** (many nodes, each with its own disk: ``put_part`` with ``nodes`` > 1, ``parts``, ``part_steps``,
  ``write_record`` of every node's part): each node's files and manifest under ``.guard/staging/`` in commits of
  their own, the record one commit that copies them into ``last-checkpoint/`` (``guard.secure.dest.hub_parts``).
- **restore** (``restore_record``): after a taint reached the record, one record commit names the older record
  commit's ``last-checkpoint/`` files again, copied server-side (``guard.secure.dest.hub_restore``).
- **fetch** downloads ``last-checkpoint/`` at the recorded commit (never a later unrelated HEAD; the client's
  default transfer: ``snapshot_download`` through ``hf_xet`` for every Xet-backed file) and checks every
  file against the tree listing (sha256 of LFS files, git sha1 of regular ones) and the manifest. The step comes
  from the checkpoint's ``trainer_state.json`` (``global_step``), else the manifest, else the newest commit titled
  ``... checkpoint step N``.

Bounded waiting (``guard.secure.hubhttp``): every Hub request has a timeout, and during a push or fetch none
outlives its deadline; the securer retries network errors and 408/429/5xx answers while time remains. Limits: the
bound is process-wide (with two pushes at once the earlier deadline applies to both), and transfers made by
``hf_xet`` (when installed and not disabled) bypass the HTTP client, so only their HTTP calls are bounded.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from guard.secure.dest import hub_parts, hub_restore, local
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
from guard.secure.hubhttp import Mismatch, bounded, install_request_bounds

if TYPE_CHECKING:
    from huggingface_hub import CommitOperationAdd, HfApi

__all__ = ["CHECKPOINT_COMMIT_TITLE", "TIDY_S", "UPLOAD_COMMIT_TITLE", "HubPart", "HubStore"]

logger = logging.getLogger("guard.secure.hubstore")

#: The title of every checkpoint commit the guard makes; the newest commit with this title is the secured one.
CHECKPOINT_COMMIT_TITLE = "guard: checkpoint step {step}"
#: The title of the commit that uploads a checkpoint's files; the record (``CHECKPOINT_COMMIT_TITLE``, adding the
#: manifest) follows only once every file verified. Never matches ``_STEP_IN_TITLE``.
UPLOAD_COMMIT_TITLE = "guard: upload of step {step}, not verified yet"
_STEP_IN_TITLE = re.compile(r"checkpoint step (\d+)")
_GUARD_TITLE = re.compile(r"guard: checkpoint step (\d+)")
#: The guard's commits that are never a record: a one-node upload, a node part's files and its manifest.
_UPLOAD_TITLE = re.compile(r"guard: (upload of step \d+, not verified yet|upload of node \d+'s part of step \d+, not "
                           r"verified yet|node \d+'s part of step \d+ verified, not a record)")


@dataclass(frozen=True)
class HubPart(PartManifest):
    """A put at a Hub repo: ``commit`` is the verified upload commit the record goes on top of."""

    commit: str = ""


#: How long a Hub store's tidy may take after the run when no deadline is given (seconds).
TIDY_S = 10.0


class HubStore:
    """A Hub repo (module docstring). Verbs raise what ``huggingface_hub`` raises (classified by the securer:
    ``guard.secure.hubhttp.classify``), ``Mismatch`` (the repo does not hold what was sent) or
    ``PushFailedError`` (a torn upload).

    Args:
        repo_id: ``"NS/NAME"``.
        repo_type: ``"model"`` or ``"dataset"``.
        api: the ``huggingface_hub.HfApi`` to use; default ``HfApi(token=token)``, made on first use.
        token: Hub token for the default ``api``; default: ``HF_TOKEN`` or the stored login.
        log: where to log (default ``guard.secure.hubstore``).
    """

    kind: ClassVar[str] = "hub"
    leaves_staging: ClassVar[bool] = False  # an unverified upload commit is never a record: nothing to tidy
    leaves_parts_staging: ClassVar[bool] = True  # node parts' staging no record takes (``tidy``)

    def __init__(self, repo_id: str, repo_type: str = "model", *, api: HfApi | None = None,
                 token: str | None = None, log: logging.Logger | None = None,
                 stale_staging_s: float = hub_parts.STALE_STAGING_S) -> None:
        self.repo_id, self.repo_type = repo_id, repo_type
        self._api, self._token, self._log = api, token, log or logger
        self.stale_staging_s = stale_staging_s
        self._repo_ready = False
        self._parts_read: dict[str, PartManifest] = {}  # node manifests read, by git blob id

    @classmethod
    def open(cls, destination: Destination, **options: Any) -> HubStore:
        """The store of a ``Destination`` of kind ``"hub"`` (``options``: ``api``, ``token``, ``log``)."""
        assert destination.repo_id is not None
        return cls(destination.repo_id, destination.repo_type or "model", api=options.get("api"),
                   token=options.get("token"), log=options.get("log"))

    def __str__(self) -> str:
        return f"hf://{'datasets/' if self.repo_type == 'dataset' else ''}{self.repo_id}"

    @property
    def api(self) -> HfApi:
        """The client (the guard's request bounds installed first)."""
        install_request_bounds()
        if self._api is None:
            from huggingface_hub import HfApi

            self._api = HfApi(token=self._token)
        return self._api

    # -- put and record ---------------------------------------------------------------------------------------

    def put_part(self, local_dir: Path, files: Sequence[str], *, run_id: str, step: int, node_rank: int,
                 nodes: int, place: str | None, source: str | None, deadline: float,
                 progress: Progress | None = None, requires: Mapping[str, int] | None = None,
                 check: Callable[[], None] | None = None) -> HubPart:
        """One upload commit of ``files`` into ``last-checkpoint/`` (replacing what was there), verified; ``check``
        runs once the files' first signatures are taken, before any byte is sent. With ``nodes`` > 1 the files are
        node ``node_rank``'s part and go under the run's staging path instead, then the node's manifest (with
        ``requires``; ``guard.secure.dest.hub_parts``).

        Raises:
            Mismatch: a file is missing or differs at the commit, or changed locally while it was uploaded.
            PushFailedError: the uploaded files are not whole by format.
        """
        if nodes > 1:
            part, oid = hub_parts.put_node_part(self, Path(local_dir), files, run_id=run_id, step=step,
                                                node_rank=node_rank, nodes=nodes, place=place, source=source,
                                                requires=requires, check=check)
            return HubPart(**{f.name: getattr(part, f.name) for f in fields(PartManifest)}, commit=oid)
        folder, prefix = Path(local_dir), f"{CHECKPOINT_FOLDER}/"
        oid, adds = self._commit_verified(folder, list(files), prefix, UPLOAD_COMMIT_TITLE.format(step=step),
                                          f"checkpoint step {step}", replace=True, check=check)
        sums = {op.path_in_repo[len(prefix):]: FileSum(op.upload_info.size, op.upload_info.sha256.hex())
                for op in adds}
        return HubPart(run_id=run_id, step=step, node_rank=node_rank, nodes=nodes, files=sums,
                       written_at_s=time.time(), place=place, source=source, commit=oid)

    def parts(self, *, run_id: str, step: int, deadline: float) -> list[PartManifest]:
        """The node manifests of ``run_id``'s checkpoint ``step`` in the repo (``hub_parts.node_parts``); no request
        outlives ``deadline`` (``hubhttp.bounded``: ``DeadlineExceeded``)."""
        with bounded(lambda: deadline - time.monotonic()):
            return hub_parts.node_parts(self, run_id=run_id, step=step, cache=self._parts_read)

    def part_steps(self, *, run_id: str, deadline: float) -> dict[int, set[int]]:
        """Which nodes have put a part of which step of ``run_id`` in the repo: ``{step: {node ranks}}``; bounded
        as ``parts``."""
        with bounded(lambda: deadline - time.monotonic()):
            return hub_parts.node_part_steps(self, run_id=run_id)

    def write_record(self, parts: Sequence[PartManifest], *, deadline: float,
                     recorded: Callable[[Record], None] | None = None) -> Record:
        """The record commit (``CHECKPOINT_COMMIT_TITLE``) on top of exactly the part's verified upload commit;
        ``recorded`` is called once it is made, before it is verified.

        Raises:
            ValueError: not one ``HubPart``.
            Mismatch: the manifest does not verify at the record commit.
        """
        if parts and all(p.nodes > 1 for p in parts):
            return hub_parts.record_node_parts(self, parts, deadline=deadline, recorded=recorded,
                                               title=CHECKPOINT_COMMIT_TITLE.format(step=parts[0].step))
        part = parts[0] if len(parts) == 1 else None
        if not isinstance(part, HubPart):
            raise ValueError(f"a Hub destination records one node's uploaded part, not {len(parts)} parts")
        from huggingface_hub import CommitOperationAdd

        manifest = {"step": part.step, **local.placed_source(part.source, part.place), "verified_commit": part.commit,
                    "files": {rel: {"size": fs.size_bytes, "sha256": fs.sha256} for rel, fs in part.files.items()}}
        body = json.dumps(manifest, indent=1).encode()
        op = CommitOperationAdd(path_in_repo=f"{CHECKPOINT_FOLDER}/{MANIFEST_NAME}", path_or_fileobj=body)
        # parent_commit: the record goes on top of exactly the verified commit, or not at all
        done = self.api.create_commit(self.repo_id, [op], commit_message=CHECKPOINT_COMMIT_TITLE.format(step=part.step),
                                      repo_type=self.repo_type, parent_commit=part.commit,
                                      commit_description=f"Verified: {len(part.files)} files of commit {part.commit}.")
        record = Record(step=part.step, run_id=part.run_id, files=part.files, revision=done.oid, place=part.place,
                        source=part.source)
        if recorded is not None:
            recorded(record)
        self._verify(done.oid, [op], contents={op.path_in_repo: body})
        return record

    def restore_record(self, record: Record, *, deadline: float) -> Record:
        """One record commit naming the files of the older record commit ``record.revision`` (step
        ``record.step``) again, copied server-side (``guard.secure.dest.hub_restore``); no request outlives
        ``deadline``.

        Raises:
            DestinationError: no step or commit given, or no ``last-checkpoint/`` at it.
            Mismatch: the new commit does not hold the older commit's files.
        """
        with bounded(lambda: deadline - time.monotonic()):
            return hub_restore.restore_record(self, record, title=CHECKPOINT_COMMIT_TITLE)

    def _commit_verified(self, folder: Path, files: list[str], prefix: str, title: str, what: str, *,
                         replace: bool, check: Callable[[], None] | None = None,
                         parts: bool = False) -> tuple[str, list[Any]]:
        """One commit of ``files`` under ``prefix`` titled ``title`` (with ``replace``, deleting the other files
        under it), verified, the local files unchanged meanwhile and whole (``parts``: as one node's part of a
        many-node checkpoint). Returns ``(commit id, its adds)``."""
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete, RepoFile
        from huggingface_hub.errors import EntryNotFoundError

        api = self.api
        if not self._repo_ready:
            api.create_repo(self.repo_id, repo_type=self.repo_type, private=True, exist_ok=True)
            self._repo_ready = True
        before = local.signatures(folder, files)
        if check is not None:
            check()
        adds = [CommitOperationAdd(path_in_repo=prefix + rel, path_or_fileobj=str(folder / rel)) for rel in files]
        deletes: list[CommitOperationDelete] = []
        if replace:
            try:
                remote = [e.path for e in api.list_repo_tree(self.repo_id, path_in_repo=prefix.rstrip("/"),
                                                             recursive=True, repo_type=self.repo_type)
                          if isinstance(e, RepoFile)]
            except EntryNotFoundError:
                remote = []
            keep = {op.path_in_repo for op in adds}
            deletes = [CommitOperationDelete(path_in_repo=p) for p in remote if p not in keep]
        info = api.create_commit(self.repo_id, [*deletes, *adds], commit_message=title, repo_type=self.repo_type,
                                 commit_description=f"Secured by jobguard: {len(files)} files from {folder.name}.")
        self._verify(info.oid, adds)
        changed = local.changed_since(folder, files, before)
        if changed:  # rewritten in place while uploading: what was sent may be torn; the retry's commit replaces it
            raise Mismatch([f"{rel} changed while it was uploaded" for rel in changed])
        local.refuse_torn(what, folder, files, "uploaded", str(self), parts=parts)
        return info.oid, adds

    def _verify(self, revision: str, adds: list[CommitOperationAdd], contents: dict[str, bytes] | None = None) -> None:
        """Raise ``Mismatch`` unless every file of ``adds`` is at ``revision`` with its size and sha256 (LFS) or git
        sha1 (regular files)."""
        from huggingface_hub import RepoFile
        from huggingface_hub.utils.sha import git_hash

        remote: dict[str, RepoFile] = {}
        paths = [op.path_in_repo for op in adds]
        for i in range(0, len(paths), 100):
            # lfs (sha256, size) comes without expand=True, which would only add last-commit data
            for found in self.api.get_paths_info(self.repo_id, paths[i:i + 100], revision=revision,
                                                 repo_type=self.repo_type):
                if isinstance(found, RepoFile):  # a folder at a file's path counts as missing
                    remote[found.path] = found
        problems = []
        for op in adds:
            entry, size = remote.get(op.path_in_repo), op.upload_info.size
            if entry is None:
                problems.append(f"{op.path_in_repo} missing")
            elif entry.size != size:
                problems.append(f"{op.path_in_repo} has {entry.size} bytes, local {size}")
            elif entry.lfs is not None and entry.lfs.sha256 != op.upload_info.sha256.hex():
                problems.append(f"{op.path_in_repo} sha256 {entry.lfs.sha256[:12]}.. differs")
            elif entry.lfs is None and entry.blob_id != git_hash((contents or {}).get(op.path_in_repo)
                                                                 or Path(str(op.path_or_fileobj)).read_bytes()):
                problems.append(f"{op.path_in_repo} git sha1 {entry.blob_id[:12]}.. differs")
        if problems:
            raise Mismatch(problems)

    # -- read, fetch, final -----------------------------------------------------------------------------------

    def read_record(self, *, deadline: float) -> Record | None:
        """The newest commit titled ``guard: checkpoint step N`` (``CHECKPOINT_COMMIT_TITLE``), so that a commit on
        top (a README, the Trainer's own push) never changes what is resumed from; a ``last-checkpoint/`` without
        such a commit (pushed by something else) is HEAD's, step unknown, or, when the guard's own upload commits
        (``UPLOAD_COMMIT_TITLE``: files not verified, no record yet) are in the history, the newest commit below the
        oldest of them: an upload is never a record. None: no repo, or only the guard's uploads."""
        from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

        try:
            commits = list(self.api.list_repo_commits(self.repo_id, repo_type=self.repo_type))  # newest first
        except (RepositoryNotFoundError, RevisionNotFoundError):
            return None
        record = self.newest_record(commits)
        if record is not None:
            return record
        # no record: a last-checkpoint/ pushed by something else, read at the newest commit below every upload of
        # the guard's own (an upload commit is a record only once its files verified; one that failed verification,
        # or was cut off before its record, is never resumed from, nor is a commit on top of it)
        uploads = [i for i, commit in enumerate(commits) if _UPLOAD_TITLE.fullmatch(commit.title.strip())]
        below = commits[uploads[-1] + 1:] if uploads else commits
        if not below:
            self._log.info("no commit at %s records a secured checkpoint: only the guard's unverified uploads (%s)",
                           self, commits[uploads[-1]].title.strip() if uploads else "none")
            return None
        self._log.info("no commit at %s records a secured checkpoint (titled %r): using %s's %s/ if any%s",
                       self, CHECKPOINT_COMMIT_TITLE.format(step="N"),
                       "HEAD" if not uploads else below[0].commit_id[:12], CHECKPOINT_FOLDER,
                       f" (below {len(uploads)} unverified upload commit(s) of the guard's)" if uploads else "")
        return Record(step=None, run_id=None, files={}, revision=below[0].commit_id)

    def newest_record(self, commits: Sequence[Any]) -> Record | None:
        """The record of the newest of ``commits`` (``list_repo_commits``, newest first) titled
        ``CHECKPOINT_COMMIT_TITLE``, with its manifest's placement (and run id and node count: a record of node
        parts), or None."""
        for commit in commits:
            if match := _GUARD_TITLE.fullmatch(commit.title.strip()):
                manifest = self._manifest(commit.commit_id)
                output_dir, place = local.placed(manifest)
                run_id, nodes = manifest.get("run_id"), manifest.get("nodes")
                return Record(step=int(match[1]), run_id=run_id if isinstance(run_id, str) else None, files={},
                              revision=commit.commit_id, place=place, source=output_dir,
                              nodes=nodes if isinstance(nodes, int) else 1)
        return None

    def _manifest(self, revision: str) -> dict[str, Any]:
        """The record's manifest at ``revision`` (a small file), or ``{}`` (a record of an older guard)."""
        return self.read_json(f"{CHECKPOINT_FOLDER}/{MANIFEST_NAME}", revision)

    def read_json(self, path: str, revision: str | None) -> dict[str, Any]:
        """The JSON object of the small file ``path`` at ``revision`` (None: the default branch), or ``{}`` when it
        is not there or not a JSON object."""
        from huggingface_hub.errors import EntryNotFoundError

        with tempfile.TemporaryDirectory(prefix=".guard-peek-") as tmp:
            try:
                local_path = self.api.hf_hub_download(self.repo_id, path, revision=revision,
                                                      repo_type=self.repo_type, local_dir=tmp,
                                                      cache_dir=Path(tmp) / ".cache")
                body = json.loads(Path(local_path).read_text())
            except (EntryNotFoundError, OSError, ValueError):
                return {}
        return body if isinstance(body, dict) else {}

    def fetch(self, record: Record, into: Path, *, deadline: float) -> FetchedCheckpoint | None:
        """Download ``last-checkpoint/`` at ``record.revision``, verify every file (tree listing and manifest) and
        place it (``local.place_fetched``); None when the repo, the revision or the folder is not there.

        Raises:
            Mismatch: a file differs from what the repo records (corrupt or partial download).
            HubError: the step cannot be told.
        """
        from huggingface_hub import RepoFile
        from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

        api, sha = self.api, record.revision
        try:
            entries = [e for e in api.list_repo_tree(self.repo_id, path_in_repo=CHECKPOINT_FOLDER, recursive=True,
                                                     revision=sha, repo_type=self.repo_type) if isinstance(e, RepoFile)]
        except (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError):
            return None
        if not entries or not sha:
            return None
        staging = local.staging_dir(".guard-fetch-", into)
        try:
            api.snapshot_download(self.repo_id, repo_type=self.repo_type, revision=sha, local_dir=staging,
                                  cache_dir=staging / ".cache" / "hub", allow_patterns=[f"{CHECKPOINT_FOLDER}/*"])
            fetched = staging / CHECKPOINT_FOLDER
            manifest = local.read_manifest(fetched)
            entries = self._check_fetched(staging, entries, manifest)
            step = local.step_from_trainer_state(fetched)
            if step is None and isinstance(manifest.get("step"), int):
                step = manifest["step"]
            if step is None:
                for commit in api.list_repo_commits(self.repo_id, revision=sha, repo_type=self.repo_type):
                    if match := _STEP_IN_TITLE.search(commit.title):
                        step = int(match[1])
                        break
            files = [e.path[len(CHECKPOINT_FOLDER) + 1:] for e in entries]
            return local.place_fetched(fetched, into, step, sha, files, sum(e.size for e in entries),
                                       local.placed(manifest)[1], str(self), self._log)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def _check_fetched(self, staging: Path, entries: list[Any], manifest: dict[str, Any]) -> list[Any]:
        """Raise ``Mismatch`` unless every downloaded file matches the tree listing (and the manifest, whose own
        file is then removed); returns the entries of the checkpoint's files."""
        from huggingface_hub.utils.sha import git_hash

        problems = []
        for entry in entries:
            path = staging / entry.path
            if not path.is_file():
                problems.append(f"{entry.path} missing")
            elif path.stat().st_size != entry.size:
                problems.append(f"{entry.path} has {path.stat().st_size} bytes, expected {entry.size}")
            elif entry.lfs is not None and local.hash_file(path)[1] != entry.lfs.sha256:
                problems.append(f"{entry.path} sha256 differs from the recorded {entry.lfs.sha256[:12]}..")
            elif entry.lfs is None and git_hash(path.read_bytes()) != entry.blob_id:
                problems.append(f"{entry.path} git sha1 differs from the recorded {entry.blob_id[:12]}..")
        fetched = staging / CHECKPOINT_FOLDER
        if manifest:  # the record written after verification: every file must match its sha256
            problems += _against_manifest(fetched, manifest, [e.path[len(CHECKPOINT_FOLDER) + 1:] for e in entries])
            with contextlib.suppress(OSError):
                (fetched / MANIFEST_NAME).unlink()
            entries = [e for e in entries if e.path != f"{CHECKPOINT_FOLDER}/{MANIFEST_NAME}"]
        if problems:
            raise Mismatch(problems)
        return entries

    def put_final(self, local_dir: Path, files: Sequence[str], *, deadline: float,
                  progress: Progress | None = None) -> FinalPushed:
        """One commit ``guard: final model`` of ``files`` at the repo's root, verified (unchanged files are not
        uploaded again: the client compares oids at preupload). Raises as ``put_part``."""
        oid, adds = self._commit_verified(Path(local_dir), list(files), "", "guard: final model", "final model",
                                          replace=False)
        return FinalPushed(revision=oid, files={op.path_in_repo: FileSum(op.upload_info.size,
                                                                         op.upload_info.sha256.hex()) for op in adds})

    def tidy(self, *, deadline: float | None = None, nodes: int = 1) -> None:
        """The node parts' staging that no record takes (``hub_parts.tidy_staging``: the record's run's steps older
        than its step, and every run's staging left unchanged for ``stale_staging_s``, default a day) after a job of
        several ``nodes``; a one-node push leaves nothing (an unverified upload commit is never a record). No
        request outlives ``deadline`` (monotonic seconds) or ``TIDY_S`` from now. Never raises: a failed request,
        or another commit first (another node's tidy: 412), leaves the staging as it was (logged)."""
        if nodes < 2:
            return
        until = min(deadline if deadline is not None else math.inf, time.monotonic() + TIDY_S)
        try:
            with bounded(lambda: until - time.monotonic()):
                gone = hub_parts.tidy_staging(self, now_s=time.time(), stale_s=self.stale_staging_s)
        except Exception as exc:  # noqa: BLE001 - after the run: whatever failed, the staging stays as it was
            first = getattr(getattr(exc, "response", None), "status_code", None) == 412
            (self._log.info if first else self._log.warning)(
                "node parts' staging at %s left as it was: %s", self,
                "another commit came first (another node's tidy)" if first else exc)
            return
        if gone:
            self._log.info("removed node parts' staging that no record takes at %s: %s", self, ", ".join(gone))


def _against_manifest(fetched: Path, manifest: dict[str, Any], present: list[str]) -> list[str]:
    """Problems of a fetched checkpoint against its manifest (``{"files": {rel: {"size", "sha256"}}}``): a file it
    names that is missing or differs in size or sha256, a file it does not name."""
    recorded = manifest.get("files")
    if not isinstance(recorded, dict):
        return [f"{MANIFEST_NAME} names no files"]
    problems = []
    for rel, want in sorted(recorded.items()):
        path = fetched / rel
        if not path.is_file():
            problems.append(f"{rel} missing (named by {MANIFEST_NAME})")
        elif not isinstance(want, dict) or local.hash_file(path) != (want.get("size"), want.get("sha256")):
            problems.append(f"{rel} differs from the size and sha256 recorded in {MANIFEST_NAME}")
    problems += [f"{rel} is not named by {MANIFEST_NAME}" for rel in present
                 if rel != MANIFEST_NAME and rel not in recorded]
    return problems
