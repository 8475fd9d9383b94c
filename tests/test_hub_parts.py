"""Node parts at a Hub repo (guard.secure.dest.hub_parts), against the local Hub with Xet on: each node's part in
commits of its own under .guard/staging/, the record ONE commit that copies them into last-checkpoint/ (LFS and Xet
files by their sha256, nothing uploaded again), made only over an older record, decided again when the head moved,
and what resume reads."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from guard.secure.dest.base import MANIFEST_NAME, PartManifest, Record
from guard.secure.dest.hub import HubStore
from tests.hubserver import TOKENS
from tests.test_hub import api, hub, repo_id  # noqa: F401

pytest.importorskip("huggingface_hub")
from huggingface_hub import CommitOperationAdd, HfApi

pytestmark = [pytest.mark.hub]
RUN = "run-a"


def node_folder(root: Path, step: int, node: int) -> Path:
    """Node ``node``'s part of a DCP-like step: its shard (binary: LFS, Xet), and on node 0 a small regular file."""
    folder = root / f"node-{node}" / f"step_{step}"
    folder.mkdir(parents=True)
    (folder / f"__{node}_0.distcp").write_bytes(os.urandom(3000) + bytes([step, node]))
    if node == 0:
        (folder / "meta.json").write_text(json.dumps({"step": step}))
    return folder


def put(store: HubStore, root: Path, step: int, node: int, nodes: int = 2) -> PartManifest:
    folder = node_folder(root, step, node)
    return store.put_part(folder, sorted(p.name for p in folder.iterdir()), run_id=RUN, step=step, node_rank=node,
                          nodes=nodes, place=f"step_{step}", source="out", deadline=time.monotonic() + 60)


def test_every_nodes_part_becomes_one_record_commit_that_resume_reads(hub, api, repo_id, tmp_path):  # noqa: F811
    store = HubStore(repo_id, api=api)
    parts = [put(store, tmp_path, 20, node) for node in range(2)]
    assert {p.node_rank for p in store.parts(run_id=RUN, step=20, deadline=time.monotonic() + 60)} == {0, 1}
    assert store.part_steps(run_id=RUN, deadline=time.monotonic() + 60) == {20: {0, 1}}
    assert store.read_record(deadline=time.monotonic() + 60) is None or \
        store.read_record(deadline=time.monotonic() + 60).step is None  # a part's commits are never a record
    commits, requests = len(hub.commits(repo_id)), len(hub.requests)
    seen: list[Record] = []
    record = store.write_record(store.parts(run_id=RUN, step=20, deadline=time.monotonic() + 60),
                                deadline=time.monotonic() + 60, recorded=seen.append)
    assert len(hub.commits(repo_id)) == commits + 1  # one commit
    assert [r.revision for r in seen] == [record.revision] == [hub.commits(repo_id)[-1].oid]
    # the shards were copied by their sha256: no Xet transfer, no LFS upload for the record
    assert not [r for r in hub.requests[requests:] if "/cas/" in r.path or "/xet-write-token/" in r.path
                or r.method == "PUT"]
    there = hub.repo_files(repo_id, revision=record.revision)
    held = {p.split("/", 1)[1]: data for p, data in there.items() if p.startswith("last-checkpoint/")}
    manifest = json.loads(held.pop(MANIFEST_NAME))
    local = {rel: (tmp_path / f"node-{p.node_rank}" / "step_20" / rel).read_bytes() for p in parts for rel in p.files}
    assert held == local and set(local) == {"__0_0.distcp", "__1_0.distcp", "meta.json"}
    assert (manifest["step"], manifest["run_id"], manifest["nodes"]) == (20, RUN, 2)
    assert {rel: f["sha256"] for rel, f in manifest["files"].items()} == \
        {rel: hashlib.sha256(data).hexdigest() for rel, data in local.items()}
    read = store.read_record(deadline=time.monotonic() + 60)
    assert read is not None and (read.step, read.run_id, read.nodes, read.revision) == (20, RUN, 2, record.revision)
    (tmp_path / "fresh").mkdir()
    fetched = store.fetch(read, tmp_path / "fresh", deadline=time.monotonic() + 60)
    assert fetched is not None and fetched.path == tmp_path / "fresh" / "step_20"
    assert {p.name: p.read_bytes() for p in fetched.path.iterdir()} == local


