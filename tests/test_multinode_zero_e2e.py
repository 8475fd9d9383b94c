"""Many nodes, each with its own disk: a DeepSpeed ZeRO layout over two torchrun nodes on 127.0.0.1 (issue 34).
Each node's ``global_stepN/`` holds its rank's ZeRO file; ``latest`` and the model states lie on node 0's disk:
the record holds every data-parallel rank's file, never rank 0's alone, and fresh nodes resume from the secured
tag. The fixtures and helpers are ``test_multinode_parts_e2e``'s (a file of its own so that the test run spreads
these slow tests over its workers)."""

from __future__ import annotations

from pathlib import Path

import pytest
import test_multinode_parts_e2e as parts
import torch
from conftest import JOBS
from multinode import Nodes, logs
from test_multinode_parts_e2e import FAST, Dest, _secured_at_the_deadline

pytestmark = [pytest.mark.slow]

#: The fixtures of test_multinode_parts_e2e, used here under the same names.
dest, hub, moto = parts.dest, parts.hub, parts.moto


def _zero(tmp_path: Path, dest: Dest, *job_args: str) -> Nodes:
    return Nodes(tmp_path, 2, JOBS / "zero_parts_loop.py",
                 guard_args=[*FAST, "--output-dir", "{out}", "--push-to", dest.push_to, "--timeout", "40s"],
                 job_args=["{out}", "--every", "20", "--step-s", "0.05", *job_args], env=dest.env)


def test_deepspeed_zero_shards_on_two_nodes_make_one_checkpoint(tmp_path: Path, dest: Dest) -> None:
    """A ZeRO layout over two disks (node 0: the tag's model states, rank 0's optimizer shard, ``latest``; node 1:
    rank 1's shard alone): both nodes TIMEOUT exit=75 with one secured_step, and the record holds every
    data-parallel rank's ZeRO file of that step."""
    nodes = _zero(tmp_path, dest).start()
    step, fetched = _secured_at_the_deadline(nodes, tmp_path, dest)
    states = torch.load(fetched / "mp_rank_00_model_states.pt", weights_only=True)
    assert states["global_steps"] == step and states["dp_world_size"] == 2
    for rank in range(2):  # every data-parallel rank's shard, of that step
        shard = torch.load(fetched / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", weights_only=True)
        assert float(shard["optimizer_state_dict"]["shard"][0]) == rank * 1000 + step, rank


@pytest.mark.parametrize("kind", ["folder", pytest.param("hub", marks=pytest.mark.hub)])
def test_deepspeed_zero_parts_resume_on_fresh_nodes_from_the_secured_tag(tmp_path: Path, kind: str,
                                                                         request: pytest.FixtureRequest) -> None:
    """The next run on fresh folders (``--resume on``): each node fetches the whole tag folder onto its own disk with
    ``latest`` naming it (it lay beside the tag, not in the record), and each rank loads its own ZeRO shard of that
    step and trains on. Before: no ``latest`` was written, and the job started from step 0. At a Hub repo each node
    fetches the record commit the parts were copied into."""
    dest = Dest(kind, tmp_path, None, request.getfixturevalue("hub") if kind == "hub" else None)
    step, _ = _secured_at_the_deadline(_zero(tmp_path / "first", dest).start(), tmp_path, dest)
    second = Nodes(tmp_path / "second", 2, JOBS / "zero_parts_loop.py", run_id="multinode-run-2",
                   guard_args=[*FAST, "--output-dir", "{out}", "--push-to", dest.push_to, "--resume", "on"],
                   job_args=["{out}", "--every", "20", "--step-s", "0.01", "--steps", str(step + 10)],
                   env=dest.env).start()
    runs = second.wait(120)
    for run in runs:
        assert f"rank {run.node}: resumed from step {step}" in run.stdout, logs(runs)
        assert (second.out(run.node) / "latest").read_text() == f"global_step{step}"
    assert {run.returncode for run in runs} == {0}, logs(runs)


def test_deepspeed_rank_0s_shard_alone_is_never_secured(tmp_path: Path, dest: Dest) -> None:
    """Node 1's rank never writes its ZeRO file: node 0 holds the model states, rank 0's shard and ``latest``, and
    no node may say secured=yes; the destination records nothing."""
    nodes = _zero(tmp_path, dest, "--no-shard", "1").start()
    try:
        runs = nodes.wait(150)
    finally:
        nodes.close()
    for run in runs:
        assert run.fields().get("status") == "TIMEOUT" and run.fields().get("secured") != "yes", logs(runs)
    assert runs[0].fields().get("missing") in (None, "node1"), logs(runs)
    assert dest.record() is None, logs(runs)
