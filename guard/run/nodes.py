"""This node's identity in a many-node job: its index, the node count and the run id, and where each came from.

One guard runs per node (``srun --ntasks-per-node=1 jobguard ... -- torchrun ...``, one pod per node of a
Kubernetes indexed Job). Each value is taken from the first source that gives it, in this order:

1. the launcher's own arguments: torchrun ``--node-rank``/``--node_rank``, ``--nnodes`` (an elastic ``MIN:MAX``
   counts ``MAX``), ``--rdzv-id``; their environment form ``PET_NODE_RANK``, ``PET_NNODES``, ``PET_RDZV_ID``
   (torchrun reads ``PET_<OPTION>`` as its options' defaults, ``torch/distributed/argparse_util.py`` ``env``);
   accelerate launch ``--machine_rank``, ``--num_machines``;
2. Slurm: ``SLURM_NODEID`` (0-based), ``SLURM_NNODES``; the run id ``slurm-<SLURM_JOB_ID>``, with ``-r<N>`` after
   a requeue (``SLURM_RESTART_COUNT``), so a requeued run is a run of its own;
3. Kubernetes: ``JOB_COMPLETION_INDEX`` (an indexed Job's pod index; the node count is not in a pod's
   environment: it comes from ``--nodes``);
4. ``--node-rank``, ``--nodes`` (``GUARD_NODE_RANK``, ``GUARD_NODES``, resolved by ``guard.run.config``);
5. the defaults: node 0 of 1.

The run id: ``--run-id`` (``GUARD_RUN_ID``), else Slurm's (above), else torchrun's ``--rdzv-id`` (``PET_RDZV_ID``;
not its default ``none``), else ``TORCHELASTIC_RUN_ID``, else a fresh one (12 hex digits of a uuid4), which on
several nodes differs per node (the config log warns: give ``--run-id``).

Plain functions over the environment and the job's command: nothing here reads ``os.environ`` itself.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["NodeIdentity", "resolve_node"]


@dataclass(frozen=True)
class NodeIdentity:
    """Which node of the job this guard watches.

    Attributes:
        node_rank: this node's index, ``0 <= node_rank < nodes``.
        nodes: the job's node count (1: one node).
        run_id: this run's id, the same on every node of one job run when it came from a shared source.
        node_rank_source, nodes_source, run_id_source: where each came from (``torchrun --node-rank``,
            ``SLURM_NODEID``, ``--nodes``, ``default`` ...), for the config log.
        conflicts: sources that disagreed with the one used (``--nodes 4 (SLURM_NNODES says 2)``), for a warning.
    """

    node_rank: int = 0
    nodes: int = 1
    run_id: str = ""
    node_rank_source: str = "default"
    nodes_source: str = "default"
    run_id_source: str = "default"
    conflicts: tuple[str, ...] = ()

    @property
    def many(self) -> bool:
        """More than one node."""
        return self.nodes > 1

    def describe(self) -> str:
        """``node 1 of 2 (torchrun --node-rank, torchrun --nnodes), run slurm-42 (SLURM_JOB_ID)``."""
        return (f"node {self.node_rank} of {self.nodes} ({self.node_rank_source}, {self.nodes_source}), "
                f"run {self.run_id} ({self.run_id_source})")


def _count(text: object) -> int | None:
    value = str(text).strip() if text is not None else ""
    return int(value) if value.isdigit() else None


def _launcher_values(command: Sequence[str]) -> tuple[str, Mapping[str, str]]:
    """The launcher's name and its options (dashes; ``guard.preflight.launch.parse_launch``), or ``("", {})``."""
    from guard.run.ranks import parse_launch

    launch = parse_launch(command)
    return (launch.launcher, launch.values) if launch is not None else ("", {})


def _nnodes_max(text: str) -> int | None:
    m = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", text)
    return int(m.group(2) or m.group(1)) if m else None


