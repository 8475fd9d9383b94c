"""Many nodes, each with its own disk, secure one checkpoint together (issue 34): two torchrun nodes on 127.0.0.1,
each in its own folder under its own guard, a torch.distributed.checkpoint job (``step_N/`` with ``.metadata`` and
``__0_0.distcp`` on node 0's disk, ``__1_0.distcp`` on node 1's), a destination both nodes reach (a folder, as an
NFS mount would be; an S3 bucket on moto). Each node puts its own part; the record moves once every node's part
is in; every node's VERDICT tells the same story; the destination's bytes are a whole checkpoint that
``dcp_to_torch_save`` loads in one process. The deadline and a lost node run against a Hub repo too (the local Hub,
tests/hubserver.py, Xet on: the client's default)."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import JOBS
from multinode import NodeRun, Nodes, logs
from s3server import MotoServer
from s3server import env as s3_env

from guard.secure.dest.base import Record
from guard.secure.dest.folder import FolderStore
from guard.secure.dest.hub import HubStore
from guard.secure.dest.s3 import S3Store
from tests.hubserver import TOKENS, HubServer, client_constants

pytestmark = [pytest.mark.slow]

FAST = ["--no-preflight", "--grace", "8s", "--sanity-steps", "2"]

@pytest.fixture
def moto(tmp_path: Path) -> Iterator[MotoServer]:
    with MotoServer(tmp_path) as server:
        yield server


@pytest.fixture
def hub() -> Iterator[HubServer]:
    with client_constants(), HubServer() as server:
        yield server


class Dest:
    """Where the nodes secure to: ``push_to``, the guards' environment, and the record read back from it."""

    def __init__(self, kind: str, tmp_path: Path, moto: MotoServer | None, hub: HubServer | None = None) -> None:
        self.kind, self.moto = kind, moto
        if kind == "hub":
            assert hub is not None
            from huggingface_hub import HfApi

            self.push_to, self.env = "hf://alice/many-nodes", hub.env(token=TOKENS["write"], hf_home=tmp_path / "hf")
            self.store = HubStore("alice/many-nodes", api=HfApi(endpoint=hub.url, token=TOKENS["write"]))
        elif kind == "s3":
            assert moto is not None
            bucket = moto.bucket()
            self.push_to, self.env = f"s3://{bucket}/run", s3_env(moto.url)
            self.store: Any = S3Store(bucket, "run", client=moto.client())
        else:
            self.push_to, self.env = str(tmp_path / "dest"), {}
            self.store = FolderStore(tmp_path / "dest")
        self.hub, self.root = hub, tmp_path / "dest"

    def record(self) -> Record | None:
        return self.store.read_record(deadline=time.monotonic() + 60)

    def held(self, record: Record) -> tuple[int, set[str]]:
        """What ``record`` holds, read at the destination: the node count its manifest (or S3 record) says, and
        the checkpoint's files there (the folder's, or the Hub repo's ``last-checkpoint/`` at the record commit)."""
        if self.kind == "s3":
            return record.nodes, set(record.files)
        if self.kind == "hub":
            assert self.hub is not None
            there = self.hub.repo_files("alice/many-nodes", revision=record.revision)
            held = json.loads(there["last-checkpoint/guard_manifest.json"])
            files = {path.split("/", 1)[1] for path in there if path.startswith("last-checkpoint/")}
            assert files - {"guard_manifest.json"} == set(held["files"]), (files, held)
            return held["nodes"], files
        held = json.loads((self.root / "last-checkpoint" / "guard_manifest.json").read_text())
        return held["nodes"], set(held["files"])


@pytest.fixture(params=["folder", "s3"])
def dest(request: pytest.FixtureRequest, tmp_path: Path) -> Dest:
    moto = request.getfixturevalue("moto") if request.param == "s3" else None
    return Dest(request.param, tmp_path, moto)


@pytest.fixture(params=["folder", "s3", pytest.param("hub", marks=pytest.mark.hub)])
def any_dest(request: pytest.FixtureRequest, tmp_path: Path) -> Dest:
    """``dest``, and a Hub repo on the local Hub (Xet on)."""
    moto = request.getfixturevalue("moto") if request.param == "s3" else None
    hub = request.getfixturevalue("hub") if request.param == "hub" else None
    return Dest(request.param, tmp_path, moto, hub)


def _nodes(tmp_path: Path, dest: Dest, *guard_args: str, n: int = 2, run_id: str | None = "multinode-run") -> Nodes:
    return Nodes(tmp_path, n, JOBS / "dcp_loop.py",
                 guard_args=[*FAST, "--output-dir", "{out}", "--push-to", dest.push_to, *guard_args],
                 job_args=["{out}", "--every", "20", "--step-s", "0.05"], env=dest.env, run_id=run_id)