def test_a_newer_step_replaces_the_record_and_older_staging_an_older_one_never_does(hub, api, repo_id,  # noqa: F811
                                                                                    tmp_path):
    store = HubStore(repo_id, api=api)
    older = [put(store, tmp_path / "a", 10, node) for node in range(2)]
    store.write_record(older, deadline=time.monotonic() + 60)
    newer = [put(store, tmp_path / "b", 20, node) for node in range(2)]
    late = put(store, tmp_path / "c", 15, 0)  # a slow node's put of a step between them
    record = store.write_record(newer, deadline=time.monotonic() + 60)
    assert record.step == 20
    files = set(hub.repo_files(repo_id))
    assert not [p for p in files if p.startswith((f".guard/staging/{RUN}/step-10/", f".guard/staging/{RUN}/step-15/"))]
    assert {p for p in files if p.startswith("last-checkpoint/")} == \
        {"last-checkpoint/__0_0.distcp", "last-checkpoint/__1_0.distcp", "last-checkpoint/meta.json",
         f"last-checkpoint/{MANIFEST_NAME}"}
    commits = len(hub.commits(repo_id))
    seen: list[Record] = []
    stands = store.write_record([late, put(store, tmp_path / "d", 15, 1)], deadline=time.monotonic() + 60,
                                recorded=seen.append)
    assert stands.step == 20 and not seen  # the newer record stands, not said to be step 15's
    assert [c.title for c in hub.commits(repo_id)[commits:]] == [
        "guard: upload of node 1's part of step 15, not verified yet",
        "guard: node 1's part of step 15 verified, not a record"]
    assert store.read_record(deadline=time.monotonic() + 60).step == 20