def resolve_node(environ: Mapping[str, str], command: Sequence[str], *, node_rank: int | None = None,
                 nodes: int | None = None, run_id: str | None = None, node_rank_source: str = "--node-rank",
                 nodes_source: str = "--nodes", run_id_source: str = "--run-id") -> NodeIdentity:
    """This node's identity (see the module's docstring for the order of the sources).

    Args:
        environ: the guard's environment (the launcher's and the scheduler's variables).
        command: the job's command (a launcher's arguments are read from it).
        node_rank, nodes, run_id: ``--node-rank``, ``--nodes``, ``--run-id`` (flag or ``GUARD_*``), or None.
        node_rank_source, nodes_source, run_id_source: how to name those in the log (the flag or the variable).

    Returns:
        The :class:`NodeIdentity`; a node rank not below the node count is kept (the count is raised to
        ``node_rank + 1`` and the conflict noted), so that a wrong count never makes a node drop out silently.
    """
    launcher, values = _launcher_values(command)
    ranks: list[tuple[int, str]] = []
    counts: list[tuple[int, str]] = []
    ids: list[tuple[str, str]] = [(run_id, run_id_source)] if run_id else []
    if job_id := environ.get("SLURM_JOB_ID", "").strip():
        restarts = _count(environ.get("SLURM_RESTART_COUNT")) or 0
        ids.append((f"slurm-{job_id}" + (f"-r{restarts}" if restarts else ""),
                    "SLURM_JOB_ID" + (" and SLURM_RESTART_COUNT" if restarts else "")))
    if launcher == "torchrun":
        if (value := _count(values.get("--node-rank"))) is not None:
            ranks.append((value, "torchrun --node-rank"))
        if "--nnodes" in values and (value := _nnodes_max(values["--nnodes"])) is not None:
            counts.append((value, "torchrun --nnodes"))
        rdzv = values.get("--rdzv-id", "").strip()
        if rdzv and rdzv.lower() != "none":  # torchrun's default id is the text "none"
            ids.append((rdzv, "torchrun --rdzv-id"))
        if (value := _count(environ.get("PET_NODE_RANK"))) is not None:
            ranks.append((value, "PET_NODE_RANK"))
        if (value := _nnodes_max(environ.get("PET_NNODES", "") or "-")) is not None:
            counts.append((value, "PET_NNODES"))
        if (rdzv := environ.get("PET_RDZV_ID", "").strip()) and rdzv.lower() != "none":
            ids.append((rdzv, "PET_RDZV_ID"))
    elif launcher == "accelerate":
        if (value := _count(values.get("--machine-rank"))) is not None:
            ranks.append((value, "accelerate launch --machine_rank"))
        if (value := _count(values.get("--num-machines"))) is not None:
            counts.append((value, "accelerate launch --num_machines"))
    if (value := _count(environ.get("SLURM_NODEID"))) is not None:
        ranks.append((value, "SLURM_NODEID"))
    if (value := _count(environ.get("SLURM_NNODES"))) is not None:
        counts.append((value, "SLURM_NNODES"))
    if (elastic := environ.get("TORCHELASTIC_RUN_ID", "").strip()) and elastic.lower() != "none":
        ids.append((elastic, "TORCHELASTIC_RUN_ID"))
    if (value := _count(environ.get("JOB_COMPLETION_INDEX"))) is not None:
        ranks.append((value, "JOB_COMPLETION_INDEX"))
    if node_rank is not None:
        ranks.append((node_rank, node_rank_source))
    if nodes is not None:
        counts.append((nodes, nodes_source))
    conflicts = [f"{source} {value} ({ranks[0][1]} says {ranks[0][0]})" for value, source in ranks[1:]
                 if value != ranks[0][0]]
    conflicts += [f"{source} {value} ({counts[0][1]} says {counts[0][0]})" for value, source in counts[1:]
                  if value != counts[0][0]]
    rank, rank_source = ranks[0] if ranks else (0, "default")
    count, count_source = counts[0] if counts else (1, "default")
    if count < 1:
        count, count_source = 1, f"{count_source} (0 read as 1)"
    if rank >= count:
        conflicts.append(f"node rank {rank} ({rank_source}) is not below the node count {count} ({count_source}): "
                         f"counting {rank + 1} nodes")
        count = rank + 1
    ident, ident_source = ids[0] if ids else (uuid.uuid4().hex[:12], "default")
    ident = re.sub(r"[^A-Za-z0-9._-]", "-", ident)[:128].lstrip("._-") or uuid.uuid4().hex[:12]  # a path part
    return NodeIdentity(rank, count, ident, rank_source, count_source, ident_source, tuple(conflicts))
