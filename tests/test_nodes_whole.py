"""Tests for ``guard.secure.nodes``: a many-node checkpoint is whole only when every node's part of this run's step
is at the destination, the parts agree, and their union meets the format's requirements."""

from __future__ import annotations

from guard.secure.dest.base import FileSum, PartManifest
from guard.secure.nodes import RecordCost, newest_whole, part_due_s, whole


def part(node: int, files: dict[str, int], *, step: int = 40, run_id: str = "r1", nodes: int = 2,
         requires: dict[str, int] | None = None, at: float = 1.0, sha: str = "") -> PartManifest:
    return PartManifest(run_id=run_id, step=step, node_rank=node, nodes=nodes,
                        files={path: FileSum(size, sha or f"{path}-{size}") for path, size in files.items()},
                        written_at_s=at, requires=requires or {})


# A DCP checkpoint over two nodes: .metadata and __0_0.distcp on node 0, __1_0.distcp on node 1; the metadata names
# both shards with the bytes each needs (offset + length).
DCP_REQUIRES = {".metadata": 1, "__0_0.distcp": 900, "__1_0.distcp": 800}


def test_a_dcp_checkpoint_is_whole_only_with_both_nodes_parts() -> None:
    node0 = part(0, {".metadata": 300, "__0_0.distcp": 900}, requires=DCP_REQUIRES)
    node1 = part(1, {"__1_0.distcp": 800})
    alone = whole([node0], run_id="r1", step=40, nodes=2)
    assert not alone.complete and alone.missing_nodes == (1,) and alone.missing_text() == "node1"
    assert alone.missing_files == ("__1_0.distcp",)
    assert "1 of 2 nodes' parts in (nodes 0); missing: node1" in alone.describe()
    both = whole([node1, node0], run_id="r1", step=40, nodes=2)
    assert both.complete and both.present == (0, 1) and set(both.files) == {".metadata", "__0_0.distcp",
                                                                            "__1_0.distcp"}


def test_a_short_shard_is_missing_though_every_node_reported() -> None:
    parts = [part(0, {".metadata": 300, "__0_0.distcp": 900}, requires=DCP_REQUIRES), part(1, {"__1_0.distcp": 10})]
    result = whole(parts, run_id="r1", step=40, nodes=2)
    assert not result.complete and result.missing_nodes == () and result.missing_files == ("__1_0.distcp",)
    assert result.missing_text() == "files"


def test_leftovers_of_another_run_or_step_never_count_and_the_later_manifest_stands() -> None:
    parts = [part(0, {"a": 1}), part(1, {"b": 1}, run_id="r0"), part(1, {"b": 1}, step=20),
             part(5, {"c": 1})]  # a node past the count (a different job's layout)
    result = whole(parts, run_id="r1", step=40, nodes=2)
    assert result.missing_nodes == (1,) and set(result.files) == {"a"}
    again = whole([part(0, {"a": 1}, at=1.0), part(0, {"a": 2}, at=2.0), part(1, {"b": 1})], run_id="r1", step=40,
                  nodes=2)
    assert again.complete and again.files["a"].size_bytes == 2


def test_replicated_files_agree_and_differing_ones_or_counts_conflict() -> None:
    same = whole([part(0, {"latest": 14, "z0": 5}), part(1, {"latest": 14, "z1": 5})], run_id="r1", step=40, nodes=2)
    assert same.complete  # DeepSpeed's `latest` on both nodes: the same file
    differ = whole([part(0, {"latest": 14}), part(1, {"latest": 14}, sha="other")], run_id="r1", step=40, nodes=2)
    assert not differ.complete and "latest differs between node 0 and node 1" in differ.conflicts[0]
    count = whole([part(0, {"a": 1}), part(1, {"b": 1}, nodes=3)], run_id="r1", step=40, nodes=2)
    assert not count.complete and count.missing_text() == "conflict"


def test_the_newest_whole_step_and_the_newest_step() -> None:
    parts = [part(0, {"a": 1}, step=20), part(1, {"b": 1}, step=20), part(0, {"a": 1}, step=40)]
    secured, newest = newest_whole(parts, run_id="r1", nodes=2)
    assert secured is not None and secured.step == 20
    assert newest is not None and newest.step == 40 and newest.missing_text() == "node1"
    assert newest_whole([], run_id="r1", nodes=2) == (None, None)


def test_each_part_is_due_the_record_time_before_the_deadline() -> None:
    cost = RecordCost(initial_s=10.0, keep=2)
    assert part_due_s(1000.0, cost, nodes=2) == 990.0 and part_due_s(1000.0, cost, nodes=1) == 1000.0
    for seconds in (3.0, 1.0, 2.0):
        cost.observe(seconds)
    assert cost.estimate_s == 2.0 and part_due_s(None, cost, nodes=4) is None