class CommitsFirst(HfApi):
    """A Hub client under which another writer's commit (a node's put) lands just before each of the first
    ``times`` record commits (``parent_commit`` set)."""

    def __init__(self, *args: Any, times: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.times = times

    def create_commit(self, repo: str, operations: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        if kwargs.get("parent_commit") and self.times > 0:
            self.times -= 1
            HfApi(endpoint=self.endpoint, token=TOKENS["write"]).create_commit(
                repo, [CommitOperationAdd(f"notes-{self.times}.txt", b"another writer")],
                commit_message="another writer")
        return super().create_commit(repo, operations, **kwargs)


def test_a_commit_between_the_decision_and_the_record_makes_it_decided_again(hub, repo_id, tmp_path):  # noqa: F811
    store = HubStore(repo_id, api=CommitsFirst(endpoint=hub.url, token=TOKENS["write"], times=2))
    parts = [put(store, tmp_path, 30, node) for node in range(2)]
    record = store.write_record(parts, deadline=time.monotonic() + 60)
    log = hub.commits(repo_id)
    assert [c.title for c in log[-3:]] == ["another writer", "another writer", "guard: checkpoint step 30"]
    assert record.revision == log[-1].oid and log[-1].parent == log[-2].oid  # on top of the head it was decided at
    assert store.read_record(deadline=time.monotonic() + 60).step == 30


def test_a_listing_of_the_parts_never_outlives_its_deadline(hub, api, repo_id, tmp_path):  # noqa: F811
    """The nodes' listings (the follower's, the end of run's) are bounded by the deadline they are given, as a
    push's requests are (guard.secure.hubhttp.bounded): a Hub that answers a tree listing after 3 s is given up on
    after the 1 s left."""
    from guard.secure.hubhttp import classify

    store = HubStore(repo_id, api=api)
    put(store, tmp_path, 10, 0)
    hub.inject(latency_s=3.0, methods=("GET",), path_contains="/tree/")
    started = time.monotonic()
    with pytest.raises(Exception) as caught:
        store.part_steps(run_id=RUN, deadline=time.monotonic() + 1.0)
    assert time.monotonic() - started < 2.5
    assert classify(caught.value)[0] == "deadline", caught.value
    hub.reset_faults()
    assert store.part_steps(run_id=RUN, deadline=time.monotonic() + 60) == {10: {0}}


def _staged(server: Any, repo: str) -> set[str]:
    """The run/step folders under .guard/staging/ at the repo's head."""
    return {"/".join(p.split("/")[2:4]) for p in server.repo_files(repo) if p.startswith(".guard/staging/")}


def _put_as(store: HubStore, root: Path, run: str, step: int, node: int) -> PartManifest:
    folder = node_folder(root / run, step, node)
    return store.put_part(folder, sorted(p.name for p in folder.iterdir()), run_id=run, step=step, node_rank=node,
                          nodes=2, place=f"step_{step}", source="out", deadline=time.monotonic() + 60)


def test_tidy_removes_staging_no_record_takes_and_keeps_the_records_step_and_live_runs(hub, api, repo_id,  # noqa: F811
                                                                                       tmp_path):
    """After the run: a run's staging left unchanged for a day (its nodes gone) goes whole, and so does a late part
    of a step older than the record of the record's run; the record's own step and a run that changed since stay
    (a node may still be reading or putting them). The record is untouched and still fetches. Before, tidy did
    nothing at a Hub repo and every run's staging stayed for good."""
    store = HubStore(repo_id, api=api)
    with hub.dated("2020-01-02T03:04:05.000Z"):
        _put_as(store, tmp_path, "run-old", 40, 0)  # a run long gone: node 1's part never came
    _put_as(store, tmp_path, "run-live", 70, 1)  # another run's part, put just now
    record = store.write_record([_put_as(store, tmp_path, RUN, 20, node) for node in range(2)],
                                deadline=time.monotonic() + 60)
    _put_as(store, tmp_path / "late", RUN, 10, 1)  # node 1's part of an older step, after the record
    assert _staged(hub, repo_id) == {"run-old/step-40", "run-live/step-70", f"{RUN}/step-20", f"{RUN}/step-10"}
    commits = len(hub.commits(repo_id))
    store.tidy(deadline=time.monotonic() + 60, nodes=2)
    log = hub.commits(repo_id)
    assert len(log) == commits + 1 and log[-1].title == "guard: remove node parts' staging that no record takes"
    assert _staged(hub, repo_id) == {"run-live/step-70", f"{RUN}/step-20"}
    read = store.read_record(deadline=time.monotonic() + 60)
    assert read is not None and (read.step, read.run_id, read.revision) == (20, RUN, record.revision)
    (tmp_path / "fresh").mkdir()
    assert store.fetch(read, tmp_path / "fresh", deadline=time.monotonic() + 60) is not None
    store.tidy(deadline=time.monotonic() + 60, nodes=2)  # nothing more to remove: no commit
    assert len(hub.commits(repo_id)) == commits + 1


def test_tidy_never_removes_what_a_commit_after_its_decision_put(hub, api, repo_id, tmp_path):  # noqa: F811
    """A commit lands between tidy's listing and its commit (another node's put or tidy): the tidy commit, made on
    top of exactly the head it decided at, is refused (412) and nothing is removed; after a one-node run tidy makes no
    request at all."""
    from huggingface_hub.errors import HfHubHTTPError

    from guard.secure.dest import hub_parts

    store = HubStore(repo_id, api=api)
    with hub.dated("2020-01-02T03:04:05.000Z"):
        _put_as(store, tmp_path, "run-old", 40, 0)
    racing = HubStore(repo_id, api=CommitsFirst(endpoint=hub.url, token=TOKENS["write"], times=1))
    with pytest.raises(HfHubHTTPError) as refused:
        hub_parts.tidy_staging(racing, now_s=time.time())
    assert refused.value.response.status_code == 412
    assert _staged(hub, repo_id) == {"run-old/step-40"}
    requests = len(hub.requests)
    HubStore(repo_id, api=api).tidy(deadline=time.monotonic() + 60, nodes=1)
    assert len(hub.requests) == requests and _staged(hub, repo_id) == {"run-old/step-40"}
