"""Sharded checkpoint formats: what each format says a checkpoint must hold (``formats.requires``), checked on one
node and as the union of several nodes' parts; the scan finds them by format (``step-N``, ``iter_N`` folders) and,
for a job of several nodes, a node's own part (``CheckpointInfo.part``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from guard.secure import checkpoints, formats

torch = pytest.importorskip("torch")

OLD_S = time.time() - 60  # files of a finished save: older than the settle time


def settle(folder: Path) -> None:
    for path in folder.rglob("*"):
        os.utime(path, (OLD_S, OLD_S))


@pytest.fixture(scope="module")
def dcp_two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real ``torch.distributed.checkpoint`` save of two ranks (gloo, one process each), each rank its own
    tensor: ``.metadata``, ``__0_0.distcp``, ``__1_0.distcp``."""
    base = tmp_path_factory.mktemp("dcp")
    code = textwrap.dedent("""
        import sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
        import torch.multiprocessing as mp
        def run(rank, out, init):
            dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=2)
            dcp.save({"w%d" % rank: torch.full((100,), float(rank))}, checkpoint_id=out)
            dist.destroy_process_group()
        if __name__ == "__main__":
            mp.spawn(run, args=(sys.argv[1], sys.argv[2]), nprocs=2)
    """)
    out = base / "step-20"
    (base / "save.py").write_text(code)  # spawn's children import the main module: a file, not -c
    subprocess.run([sys.executable, str(base / "save.py"), str(out), str(base / "init")], check=True, timeout=120,
                   capture_output=True)
    settle(out)
    return out


def sizes(*folders: Path) -> dict[str, int]:
    """The union of the folders' files, ``{rel: size}``."""
    out: dict[str, int] = {}
    for folder in folders:
        out.update({p.relative_to(folder).as_posix(): p.stat().st_size for p in folder.rglob("*") if p.is_file()})
    return out


def test_a_dcp_checkpoint_requires_every_shard_its_metadata_names_with_its_bytes(dcp_two_ranks: Path) -> None:
    required = formats.requires(dcp_two_ranks)
    assert set(required) == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    assert 0 < required["__1_0.distcp"] <= (dcp_two_ranks / "__1_0.distcp").stat().st_size
    assert formats.missing_required(required, sizes(dcp_two_ranks)) == []
    cut = {**sizes(dcp_two_ranks), "__1_0.distcp": required["__1_0.distcp"] - 1}
    assert formats.missing_required(required, cut) == [
        f"__1_0.distcp ({required['__1_0.distcp'] - 1} of {required['__1_0.distcp']} bytes)"]


def test_two_nodes_parts_of_a_dcp_checkpoint_are_complete_only_as_a_union(dcp_two_ranks: Path,
                                                                            tmp_path: Path) -> None:
    node0, node1 = tmp_path / "n0" / "ckpt" / "step-20", tmp_path / "n1" / "ckpt" / "step-20"
    node0.mkdir(parents=True)
    node1.mkdir(parents=True)
    for name, node in ((".metadata", node0), ("__0_0.distcp", node0), ("__1_0.distcp", node1)):
        shutil.copy2(dcp_two_ranks / name, node / name)
    required = {**formats.requires(node0), **formats.requires(node1)}
    assert formats.missing_required(required, sizes(node0)) == ["__1_0.distcp (missing)"]
    assert formats.missing_required(required, sizes(node0, node1)) == []
    now = time.time()
    # one node: node 0's folder alone is no complete checkpoint (issue 34: "secured=yes" for rank 0's shard only)
    assert checkpoints.newest_complete(node0.parent, now_s=now, loose=False) is None
    # several nodes: each node's folder is its part, by its format
    part0 = checkpoints.newest_complete(node0.parent, now_s=now, loose=False, parts=True)
    part1 = checkpoints.newest_complete(node1.parent, now_s=now, loose=False, parts=True)
    assert part0 is not None and part0.part and part0.step == 20 and dict(part0.requires) == required
    assert part1 is not None and part1.part and part1.files == ("__1_0.distcp",)


