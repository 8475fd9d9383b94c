"""Many nodes, each with its own disk: a ``transformers.Trainer`` over two torchrun nodes on 127.0.0.1 (issue 34).
Node 0's ``checkpoint-N`` holds the model, the optimizer, the trainer state and ``rng_state_0.pth``, node 1's only
``rng_state_1.pth``: every node's VERDICT tells the same story, the record holds every rank's part, and fresh nodes
resume from it. The fixtures and helpers are ``test_multinode_parts_e2e``'s (a file of its own so that the test
run spreads these slow tests over its workers)."""

from __future__ import annotations

import json
from collections.abc import Sequence
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


def _trainer(tmp_path: Path, dest: Dest, *guard_args: str, job_args: tuple[str, ...] = (),
             run_id: str | None = "multinode-run", node_guard_args: dict[int, Sequence[str]] | None = None) -> Nodes:
    return Nodes(tmp_path, 2, JOBS / "ddp_trainer.py", run_id=run_id, node_guard_args=node_guard_args,
                 guard_args=[*FAST, "--output-dir", "{out}", "--push-to", dest.push_to, *guard_args],
                 job_args=["--output-dir", "{out}", "--step-s", "0.1", *job_args], env=dest.env)


def test_a_trainer_resumes_on_fresh_nodes_with_every_ranks_part(tmp_path: Path) -> None:
    """The next run on fresh folders (``--resume on``): each node fetches the whole checkpoint (model, trainer state,
    both ranks' RNG states) onto its own disk, the Trainer resumes from it on both ranks (the agent passes
    ``resume_from_checkpoint``; rank 1 loads its own rng_state_1.pth, which lay on node 1's disk) and trains on."""
    dest = Dest("folder", tmp_path, None)
    first = _trainer(tmp_path / "first", dest, "--timeout", "50s", job_args=("--save-steps", "5"))
    step, _ = _secured_at_the_deadline(first.start(), tmp_path, dest)
    second = _trainer(tmp_path / "second", dest, "--resume", "on", run_id="multinode-run-2",
                      job_args=("--max-steps", str(step + 3))).start()
    runs = second.wait(150)
    assert [run.story()[0] for run in runs] == ["PASS", "PASS"], logs(runs)
    for run in runs:
        assert "resumed_from=" in run.verdict, logs(runs)
        held = second.out(run.node) / f"checkpoint-{step}"
        assert {"rng_state_0.pth", "rng_state_1.pth", "trainer_state.json"} <= {p.name for p in held.iterdir()}
        assert "did not load the resumed checkpoint" not in run.stdout, logs(runs)


@pytest.mark.parametrize("save_steps", ["5", "40"])
def test_a_trainers_checkpoint_over_two_disks_is_secured_whole(tmp_path: Path, dest: Dest, save_steps: str) -> None:
    """A Trainer on two nodes with local disks: node 0's checkpoint-N holds the model, the optimizer, the trainer
    state and rng_state_0.pth, node 1's only rng_state_1.pth. Every node says TIMEOUT exit=75 with one
    secured_step, and the record holds both ranks' RNG states with the model. Before: node 0 secured its folder as
    a whole checkpoint (rng_state_1.pth not required: the description did not know the job's world size) while
    node 1 put a part that never became whole and exited 143; with both as parts, saves every 0.5 s or 4 s (5 or
    40 steps) never met on one step within 150 s."""
    nodes = _trainer(tmp_path, dest, "--timeout", "50s", job_args=("--save-steps", save_steps)).start()
    step, fetched = _secured_at_the_deadline(nodes, tmp_path, dest)
    held = {p.relative_to(fetched).as_posix() for p in fetched.rglob("*") if p.is_file()}
    assert {"rng_state_0.pth", "rng_state_1.pth", "trainer_state.json", "model.safetensors"} <= held, held
    state = json.loads((fetched / "trainer_state.json").read_text())
    assert state["global_step"] == step
    for rank in range(2):  # each rank's own RNG state, loadable as the Trainer's resume loads it
        assert "cpu" in torch.load(fetched / f"rng_state_{rank}.pth", weights_only=False)


def test_node_0s_earlier_deadline_request_is_every_nodes_deadline(tmp_path: Path) -> None:
    """Node 0's margin is its own (its push moves the record: 4.6 s against node 1's 0.6 s at a Hub repo gave it a
    23 s margin), so its request to save and stop reaches every rank before node 1's own deadline request is due.
    Node 1's guard must take it as its deadline: secure its part of that step and say TIMEOUT exit=75 with node 0.
    Before, node 1's job ended on a request its guard never heard of: PASS exit=0, no part of that step put, and node
    0 said secured=no missing=node1 (here: margins of 25 s and 3 s given outright)."""
    dest = Dest("folder", tmp_path, None)
    nodes = _trainer(tmp_path, dest, "--timeout", "50s", job_args=("--save-steps", "40"),
                     node_guard_args={0: ["--margin", "25s"], 1: ["--margin", "3s"]}).start()
    step, fetched = _secured_at_the_deadline(nodes, tmp_path, dest)
    held = {p.name for p in fetched.rglob("*") if p.is_file()}
    assert {"rng_state_0.pth", "rng_state_1.pth", "trainer_state.json"} <= held, held
    assert json.loads((fetched / "trainer_state.json").read_text())["global_step"] == step