def test_at_the_deadline_both_nodes_parts_make_one_whole_checkpoint(tmp_path: Path, any_dest: Dest) -> None:
    """Before: 'nothing in node-0/out was recognisable as a complete checkpoint', TIMEOUT exit=124 secured=no on
    both nodes of a job that saved every 20 steps (node 0 holds .metadata and its shard, node 1 only its shard).
    At a Hub repo, before its store kept node parts: node 0 alone secured, its part never whole by format, both
    nodes TIMEOUT exit=124 secured=no at step 560 ('nothing in node-0/out was recognisable')."""
    dest = any_dest
    nodes = _nodes(tmp_path, dest, "--timeout", "45s").start()
    try:
        runs = nodes.wait(150)
    finally:
        nodes.close()
    # missing= too: node 1 holding its part of a step newer than node 0 chose said missing=node0 while node 0 said
    # nothing (a lost node 0's rule, 57a7cd6, applied at a deadline where node 0 was there)
    stories = {(run.fields().get("status"), run.fields().get("exit"), run.fields().get("secured"),
                run.fields().get("secured_step"), run.fields().get("missing")) for run in runs}
    assert len(stories) == 1, logs(runs)
    status, code, secured, secured_step, _ = stories.pop()
    assert (status, code, secured) == ("TIMEOUT", "75", "yes"), logs(runs)
    record = dest.record()
    assert record is not None and str(record.step) == secured_step
    nodes_held, files = dest.held(record)
    assert nodes_held == 2 and {".metadata", "__0_0.distcp", "__1_0.distcp"} <= files, (nodes_held, files)
    # the next run's fetch on a fresh node: the whole checkpoint, every file verified, loads in one process
    (tmp_path / "fresh").mkdir()
    fetched = dest.store.fetch(record, tmp_path / "fresh", deadline=time.monotonic() + 60)
    assert fetched is not None
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(fetched.path), str(tmp_path / "whole.pt"))
    state = torch.load(tmp_path / "whole.pt", weights_only=True)
    assert any(torch.is_tensor(v) for v in _leaves(state)), state.keys()


def test_a_plain_loop_on_two_nodes_without_a_run_id_meets_on_node_0s(tmp_path: Path) -> None:
    """A loop that never calls the guard's API (``dcp.save`` only), plain torchrun with no ``--run-id``: its ranks
    read node 0's guard's run id from the job's store at their loss reads too. Before, only a ``should_checkpoint``
    call read the store, so node 1 kept its own run id: both nodes TIMEOUT exit=124 secured=no, node 0
    missing=node1 (the by-hand recipe of docs/many-nodes.md without its --run-id)."""
    dest = Dest("folder", tmp_path, None, None)
    nodes = _nodes(tmp_path, dest, "--timeout", "45s", run_id=None).start()
    try:
        runs = nodes.wait(150)
    finally:
        nodes.close()
    stories = {(run.fields().get("status"), run.fields().get("exit"), run.fields().get("secured"),
                run.fields().get("secured_step")) for run in runs}
    assert len(stories) == 1 and stories.pop()[:3] == ("TIMEOUT", "75", "yes"), logs(runs)
    record = dest.record()
    assert record is not None and dest.held(record)[0] == 2
    assert "node 0's guard's, through the job's store" in nodes.stderr(1), logs(runs)


def test_three_nodes_at_the_deadline_say_one_step_and_their_parts_load_as_one(tmp_path: Path) -> None:
    """Three nodes, a folder destination: every node says TIMEOUT exit=75 with one secured_step; the record holds
    .metadata and the three nodes' shards (``nodes: 3``), and the fetched checkpoint loads in one process."""
    dest = Dest("folder", tmp_path, None)
    nodes = _nodes(tmp_path, dest, "--timeout", "40s", n=3).start()
    try:
        runs = nodes.wait(150)
    finally:
        nodes.close()
    assert len(runs) == 3, logs(runs)
    status, code, secured, secured_step, returncode = _one_story(runs)
    assert (status, code, secured, returncode) == ("TIMEOUT", "75", "yes", 75), logs(runs)
    record = dest.record()
    assert record is not None and str(record.step) == secured_step, logs(runs)
    held = json.loads((tmp_path / "dest" / "last-checkpoint" / "guard_manifest.json").read_text())
    shards = {".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"}
    assert held["nodes"] == 3 and shards <= set(held["files"]), held
    assert shards <= {p.name for p in (tmp_path / "dest" / "last-checkpoint").rglob("*")}
    (tmp_path / "fresh").mkdir()
    fetched = dest.store.fetch(record, tmp_path / "fresh", deadline=time.monotonic() + 60)
    assert fetched is not None
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(fetched.path), str(tmp_path / "whole.pt"))
    state = torch.load(tmp_path / "whole.pt", weights_only=True)
    step = int(state["step"])
    assert step == int(secured_step), (step, secured_step)
    for rank in range(3):  # every node's own shard, of that step
        assert float(state[f"rank{rank}"][0]) == rank * 1000 + step, rank