def test_a_whole_dcp_checkpoint_in_a_step_folder_is_found(dcp_two_ranks: Path) -> None:
    found = checkpoints.newest_complete(dcp_two_ranks.parent, now_s=time.time(), loose=False)
    assert found is not None and found.path == dcp_two_ranks and found.step == 20 and not found.part
    assert dict(found.requires) == formats.requires(dcp_two_ranks)


def test_megatron_dist_checkpointing_requires_its_common_state(dcp_two_ranks: Path, tmp_path: Path) -> None:
    folder = tmp_path / "iter_0000100"
    shutil.copytree(dcp_two_ranks, folder)
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                      "common_backend": "torch", "common_backend_version": 1}))
    settle(folder)
    assert "common.pt" in formats.requires(folder)
    now = time.time()
    assert checkpoints.newest_complete(tmp_path, now_s=now, loose=False) is None  # rank 0's common.pt not there
    torch.save({"args": None}, folder / "common.pt")
    settle(folder)
    found = checkpoints.newest_complete(tmp_path, now_s=now, loose=False)
    assert found is not None and found.step == 100


def deepspeed_tag(folder: Path, ranks: range, dp_world_size: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"module": {"w": torch.ones(2)}, "dp_world_size": dp_world_size, "mp_world_size": 1,
                "global_steps": 5}, folder / "mp_rank_00_model_states.pt")
    for rank in ranks:
        torch.save({"optimizer_state_dict": {"r": rank}}, folder / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    (folder.parent / "latest").write_text(folder.name)
    settle(folder.parent)


def test_deepspeed_requires_every_data_parallel_ranks_zero_file(tmp_path: Path) -> None:
    # DeepSpeed #5452 / gpt-neox #765: with node-local storage each node holds its own ranks' ZeRO shards
    node0, node1 = tmp_path / "n0" / "global_step5", tmp_path / "n1" / "global_step5"
    deepspeed_tag(node0, range(0, 2), dp_world_size=4)
    deepspeed_tag(node1, range(2, 4), dp_world_size=4)
    required = formats.requires(node0)
    assert set(required) == {"mp_rank_00_model_states.pt",
                             *(f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(4))}
    assert formats.missing_required(required, sizes(node0, node1)) == []
    now = time.time()
    assert checkpoints.newest_complete(node0.parent, now_s=now, loose=False) is None
    why = checkpoints.why_incomplete(node0, now_s=now)
    assert why is not None and "zero_pp_rank_2_mp_rank_00_optim_states.pt (missing)" in why
    part = checkpoints.newest_complete(node0.parent, now_s=now, loose=False, parts=True)
    assert part is not None and part.part and part.step == 5


def test_a_zero_shard_alone_without_latest_is_a_nodes_part(tmp_path: Path) -> None:
    # global rank 0 writes the model states and ``latest`` on node 0's disk; node 1's tag folder holds its ZeRO file
    # alone, with no ``latest`` beside it: this node's part once settled, never a whole checkpoint
    folder = tmp_path / "n1" / "global_step5"
    folder.mkdir(parents=True)
    torch.save({"optimizer_state_dict": {"r": 1}}, folder / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    settle(folder.parent)
    now = time.time()
    assert checkpoints.newest_complete(folder.parent, now_s=now, loose=False) is None  # one node: no latest
    part = checkpoints.newest_complete(folder.parent, now_s=now, loose=False, parts=True)
    assert part is not None and part.part and part.step == 5
    assert "mp_rank_00_model_states.pt" in dict(part.requires)
    # saved by torch.save and trained on past: taken at once as the node's part, no settle time
    fresh = time.time()
    found, why = checkpoints.saved_folder(folder, now_s=fresh, world_size=2, parts=True)
    assert found is not None and found.part and found.step == 5, why
    assert checkpoints.saved_folder(folder, now_s=fresh, world_size=2)[0] is None  # one node: no latest
    (folder.parent / "latest").write_text("global_step4")  # a latest naming an older tag: still being written
    assert checkpoints.newest_complete(folder.parent, now_s=now, loose=False, parts=True) is None


@pytest.mark.parametrize(("name", "world_size"), [("rng_state_{}.pth", 2), ("random_states_{}.pkl", 3)])
def test_per_rank_files_of_the_trainer_and_accelerate_are_required_for_every_rank(tmp_path: Path, name: str,
                                                                                  world_size: int) -> None:
    folder = tmp_path / "checkpoint-7"
    folder.mkdir()
    (folder / name.format(0)).write_bytes(b"x")
    required = formats.requires(folder, world_size=world_size)
    assert set(required) == {name.format(r) for r in range(world_size)}
    assert formats.missing_required(required, sizes(folder)) == [f"{name.format(r)} (missing)"
                                                                 for r in range(1, world_size)]
    assert set(formats.requires(folder)) == {name.format(0)}  # world size unknown: the ranks seen


def test_a_plain_folder_requires_nothing(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(2)}, tmp_path / "model.pt")
    assert formats.requires(tmp_path) == {}
    assert formats.requires(tmp_path / "missing") == {}


def test_a_deepspeed_tag_placed_back_is_named_by_latest(tmp_path: Path) -> None:
    """DeepSpeed's ``latest`` lies beside the tag folder, so the record holds the tag alone: placed back, the tag is
    named by a ``latest`` written beside it (DeepSpeed's ``load_checkpoint`` reads it), unless one names a later
    tag."""
    import logging

    from guard.secure.dest.local import place_fetched

    def fetched(step: int) -> Path:
        folder = tmp_path / f"download-{step}"
        folder.mkdir()
        (folder / "mp_rank_00_model_states.pt").write_bytes(b"x")
        return folder

    out = tmp_path / "out"
    out.mkdir()
    log = logging.getLogger("test")
    placed = place_fetched(fetched(5), out, 5, "rev", ["mp_rank_00_model_states.pt"], 1, "global_step5", "dest", log)
    assert placed.path == out / "global_step5" and (out / "latest").read_text() == "global_step5"
    (out / "latest").write_text("global_step9")  # the job's own later save: kept
    place_fetched(fetched(7), out, 7, "rev", ["mp_rank_00_model_states.pt"], 1, "global_step7", "dest", log)
    assert (out / "latest").read_text() == "global_step9"
    place_fetched(fetched(3), out, 3, "rev", ["mp_rank_00_model_states.pt"], 1, "checkpoint-3", "dest", log)
    assert (out / "latest").read_text() == "global_step9"  # not a DeepSpeed tag
    assert not list(out.glob(".latest.tmp-*"))


def test_a_megatron_iteration_placed_back_is_named_by_its_tracker_file(tmp_path: Path) -> None:
    """Megatron-LM's ``latest_checkpointed_iteration.txt`` lies beside ``iter_<N>/`` and its ``load_checkpoint``
    starts from scratch without it: placed back (by its name, a checkpoint folder of its own: ``placement``), the
    iteration is named there, unless the tracker names a later one. Before, the record's place was ``.`` (the files
    at the output folder's top) and no tracker was written: both ranks of the next run started from random."""
    import logging

    from guard.secure.dest.local import place_fetched, placement

    def fetched(step: int) -> Path:
        folder = tmp_path / f"download-{step}"
        folder.mkdir()
        (folder / "common.pt").write_bytes(b"x")
        return folder

    out, log = tmp_path / "out", logging.getLogger("test")
    out.mkdir()
    assert placement(out / "iter_0000100")["place"] == "iter_0000100"
    assert placement(out / "step-20")["place"] == "step-20"  # torchtitan's DCP folders, placed by name too
    placed = place_fetched(fetched(100), out, 100, "rev", ["common.pt"], 1, "iter_0000100", "dest", log)
    tracker = out / "latest_checkpointed_iteration.txt"
    assert placed.path == out / "iter_0000100" and tracker.read_text() == "100"
    tracker.write_text("300")  # the job's own later save: kept
    place_fetched(fetched(200), out, 200, "rev", ["common.pt"], 1, "iter_0000200", "dest", log)
    assert tracker.read_text() == "300" and not (out / "latest").exists()
