"""Many nodes, each with its own disk: Megatron-LM's dist-checkpointing layout (``torch_dist`` backend) over two
torchrun nodes on 127.0.0.1 (issue 34). Node 0's ``iter_<N>/`` holds ``common.pt``, its two shard files, the
coordinator's ``.metadata`` and ``metadata.json``, and ``latest_checkpointed_iteration.txt`` lies beside it; node 1's
holds only its two shard files. Megatron is not installed here: ``tests/jobs/megatron_parts_loop.py`` writes and
reads the layout as Megatron's save and load do. The fixtures and helpers are ``test_multinode_parts_e2e``'s (a file
of its own so that the test run spreads these slow tests over its workers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import JOBS
from multinode import Nodes, logs
from test_multinode_parts_e2e import FAST, Dest, _secured_at_the_deadline

pytestmark = [pytest.mark.slow]

#: The files of one iteration folder, both nodes' together.
WHOLE = {"common.pt", "metadata.json", ".metadata", "__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "__1_1.distcp"}


def _megatron(tmp_path: Path, dest: Dest, *guard_args: str, job_args: tuple[str, ...] = (),
              run_id: str = "multinode-run") -> Nodes:
    return Nodes(tmp_path, 2, JOBS / "megatron_parts_loop.py", run_id=run_id,
                 guard_args=[*FAST, "--output-dir", "{out}", "--push-to", dest.push_to, *guard_args],
                 job_args=["{out}", "--every", "20", "--step-s", "0.05", *job_args], env=dest.env)


def test_megatron_dist_checkpointing_over_two_disks_is_secured_whole_and_resumes_on_fresh_nodes(
        tmp_path: Path) -> None:
    """At the deadline both nodes say TIMEOUT exit=75 with one secured_step; the record holds the iteration folder
    whole (rank 0's common state and metadata, both ranks' shard files) and loads in one process. The next run on
    fresh folders (``--resume on``): each node gets the whole folder and the tracker file naming it, so that both
    ranks load that iteration as Megatron's ``load_checkpoint`` does (the tracker, then ``common.pt`` and the
    shards) and train on."""
    dest = Dest("folder", tmp_path, None)
    first = _megatron(tmp_path / "first", dest, "--timeout", "40s").start()
    step, fetched = _secured_at_the_deadline(first, tmp_path, dest)
    assert fetched.name == f"iter_{step:07d}", fetched
    assert {p.name for p in fetched.iterdir()} >= WHOLE, sorted(p.name for p in fetched.iterdir())
    assert {p.name for p in (first.out(1) / fetched.name).iterdir()} == {"__1_0.distcp", "__1_1.distcp"}
    assert json.loads((fetched / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    assert torch.load(fetched / "common.pt", weights_only=False)["iteration"] == step
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(fetched), str(tmp_path / "whole.pt"))
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    for rank in range(2):  # every node's own shard, of that step
        assert float(whole[f"rank{rank}.a"][0]) == rank * 1000 + step, rank

    second = _megatron(tmp_path / "second", dest, "--resume", "on", run_id="multinode-run-2",
                       job_args=("--steps", str(step + 10))).start()
    runs = second.wait(120)
    for run in runs:
        assert f"rank {run.node}: resumed from step {step}" in run.stdout, logs(runs)
        assert (second.out(run.node) / "latest_checkpointed_iteration.txt").read_text().strip() == str(step)
    assert [run.story()[0] for run in runs] == ["PASS", "PASS"], logs(runs)