def test_two_trainer_nodes_without_a_run_id_meet_on_node_0s(tmp_path: Path, dest: Dest) -> None:
    """Plain torchrun: no ``--run-id``, no ``--rdzv-id``, no Slurm or Kubernetes job id, so each guard names its own
    run id. Node 0's guard's reaches the other nodes through the job's store (torchrun's TCPStore, which the agents
    already share), and node 1's guard takes it: the parts meet, every node says TIMEOUT exit=75 with one
    secured_step, and the record holds both ranks' RNG states with the model. Before: the two run ids never met,
    node 0's checkpoint-N (without rng_state_1.pth) was a part that never became whole, and both nodes said
    TIMEOUT secured=no exit=124 at the deadline."""
    nodes = _trainer(tmp_path, dest, "--timeout", "50s", run_id=None, job_args=("--save-steps", "5")).start()
    step, fetched = _secured_at_the_deadline(nodes, tmp_path, dest)
    held = {p.name for p in fetched.rglob("*") if p.is_file()}
    assert {"rng_state_0.pth", "rng_state_1.pth", "trainer_state.json", "model.safetensors"} <= held, held
    assert json.loads((fetched / "trainer_state.json").read_text())["global_step"] == step
    for node in range(2):  # which source named the run id, on each node
        said = nodes.stderr(node)
        assert ("goes to the other nodes through the job's store" if node == 0
                else "node 0's guard's, through the job's store") in said, said[-3000:]


@pytest.mark.hub
def test_a_trainers_checkpoint_over_two_disks_is_secured_whole_at_a_hub_repo(tmp_path: Path, hub: parts.HubServer) \
        -> None:
    """The same Trainer over two disks, secured to a Hub repo on the local Hub (Xet on): node 0's push also moves
    the record, so its margin is the larger and its deadline request reaches node 1's ranks first (the case of
    f6347fb: node 1 then said PASS exit=0). Both nodes say TIMEOUT exit=75 with one secured_step, and the record
    commit's ``last-checkpoint/`` holds both ranks' RNG states with the model and the trainer state."""
    dest = Dest("hub", tmp_path, None, hub)
    nodes = _trainer(tmp_path, dest, "--timeout", "50s", job_args=("--save-steps", "5")).start()
    step, fetched = _secured_at_the_deadline(nodes, tmp_path, dest)
    record = dest.record()
    assert record is not None and record.revision
    nodes_held, files = dest.held(record)
    assert nodes_held == 2, (nodes_held, files)
    assert {"rng_state_0.pth", "rng_state_1.pth", "trainer_state.json", "model.safetensors"} <= files, files
    assert json.loads((fetched / "trainer_state.json").read_text())["global_step"] == step
    for rank in range(2):
        assert "cpu" in torch.load(fetched / f"rng_state_{rank}.pth", weights_only=False)


def test_two_trainer_nodes_without_a_run_id_find_their_shared_folder_shared(tmp_path: Path) -> None:
    """No run id every node shares, one output folder for both nodes: node 1's output folder probe moves to node 0's
    run once node 0's run id reaches it through the job's store, so both find the folder shared, node 0 secures
    the one checkpoint, and node 1 takes its word: TIMEOUT exit=75 on both with one secured_step. Before, the probes
    sat under two run ids and never met (no answer within the 40 s run): node 0 said exit=75 secured=yes, node 1
    exit=124 secured=no ('the guard of node 0 secures the checkpoint of every rank: see its VERDICT')."""
    dest = Dest("folder", tmp_path, None)
    # node 1 waits for node 0's word up to half the grace and never within 5 s of the deadline: room for both
    nodes = _trainer(tmp_path, dest, "--timeout", "70s", "--margin", "30s", "--grace", "20s", run_id=None,
                     job_args=("--save-steps", "5"))
    nodes.shared = True
    step, fetched = _secured_at_the_deadline(nodes.start(), tmp_path, dest)
    held = {p.name for p in fetched.rglob("*") if p.is_file()}
    assert {"rng_state_0.pth", "rng_state_1.pth", "trainer_state.json"} <= held, held
    assert json.loads((fetched / "trainer_state.json").read_text())["global_step"] == step
    for node in range(2):
        assert "output folder: shared: the probes of nodes 0, 1" in nodes.stderr(node), nodes.stderr(node)[-3000:]
    probes = nodes.out(0) / ".guard" / "nodes"  # node 1's first probe, under its own run id, went when it moved
    left = sorted(p.relative_to(probes).as_posix() for p in probes.rglob("*")) if probes.exists() else []
    assert not [name for name in left if name.endswith("node-1.json")] and len({n.split("/")[0] for n in left}) <= 1, \
        left
