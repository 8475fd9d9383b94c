"""Tests for ``guard.run.nodes`` (this node's index, the node count and the run id, and their sources) and the
options ``--node-rank``, ``--nodes``, ``--run-id`` in ``guard.run.config``."""

from __future__ import annotations

import pytest

from guard.errors import UsageError
from guard.run.config import Config, resolve
from guard.run.nodes import resolve_node

TORCHRUN = ("torchrun", "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "1", "train.py")


def test_torchrun_arguments_come_before_slurm_and_the_flags() -> None:
    node = resolve_node({"SLURM_NODEID": "0", "SLURM_NNODES": "3", "SLURM_JOB_ID": "42"}, TORCHRUN,
                        node_rank=5, nodes=6)
    assert (node.node_rank, node.nodes) == (1, 2)
    assert (node.node_rank_source, node.nodes_source) == ("torchrun --node-rank", "torchrun --nnodes")
    assert node.run_id == "slurm-42" and node.run_id_source == "SLURM_JOB_ID"
    assert any("SLURM_NODEID 0" in c for c in node.conflicts) and any("--nodes 6" in c for c in node.conflicts)


@pytest.mark.parametrize("command", [
    ("torchrun", "--nnodes=2", "--node_rank=1", "t.py"),
    ("python", "-m", "torch.distributed.run", "--nnodes", "1:2", "--node-rank", "1", "t.py"),
    ("accelerate", "launch", "--num_machines", "2", "--machine_rank", "1", "t.py"),
])
def test_launcher_forms(command: tuple[str, ...]) -> None:
    node = resolve_node({}, command)
    assert (node.node_rank, node.nodes) == (1, 2), node
    assert node.node_rank_source.split()[0] in ("torchrun", "accelerate")


def test_torchrun_env_form_and_rdzv_id() -> None:
    node = resolve_node({"PET_NODE_RANK": "1", "PET_NNODES": "2", "PET_RDZV_ID": "job7"}, ("torchrun", "t.py"))
    assert (node.node_rank, node.nodes, node.run_id) == (1, 2, "job7")
    assert node.run_id_source == "PET_RDZV_ID"
    assert resolve_node({}, ("torchrun", "--rdzv-id", "none", "t.py")).run_id_source == "default"


def test_slurm_then_kubernetes_then_flags() -> None:
    slurm = resolve_node({"SLURM_NODEID": "1", "SLURM_NNODES": "2", "SLURM_JOB_ID": "9", "SLURM_RESTART_COUNT": "1",
                          "JOB_COMPLETION_INDEX": "0"}, ("bash", "x.sh"))
    assert (slurm.node_rank, slurm.nodes, slurm.run_id) == (1, 2, "slurm-9-r1")
    assert slurm.node_rank_source == "SLURM_NODEID"
    k8s = resolve_node({"JOB_COMPLETION_INDEX": "3"}, ("bash", "x.sh"), nodes=4, nodes_source="GUARD_NODES")
    assert (k8s.node_rank, k8s.nodes, k8s.node_rank_source, k8s.nodes_source) == (
        3, 4, "JOB_COMPLETION_INDEX", "GUARD_NODES")
    flags = resolve_node({}, ("bash", "x.sh"), node_rank=1, nodes=2, run_id="r1")
    assert (flags.node_rank, flags.nodes, flags.run_id) == (1, 2, "r1")
    assert flags.node_rank_source == "--node-rank" and flags.run_id_source == "--run-id"


def test_defaults_and_a_rank_past_the_count() -> None:
    one = resolve_node({}, ("python", "train.py"))
    assert (one.node_rank, one.nodes, one.many) == (0, 1, False)
    assert len(one.run_id) == 12 and one.run_id != resolve_node({}, ("python", "train.py")).run_id
    past = resolve_node({"JOB_COMPLETION_INDEX": "3"}, ("bash",))
    assert (past.node_rank, past.nodes) == (3, 4) and "not below the node count" in past.conflicts[-1]


def test_run_id_flag_wins_over_the_launcher_and_odd_ids_become_path_parts() -> None:
    node = resolve_node({"SLURM_JOB_ID": "42"}, ("torchrun", "--rdzv-id", "a/b c", "t.py"), run_id="mine")
    assert node.run_id == "mine"
    assert resolve_node({}, ("torchrun", "--rdzv-id", "a/b c", "t.py")).run_id == "a-b-c"


def test_options_reach_secure_settings() -> None:
    env = {"GUARD_NODE_RANK": "1", "GUARD_NODES": "2", "GUARD_RUN_ID": "run-7"}
    values, sources = resolve({}, env)
    secure = Config(values=values, sources=sources, command=("bash", "x.sh"), environ=env).settings.secure
    assert (secure.node_rank, secure.nodes, secure.run_id) == (1, 2, "run-7")
    assert secure.node.node_rank_source == "GUARD_NODE_RANK" and secure.node.run_id_source == "GUARD_RUN_ID"


@pytest.mark.parametrize(("name", "text"), [("nodes", "0"), ("node_rank", "-1"), ("run_id", "a/b"),
                                            ("run_id", "-x")])
def test_malformed_values_are_usage_errors(name: str, text: str) -> None:
    with pytest.raises(UsageError):
        resolve({name: text}, {})