def test_a_node_lost_mid_run_never_makes_the_other_say_its_newest_step_is_secured(tmp_path: Path,
                                                                                    any_dest: Dest) -> None:
    """Every process of node 1 killed (a lost node): node 0's part of a later step never becomes whole; node 0's
    VERDICT never claims a step the bucket does not hold whole, and names node 1 when a push of its ended for want
    of node 1's part."""
    dest = any_dest
    nodes = _nodes(tmp_path, dest, "--timeout", "60s").start()
    try:
        assert nodes.wait_for(lambda: len(list((nodes.out(1)).glob("step_*"))) >= 3, 120), logs(nodes.wait(5))
        nodes.lose(1)  # node 1's guard and every process of its job, at once
        runs = nodes.wait(150)
    finally:
        nodes.close()
    node0 = runs[0].fields()
    record = dest.record()
    secured_step = node0.get("secured_step")
    if record is None or record.step is None:  # a Hub repo with no record reads as the commit below the uploads
        assert node0.get("secured") == "no", logs(runs)
    else:
        assert secured_step == str(record.step), logs(runs)  # the VERDICT names what the bucket holds
    assert node0.get("missing") in (None, "node1"), logs(runs)
    assert node0.get("status") in ("FAIL", "TIMEOUT") and node0.get("node") == "0", logs(runs)


def _secured_at_the_deadline(nodes: Nodes, tmp_path: Path, dest: Dest) -> tuple[int, Path]:
    """Every node's VERDICT says TIMEOUT exit=75 secured=yes with one secured_step (the guards' exit code 75), the
    record names that step: ``(step, the record fetched into tmp_path/fresh, every file verified)``."""
    try:
        runs = nodes.wait(150)
    finally:
        nodes.close()
    status, code, secured, secured_step, returncode = _one_story(runs)
    assert (status, code, secured, returncode) == ("TIMEOUT", "75", "yes", 75), logs(runs)
    record = dest.record()
    assert record is not None and str(record.step) == secured_step, logs(runs)
    (tmp_path / "fresh").mkdir()
    fetched = dest.store.fetch(record, tmp_path / "fresh", deadline=time.monotonic() + 60)
    assert fetched is not None
    return int(record.step), fetched.path


def _one_story(runs: list[NodeRun]) -> tuple[str | None, str | None, str | None, str | None, int]:
    """What every node's VERDICT must tell alike: status, exit, secured, secured_step, and the guard's exit code."""
    stories = {(run.fields().get("status"), run.fields().get("exit"), run.fields().get("secured"),
                run.fields().get("secured_step"), run.returncode) for run in runs}
    assert len(stories) == 1, logs(runs)
    return stories.pop()


@pytest.mark.parametrize("kind", ["folder", pytest.param("hub", marks=pytest.mark.hub)])
def test_a_part_that_never_comes_is_named_alike_in_every_nodes_verdict(tmp_path: Path, kind: str,
                                                                       request: pytest.FixtureRequest) -> None:
    """Node 1's guard watches a folder its job never saves in (node 0's watches its job's): node 1's part of no
    step ever comes, while node 0 puts its part of every save. Both nodes' VERDICTs say missing=node1, read from the
    destination at the end. Before, node 1's own pushes had seen nothing missing and its VERDICT said nothing of it
    (in another run node 0 said missing=node1 of step 620 while node 1's last push was of step 640). At a Hub repo,
    before, node 0 secured alone and found nothing whole: secured=no, missing= never said."""
    dest = Dest(kind, tmp_path, None, request.getfixturevalue("hub") if kind == "hub" else None)
    (tmp_path / "node-0").mkdir()
    (tmp_path / "node-0" / "watch").symlink_to(tmp_path / "node-0" / "out")
    (tmp_path / "node-1" / "watch").mkdir(parents=True)
    nodes = Nodes(tmp_path, 2, JOBS / "dcp_loop.py",
                  guard_args=[*FAST, "--output-dir", "watch", "--push-to", dest.push_to, "--timeout", "30s"],
                  job_args=["{out}", "--every", "20", "--step-s", "0.05"], env=dest.env).start()
    try:
        runs = nodes.wait(120)
    finally:
        nodes.close()
    said = [run.fields() for run in runs]
    assert [fields.get("missing") for fields in said] == ["node1", "node1"], logs(runs)
    assert {(f.get("status"), f.get("exit"), f.get("secured")) for f in said} == {("TIMEOUT", "124", "no")}, \
        logs(runs)
    record = dest.record()
    assert record is None or record.step is None, record
    parts = dest.store.part_steps(run_id="multinode-run", deadline=time.monotonic() + 60)
    assert parts and all(nodes == {0} for nodes in parts.values()), parts


