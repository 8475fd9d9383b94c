"""Moving a Hub repo's record back (``HubStore.restore_record``): after a taint reached the checkpoint the newest
record commit names, ONE record commit (titled as any record, ``CHECKPOINT_COMMIT_TITLE`` of the older step) makes
``last-checkpoint/`` what it was at the older record commit again.

The commit, with ``parent_commit`` the head it was decided at, copies every file of ``last-checkpoint/`` at the older
commit to the same path (``CommitOperationCopy`` with ``src_revision``: the Hub copies an LFS or Xet file
server-side by its sha256, without a byte sent again; ``huggingface_hub`` downloads a regular file and adds it
again, ``_commit_api._fetch_files_to_copy``), deletes what else is under ``last-checkpoint/`` and adds the older
manifest with ``restored_from`` (the suspect step). It is then verified: every file at the new commit has the older
commit's size and git blob id (for LFS files, that of the pointer naming its sha256).
"""

from __future__ import annotations

import json
from typing import Any

from guard.errors import DestinationError
from guard.secure.dest.base import CHECKPOINT_FOLDER, MANIFEST_NAME, FileSum, Record
from guard.secure.dest.hub_parts import HubStore, entries_recursive, paths_info
from guard.secure.hubhttp import Mismatch

__all__ = ["restore_record"]


def restore_record(store: HubStore, record: Record, *, title: str) -> Record:
    """The record commit that names ``record.revision``'s ``last-checkpoint/`` again (module docstring); a newest
    record already of ``record.step`` stands (a retry after the commit was made). Returns the record now in place.

    Raises:
        DestinationError: no step or revision given, or no ``last-checkpoint/`` at that revision (the caller
            pushes the checkpoint again instead).
        Mismatch: the new commit does not hold the older commit's files.
        huggingface_hub's errors: the requests failed (412: the head moved meanwhile; the securer retries).
    """
    from huggingface_hub import CommitOperationAdd, CommitOperationCopy, CommitOperationDelete, RepoFile

    old = record.revision
    if record.step is None or not old:
        raise DestinationError("a record without a step and a commit cannot be restored", destination=str(store))
    commits = list(store.api.list_repo_commits(store.repo_id, repo_type=store.repo_type))  # newest first
    head = commits[0].commit_id
    manifest_path = f"{CHECKPOINT_FOLDER}/{MANIFEST_NAME}"
    older = {e.path: e for e in entries_recursive(store, CHECKPOINT_FOLDER, old) if isinstance(e, RepoFile)}
    if not older:
        raise DestinationError(f"commit {old[:12]} holds no {CHECKPOINT_FOLDER}/ at {store}", destination=str(store))
    manifest = store.read_json(manifest_path, old)
    current = store.newest_record(commits)
    if current is not None and current.step == record.step and current.revision != old \
            and store.read_json(manifest_path, current.revision).get("restored_from") is not None:
        return _restored(current, manifest, older)  # made already (an attempt that failed after its commit)
    present = [e.path for e in entries_recursive(store, CHECKPOINT_FOLDER, head) if isinstance(e, RepoFile)]
    ops: list[Any] = [CommitOperationDelete(path_in_repo=p) for p in present if p not in older]
    ops += [CommitOperationCopy(src_path_in_repo=p, path_in_repo=p, src_revision=old)
            for p in sorted(older) if p != manifest_path]
    if manifest_path in older:
        body = json.dumps({**manifest, "restored_from": record.restored_from}, indent=1).encode()
        ops.append(CommitOperationAdd(path_in_repo=manifest_path, path_or_fileobj=body))
    done = store.api.create_commit(
        store.repo_id, ops, commit_message=title.format(step=record.step), repo_type=store.repo_type,
        parent_commit=head, commit_description=f"Restored: the {CHECKPOINT_FOLDER}/ of record commit {old} (step "
                                               f"{record.step}), over step {record.restored_from}, suspect.")
    copied = [p for p in older if p != manifest_path]
    got = paths_info(store, copied, done.oid)
    problems = [f"{p} is not the file of commit {old[:12]}" for p in copied
                if p not in got or (got[p].size, got[p].blob_id) != (older[p].size, older[p].blob_id)]
    if problems:
        raise Mismatch(problems)
    return _restored(Record(step=record.step, run_id=record.run_id, files={}, revision=done.oid,
                            restored_from=record.restored_from), manifest, older)


def _restored(record: Record, manifest: dict[str, Any], older: dict[str, Any]) -> Record:
    """``record`` with its files: the manifest's sizes and sha256, else the tree's (an LFS file's sha256)."""
    named: dict[str, Any] = manifest["files"] if isinstance(manifest.get("files"), dict) else {}
    prefix = f"{CHECKPOINT_FOLDER}/"
    files: dict[str, FileSum] = {}
    for path, entry in older.items():
        rel = path[len(prefix):]
        if rel == MANIFEST_NAME:
            continue
        meta: dict[str, Any] = named[rel] if isinstance(named.get(rel), dict) else {}
        files[rel] = FileSum(int(meta.get("size", entry.size)),
                             str(meta.get("sha256") or (entry.lfs.sha256 if entry.lfs is not None else "")))
    return Record(step=record.step, run_id=record.run_id, files=files, revision=record.revision,
                  place=record.place, source=record.source, restored_from=record.restored_from)
