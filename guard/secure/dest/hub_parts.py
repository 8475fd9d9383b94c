"""Node parts at a Hub repo: each node of a many-node job puts its own part of a checkpoint, and the record
(``last-checkpoint/`` at a commit titled ``guard: checkpoint step N``) is made of every node's part in one commit.

Layout in the repo (the folder's and S3's, ``guard.secure.dest.folder_parts``)::

    .guard/staging/<run_id>/step-<N>/node-<k>/...      node k's files of step N (one commit of their own, verified)
    .guard/staging/<run_id>/step-<N>/node-<k>.json     its manifest (``base.part_json``), a commit after the files

- **put**: the node's files go up in one commit under its staging path (replacing an earlier put of the same part),
  each verified at that commit as a one-node put is (the sha256 of LFS and Xet files, the git sha1 of regular
  ones), then the node's manifest in a second commit. Neither commit is a record: their titles never match
  ``CHECKPOINT_COMMIT_TITLE``, and ``HubStore.read_record`` reads below them.
- **meet**: ``parts`` lists ``step-<N>/`` and reads each ``node-<k>.json`` (by its git blob id, read once);
  ``part_steps`` lists the run's steps, then each step's manifests; no request of either outlives the deadline it is
  given (``HubStore.parts``, ``guard.secure.hubhttp.bounded``).
- **record**: ONE commit, with ``parent_commit`` the head it was decided at, that makes ``last-checkpoint/`` the
  union of the parts (``CommitOperationCopy`` from the staging paths at that head: the Hub copies an LFS or Xet file
  server-side by its sha256, without a byte sent again; ``huggingface_hub`` downloads a regular file and adds it
  again, ``_commit_api._fetch_files_to_copy``), deletes what else was under ``last-checkpoint/``, adds the record's
  manifest (step, run id, node count, each file's size and sha256) and deletes the staging of the run's older
  steps. It is made only when the newest record commit is not already this step or a newer one of the same run;
  another commit in between (a node's put) answers 412 and the record is decided again on the new head. The
  record commit is then verified: every file at it has the part's size and sha256 (LFS) or the staged file's git
  blob id (regular).
- **tidy** (after the run, ``tidy_staging``): staging that no record will take goes, in one commit on top of exactly
  the head it was decided at (a node's put in between answers 412: nothing is removed then). The record copied what
  it took into ``last-checkpoint/`` (and its manifest's ``verified_commit`` keeps the staged files in the history),
  so what goes is: the steps of the newest record's run older than its step (a node's late part), and the whole
  staging of any run none of whose files changed for ``STALE_STAGING_S`` (a run whose nodes are gone: its parts
  never met, or its record was replaced). Kept: the record's own step and its run's newer ones (another node may
  still be reading or putting them), and every run that changed since.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from guard.errors import DestinationError
from guard.secure.dest import local
from guard.secure.dest.base import (
    CHECKPOINT_FOLDER,
    MANIFEST_NAME,
    FileSum,
    PartManifest,
    Record,
    part_from_json,
    part_json,
)
from guard.secure.hubhttp import Mismatch

__all__ = ["PARTS_FOLDER", "PART_FILES_TITLE", "PART_MANIFEST_TITLE", "STALE_STAGING_S", "TIDY_TITLE",
           "entries_recursive", "node_part_steps", "node_parts", "paths_info", "put_node_part", "record_node_parts",
           "tidy_staging"]

logger = logging.getLogger("guard.secure.hubstore")

#: The node parts' place in the repo.
PARTS_FOLDER = ".guard/staging"
#: The titles of a node's two put commits (never a record: ``HubStore.read_record`` reads below them).
PART_FILES_TITLE = "guard: upload of node {node}'s part of step {step}, not verified yet"
PART_MANIFEST_TITLE = "guard: node {node}'s part of step {step} verified, not a record"
_NODE_MANIFEST = "node-{node}.json"
#: The title of the commit that removes staging no record will take (never a record's or a put's).
TIDY_TITLE = "guard: remove node parts' staging that no record takes"
#: A run's staging is removed whole once none of its files changed for this long (seconds): a node still putting
#: parts commits every save, and a part's files and manifest come within one push.
STALE_STAGING_S = 24 * 3600.0


class HubStore(Protocol):
    """What this module uses of ``guard.secure.dest.hub.HubStore`` (which imports this module)."""

    repo_id: str
    repo_type: str

    @property
    def api(self) -> Any: ...

    def _commit_verified(self, folder: Path, files: list[str], prefix: str, title: str, what: str, *,
                         replace: bool, check: Callable[[], None] | None = None,
                         parts: bool = False) -> tuple[str, list[Any]]: ...

    def _verify(self, revision: str, adds: list[Any], contents: dict[str, bytes] | None = None) -> None: ...

    def read_json(self, path: str, revision: str | None) -> dict[str, Any]: ...

    def newest_record(self, commits: Sequence[Any]) -> Record | None: ...


def _step_path(run_id: str, step: int) -> str:
    return f"{PARTS_FOLDER}/{run_id}/step-{step}"


def put_node_part(store: HubStore, local_dir: Path, files: Sequence[str], *, run_id: str, step: int,
                  node_rank: int, nodes: int, place: str | None, source: str | None,
                  requires: Mapping[str, int] | None, check: Callable[[], None] | None) -> tuple[PartManifest, str]:
    """Node ``node_rank``'s files of ``step`` in their own commit under the run's staging path, verified, then its
    manifest in a commit of its own (module docstring). Returns ``(the manifest, its commit id)``.

    Raises:
        Mismatch: a file is missing or differs at the commit, or changed locally while it was uploaded.
        PushFailedError: the uploaded files are not whole by format (this node's part of it).
    """
    from huggingface_hub import CommitOperationAdd

    prefix = f"{_step_path(run_id, step)}/node-{node_rank}/"
    _, adds = store._commit_verified(Path(local_dir), list(files), prefix,
                                     PART_FILES_TITLE.format(node=node_rank, step=step),
                                     f"checkpoint step {step} (node {node_rank}'s part)", replace=True, check=check,
                                     parts=True)
    part = PartManifest(run_id=run_id, step=step, node_rank=node_rank, nodes=nodes,
                        files={op.path_in_repo[len(prefix):]: FileSum(op.upload_info.size, op.upload_info.sha256.hex())
                               for op in adds},
                        written_at_s=time.time(), place=place, source=source, requires=dict(requires or {}))
    body = json.dumps(part_json(part)).encode()
    op = CommitOperationAdd(path_in_repo=f"{_step_path(run_id, step)}/{_NODE_MANIFEST.format(node=node_rank)}",
                            path_or_fileobj=body)
    info = store.api.create_commit(store.repo_id, [op], repo_type=store.repo_type,
                                   commit_message=PART_MANIFEST_TITLE.format(node=node_rank, step=step),
                                   commit_description=f"Verified: {len(part.files)} files under {prefix}.")
    store._verify(info.oid, [op], contents={op.path_in_repo: body})
    return part, info.oid


def _entries(store: HubStore, path: str, revision: str | None = None) -> list[Any]:
    """The entries right under ``path`` in the repo (files and folders), ``[]`` when it is not there."""
    from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        return list(store.api.list_repo_tree(store.repo_id, path_in_repo=path, repo_type=store.repo_type,
                                             revision=revision))
    except (EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError):
        return []


def node_parts(store: HubStore, *, run_id: str, step: int, cache: dict[str, PartManifest]) -> list[PartManifest]:
    """The node manifests of ``run_id``'s step ``step`` in the repo, by node (unreadable ones skipped). ``cache``
    keeps each manifest by its git blob id, so a listing every half second reads each one once."""
    from huggingface_hub import RepoFile

    found = []
    for entry in _entries(store, _step_path(run_id, step)):
        name = entry.path.rsplit("/", 1)[-1]
        if not isinstance(entry, RepoFile) or not (name.startswith("node-") and name.endswith(".json")):
            continue
        part = cache.get(entry.blob_id)
        if part is None:
            body = store.read_json(entry.path, None)  # {}: gone since the listing (a record removed the staging)
            try:
                part = part_from_json(body)
            except (KeyError, TypeError, ValueError, AttributeError):
                continue  # not a node manifest: skipped
            cache[entry.blob_id] = part
        found.append(part)
    return sorted(found, key=lambda p: p.node_rank)


def node_part_steps(store: HubStore, *, run_id: str) -> dict[int, set[int]]:
    """``{step: {node ranks whose manifest is there}}`` of ``run_id`` in the repo (a listing of the run's steps,
    then one of each step)."""
    from huggingface_hub import RepoFile

    found: dict[int, set[int]] = {}
    for folder in _entries(store, f"{PARTS_FOLDER}/{run_id}"):
        name = folder.path.rsplit("/", 1)[-1]
        if isinstance(folder, RepoFile) or not name.startswith("step-") or not name[5:].isdigit():
            continue
        nodes = set()
        for entry in _entries(store, folder.path):
            leaf = entry.path.rsplit("/", 1)[-1]
            if isinstance(entry, RepoFile) and leaf.startswith("node-") and leaf.endswith(".json") \
                    and leaf[5:-5].isdigit():
                nodes.add(int(leaf[5:-5]))
        if nodes:
            found[int(name[5:])] = nodes
    return found


def record_node_parts(store: HubStore, parts: Sequence[PartManifest], *, deadline: float, title: str,
                      recorded: Callable[[Record], None] | None, clock: Callable[[], float] = time.monotonic) -> Record:
    """The record made of every node's part, in one commit (module docstring); a record commit already naming this
    step or a newer one of the run stands (returned; ``recorded`` is called when it names this step).

    Raises:
        DestinationError: the parts are not of one run and step, or the head kept moving until ``deadline``.
        Mismatch: a staged file is not what its part's manifest says, or the record commit does not verify.
    """
    from huggingface_hub.errors import HfHubHTTPError

    first = parts[0]
    if any((p.run_id, p.step, p.nodes) != (first.run_id, first.step, first.nodes) for p in parts):
        raise DestinationError(f"the parts to record are not of one run and step: "
                               f"{sorted((p.run_id, p.step, p.node_rank) for p in parts)}", destination=str(store))
    while True:
        commits = list(store.api.list_repo_commits(store.repo_id, repo_type=store.repo_type))  # newest first
        head = commits[0].commit_id
        current = store.newest_record(commits)
        if current is not None and current.run_id == first.run_id and current.step is not None \
                and current.step >= first.step:
            logger.info("the record at %s already names step %s of this run", store, current.step)
            if recorded is not None and current.step == first.step:
                recorded(current)
            return current
        try:
            return _record_at(store, parts, head, title, recorded)
        except HfHubHTTPError as err:
            status = getattr(getattr(err, "response", None), "status_code", None)
            if status != 412 or clock() >= deadline:
                raise
            logger.info("a commit came first at %s (a node's part): the record is decided again", store)


def _record_at(store: HubStore, parts: Sequence[PartManifest], head: str, title: str,
               recorded: Callable[[Record], None] | None) -> Record:
    """The record commit on top of exactly ``head`` (412 when the head moved), then its verification."""
    from huggingface_hub import CommitOperationAdd, CommitOperationCopy, CommitOperationDelete, RepoFile

    first = parts[0]
    sources: dict[str, str] = {}  # rel -> staged path
    files: dict[str, FileSum] = {}
    for part in sorted(parts, key=lambda p: p.node_rank):
        for rel, summed in part.files.items():
            if rel not in files:
                files[rel] = summed
                sources[rel] = f"{_step_path(part.run_id, part.step)}/node-{part.node_rank}/{rel}"
    staged = paths_info(store, list(sources.values()), head)
    problems = []
    for rel, path in sources.items():
        entry = staged.get(path)
        if entry is None:
            problems.append(f"{path} is not in the repo")
        elif entry.size != files[rel].size_bytes or (entry.lfs is not None and entry.lfs.sha256 != files[rel].sha256):
            problems.append(f"{path} is not the file node parts' manifest names")
    if problems:
        raise Mismatch(problems)
    present = [e.path for e in entries_recursive(store, CHECKPOINT_FOLDER, head) if isinstance(e, RepoFile)]
    keep = {f"{CHECKPOINT_FOLDER}/{rel}" for rel in files} | {f"{CHECKPOINT_FOLDER}/{MANIFEST_NAME}"}
    older = [e.path for e in _entries(store, f"{PARTS_FOLDER}/{first.run_id}", head)
             if not isinstance(e, RepoFile) and (s := _step_of(e.path)) is not None and s < first.step]
    manifest = {"step": first.step, "run_id": first.run_id, "nodes": first.nodes,
                **local.placed_source(first.source, first.place), "verified_commit": head,
                "files": {rel: {"size": fs.size_bytes, "sha256": fs.sha256} for rel, fs in sorted(files.items())}}
    body = json.dumps(manifest, indent=1).encode()
    add = CommitOperationAdd(path_in_repo=f"{CHECKPOINT_FOLDER}/{MANIFEST_NAME}", path_or_fileobj=body)
    ops: list[Any] = [CommitOperationDelete(path_in_repo=p) for p in present if p not in keep]
    ops += [CommitOperationCopy(src_path_in_repo=src, path_in_repo=f"{CHECKPOINT_FOLDER}/{rel}", src_revision=head)
            for rel, src in sources.items()]
    ops += [add, *(CommitOperationDelete(path_in_repo=f"{p}/", is_folder=True) for p in older)]
    done = store.api.create_commit(store.repo_id, ops, commit_message=title, repo_type=store.repo_type,
                                   parent_commit=head,
                                   commit_description=f"Verified: {len(files)} files of {first.nodes} nodes' parts "
                                                      f"at commit {head}.")
    record = Record(step=first.step, run_id=first.run_id, files=files, revision=done.oid, nodes=first.nodes,
                    place=first.place, source=first.source)
    if recorded is not None:
        recorded(record)
    store._verify(done.oid, [add], contents={add.path_in_repo: body})
    got = paths_info(store, [f"{CHECKPOINT_FOLDER}/{rel}" for rel in files], done.oid)
    for rel, path in sources.items():
        entry, was = got.get(f"{CHECKPOINT_FOLDER}/{rel}"), staged[path]
        if entry is None or entry.size != was.size or entry.blob_id != was.blob_id:
            problems.append(f"{CHECKPOINT_FOLDER}/{rel} is not the staged {path}")
    if problems:
        raise Mismatch(problems)
    return record


def tidy_staging(store: HubStore, *, now_s: float, stale_s: float = STALE_STAGING_S) -> list[str]:
    """Remove the node parts' staging that no record will take (module docstring, **tidy**) in one commit titled
    ``TIDY_TITLE`` on top of the head it was decided at. ``now_s``: now, epoch seconds (against the Hub's commit
    dates); ``stale_s``: how long a run's staging must have been left unchanged to go whole (a file listed without
    its last commit never is). Returns the staging folders removed (repo paths; ``[]``: nothing to remove, no commit
    made).

    Raises:
        huggingface_hub's errors: a request failed; 412 when a commit came first (nothing removed then).
    """
    from huggingface_hub import CommitOperationDelete, RepoFile

    commits = list(store.api.list_repo_commits(store.repo_id, repo_type=store.repo_type))  # newest first
    head = commits[0].commit_id
    record = store.newest_record(commits)
    changed: dict[str, float] = {}  # run -> its newest file's commit date (epoch seconds)
    steps: dict[str, set[str]] = {}  # run -> its step folders
    for entry in entries_recursive(store, PARTS_FOLDER, head, expand=True):
        names = entry.path.split("/")
        if not isinstance(entry, RepoFile) or len(names) < 4:
            continue
        run = names[2]
        dated = entry.last_commit.date.timestamp() if entry.last_commit is not None else math.inf
        changed[run] = max(changed.get(run, -math.inf), dated)
        if len(names) > 4:
            steps.setdefault(run, set()).add("/".join(names[:4]))
    gone = []
    for run, when in sorted(changed.items()):
        if now_s - when >= stale_s:
            gone.append(f"{PARTS_FOLDER}/{run}")
        elif record is not None and run == record.run_id and record.step is not None:
            gone += sorted(p for p in steps.get(run, ()) if (n := _step_of(p)) is not None and n < record.step)
    if not gone:
        return []
    store.api.create_commit(store.repo_id, [CommitOperationDelete(path_in_repo=f"{p}/", is_folder=True) for p in gone],
                            commit_message=TIDY_TITLE, repo_type=store.repo_type, parent_commit=head,
                            commit_description="Staging no record takes: " + ", ".join(gone) + ".")
    return gone


def _step_of(path: str) -> int | None:
    name = path.rsplit("/", 1)[-1]
    return int(name[5:]) if name.startswith("step-") and name[5:].isdigit() else None


def entries_recursive(store: HubStore, path: str, revision: str, *, expand: bool = False) -> list[Any]:
    """Every entry under ``path`` at ``revision`` (``expand``: with each file's last commit), ``[]`` when none."""
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return list(store.api.list_repo_tree(store.repo_id, path_in_repo=path, recursive=True, expand=expand,
                                             repo_type=store.repo_type, revision=revision))
    except EntryNotFoundError:
        return []


def paths_info(store: HubStore, paths: list[str], revision: str) -> dict[str, Any]:
    """``{path: RepoFile}`` of those of ``paths`` that are files at ``revision`` (100 a request)."""
    from huggingface_hub import RepoFile

    found: dict[str, Any] = {}
    for i in range(0, len(paths), 100):
        for entry in store.api.get_paths_info(store.repo_id, paths[i:i + 100], revision=revision,
                                              repo_type=store.repo_type):
            if isinstance(entry, RepoFile):
                found[entry.path] = entry
    return found