def _leaves(obj: object) -> list[object]:
    if isinstance(obj, dict):
        return [leaf for value in obj.values() for leaf in _leaves(value)]
    return [obj]


def test_a_lost_node_0_is_named_in_the_other_nodes_verdict(tmp_path: Path, dest: Dest) -> None:
    """Every process of node 0 killed, its guard too (a lost node 0: the one that leads the steps, moves the
    record and hosts torchrun's store). Node 1's job fails on its lost peer; its guard says so: node 0 gone,
    missing=node0 of the newest step it holds a part of, secured_step= the record's step (what the destination
    holds whole, never more), and a hint that names node 0."""
    nodes = _nodes(tmp_path, dest, "--timeout", "90s").start()
    try:
        assert nodes.wait_for(lambda: dest.record() is not None and len(list(nodes.out(1).glob("step_*"))) >= 4,
                              120), logs(nodes.wait(5))
        nodes.lose(0)
        runs = nodes.wait(150)
    finally:
        nodes.close()
    node1 = runs[1].fields()
    record = dest.record()
    assert record is not None and record.step is not None
    assert node1.get("node") == "1" and node1.get("secured_step") == str(record.step), logs(runs)
    assert node1.get("status") == "FAIL" and node1.get("missing") == "node0", logs(runs)  # before: no missing=
    said = re.search(r"checkpoint step (\d+) is not whole at the destination, missing node0: node 0 put no part",
                     node1.get("hint", ""))
    assert said is not None and int(said[1]) > record.step, logs(runs)  # its newest part, never made whole
    assert (nodes.out(1) / f"step_{said[1]}").is_dir() and runs[0].verdict == "", logs(runs)


@pytest.mark.parametrize("kind", ["folder", "s3", pytest.param("hub", marks=pytest.mark.hub)])
def test_a_job_that_ends_by_itself_secures_its_last_save_on_every_node(tmp_path: Path, kind: str,
                                                                        request: pytest.FixtureRequest) -> None:
    """A loop that ends by itself (exit 0, no final model file: its last DCP save, step 200, is what it leaves):
    every node puts its part of step 200, the record moves to it, and both VERDICTs say PASS with it, node 0 about
    when node 1 is done. Before, at a Hub repo, node 1's guard ended at its job's exit holding its part of step
    200 (it feeds a part only once node 0's part of that step is listed there) while node 0 waited its whole final
    window (178 s) for it: node 0 PASS after 203.7 s against 26.0 s for node 1, the record at step 20."""
    moto = request.getfixturevalue("moto") if kind == "s3" else None
    dest = Dest(kind, tmp_path, moto, request.getfixturevalue("hub") if kind == "hub" else None)
    nodes = Nodes(tmp_path, 2, JOBS / "dcp_loop.py", guard_args=[*FAST, "--output-dir", "{out}", "--push-to",
                                                                 dest.push_to],
                  job_args=["{out}", "--every", "20", "--step-s", "0.05", "--steps", "200"], env=dest.env)
    started = time.monotonic()
    nodes.start()
    ended: dict[int, float] = {}
    try:
        while len(ended) < 2 and time.monotonic() < started + 400:
            for node, proc in enumerate(nodes.procs_started):
                if node not in ended and proc.poll() is not None:
                    ended[node] = time.monotonic() - started
            time.sleep(0.1)
        runs = nodes.wait(5)
    finally:
        nodes.close()
    said = [run.fields() for run in runs]
    assert [(f.get("status"), f.get("exit"), run.returncode) for f, run in zip(said, runs, strict=True)] == \
        [("PASS", "0", 0)] * 2, logs(runs)
    # the same checkpoint on both nodes: each its own part of the last save, pushed at the same record
    assert [Path(f.get("checkpoint", "")).name for f in said] == ["step_200"] * 2, logs(runs)
    assert said[0].get("pushed") == said[1].get("pushed") and said[0].get("pushed"), logs(runs)
    record = dest.record()
    assert record is not None and record.step == 200, (record, logs(runs))
    nodes_held, files = dest.held(record)
    assert nodes_held == 2 and {".metadata", "__0_0.distcp", "__1_0.distcp"} <= files, (nodes_held, files)
    # node 0 ends once the record is written, not at its final window's end (180 s by default): 60 s is far more
    # than the last part's push and the record's commit take, far less than the window
    assert ended[0] < ended[1] + 60, (ended, logs(runs))
