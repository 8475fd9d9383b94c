"""A checkpoint of many nodes: is it whole at the destination, what is missing, and by when each part must be in.

Each node's guard puts its own part of a step's checkpoint at the destination, then that part's manifest
(``guard.secure.dest.base.PartManifest``); the nodes meet through the destination alone (a listing), so a node
that died simply never adds its part. The record (``last-checkpoint``) may move only when the checkpoint is whole:

- a manifest of this run and step from every node ``0..nodes-1`` (a manifest of another run or step, left by an
  earlier run or a killed put, never counts; of two from one node the later one stands);
- every part agrees on the node count, and no path is in two parts with different contents (a replicated file,
  such as DeepSpeed's ``latest`` or a Trainer's ``trainer_state.json`` written on every node, is the same file);
- the union of the parts' files meets what the format requires, as each part's ``requires`` says (``{path: least
  size}``: the files a DCP ``.metadata`` names with ``offset + length``, every data-parallel rank's ZeRO file,
  every rank's ``rng_state_<r>.pth``).

``Whole`` says which of these fail, for the log, the report and the VERDICT (``missing=node1``), so that every
node's guard tells the same story from the same listing. Plain data and functions: no I/O here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from guard.secure.dest.base import FileSum, PartManifest

__all__ = ["RecordCost", "Whole", "newest_whole", "part_due_s", "whole"]


@dataclass(frozen=True)
class Whole:
    """What the destination holds of one step's checkpoint of one run.

    Attributes:
        run_id, step, nodes: the checkpoint asked about and the job's node count.
        present: the nodes whose part is there, in order.
        missing_nodes: the nodes whose part is not.
        missing_files: the paths some part requires that the union lacks or holds short (sorted).
        conflicts: what makes the parts disagree (a path with two contents, another node count), for the log.
        files: the union of the parts' files (path -> size and sha256): what the record names once whole.
        parts: the manifests that count, by node.
    """

    run_id: str
    step: int
    nodes: int
    present: tuple[int, ...]
    missing_nodes: tuple[int, ...]
    missing_files: tuple[str, ...]
    conflicts: tuple[str, ...]
    files: Mapping[str, FileSum]
    parts: Mapping[int, PartManifest]

    @property
    def complete(self) -> bool:
        """Every node's part is there, they agree, and their union meets the format's requirements."""
        return not self.missing_nodes and not self.missing_files and not self.conflicts

    def missing_text(self) -> str:
        """The VERDICT's ``missing=`` value: ``node1,node3``, else ``files`` when only files are missing, else
        ``conflict``; empty when whole."""
        if self.missing_nodes:
            return ",".join(f"node{node}" for node in self.missing_nodes)
        if self.missing_files:
            return "files"
        return "conflict" if self.conflicts else ""

    def describe(self) -> str:
        """One line for the log: ``step 40 of run r: nodes 0, 2 of 3 in; missing: node1; files: ...``."""
        said = (f"step {self.step} of run {self.run_id}: {len(self.present)} of {self.nodes} nodes' parts in"
                + (f" (nodes {', '.join(map(str, self.present))})" if self.present else ""))
        if self.complete:
            return f"{said}; whole ({len(self.files)} files)"
        more = []
        if self.missing_nodes:
            more.append(f"missing: {self.missing_text()}")
        if self.missing_files:
            shown = ", ".join(self.missing_files[:5]) + (" ..." if len(self.missing_files) > 5 else "")
            more.append(f"{len(self.missing_files)} required files not in any part ({shown})")
        more.extend(self.conflicts[:3])
        return f"{said}; " + "; ".join(more)


def whole(parts: Iterable[PartManifest], *, run_id: str, step: int, nodes: int) -> Whole:
    """Whether the manifests ``parts`` (a listing of the destination, any order, any runs and steps) make
    ``run_id``'s checkpoint ``step`` of ``nodes`` nodes whole (see the module's docstring).

    Args:
        parts: the node manifests found (others' runs and steps are ignored).
        run_id, step: the checkpoint.
        nodes: the job's node count (``SecureSettings.nodes``), at least 1.

    Returns:
        The :class:`Whole`.
    """
    chosen: dict[int, PartManifest] = {}
    for part in parts:
        if part.run_id != run_id or part.step != step or not 0 <= part.node_rank < max(nodes, 1):
            continue
        kept = chosen.get(part.node_rank)
        if kept is None or part.written_at_s >= kept.written_at_s:
            chosen[part.node_rank] = part
    conflicts = [f"node {node} says {part.nodes} nodes, not {nodes}" for node, part in sorted(chosen.items())
                 if part.nodes != nodes]
    files: dict[str, FileSum] = {}
    owner: dict[str, int] = {}
    for node, part in sorted(chosen.items()):
        for path, summed in part.files.items():
            if path in files and files[path] != summed:
                conflicts.append(f"{path} differs between node {owner[path]} and node {node}")
                continue
            files.setdefault(path, summed)
            owner.setdefault(path, node)
    required = _required(part.requires for part in chosen.values())
    missing_files = sorted(path for path, least in required.items()
                           if path not in files or files[path].size_bytes < least)
    present = tuple(sorted(chosen))
    missing_nodes = tuple(node for node in range(max(nodes, 1)) if node not in chosen)
    return Whole(run_id, step, max(nodes, 1), present, missing_nodes, tuple(missing_files), tuple(conflicts), files,
                 dict(sorted(chosen.items())))


def _required(requirements: Iterable[Mapping[str, int]]) -> dict[str, int]:
    """The union of the parts' ``requires``: each path's largest least size."""
    merged: dict[str, int] = {}
    for requires in requirements:
        for path, least in requires.items():
            merged[path] = max(merged.get(path, 0), int(least))
    return merged


class RecordCost:
    """The measured time of one record move (from the last part verified to the record written), seconds: what
    each node's part must leave before the deadline. Starts at ``initial_s`` until measured, then is the largest
    of the last ``keep`` measurements (a record move is a listing, a few reads and one swap or commit: its cost
    grows with the nodes' manifests and the destination's latency, not with the checkpoint's size).

    Args:
        initial_s: the guess before any measurement (default 10 s: a Hub commit's usual time, with room).
        keep: how many measurements count.
    """

    def __init__(self, *, initial_s: float = 10.0, keep: int = 5) -> None:
        self.initial_s = initial_s
        self.keep = keep
        self.measured_s: list[float] = []

    def observe(self, duration_s: float) -> None:
        """One record move took ``duration_s`` seconds."""
        if duration_s >= 0:
            self.measured_s = [*self.measured_s, float(duration_s)][-self.keep:]

    @property
    def estimate_s(self) -> float:
        """The time to leave for the record (seconds)."""
        return max(self.measured_s) if self.measured_s else self.initial_s


def part_due_s(deadline_s: float | None, record: RecordCost, *, nodes: int) -> float | None:
    """When this node's part must be in (the same clock as ``deadline_s``): the deadline less the record's measured
    time on many nodes (the last node's part is followed by the record move); the deadline itself on one node,
    whose put and record are one operation. None without a deadline."""
    if deadline_s is None:
        return None
    return deadline_s - record.estimate_s if nodes > 1 else deadline_s


def newest_whole(parts: Sequence[PartManifest], *, run_id: str, nodes: int) -> tuple[Whole | None, Whole | None]:
    """``(newest whole, newest)``: of ``run_id``'s steps with some node's part at the destination, the newest
    whole one (what ``secured_step=`` names) and the newest one at all (what ``missing=`` is about when it is not
    whole); each None when there is none."""
    steps = sorted({part.step for part in parts if part.run_id == run_id}, reverse=True)
    checked = [whole(parts, run_id=run_id, step=step, nodes=nodes) for step in steps]
    return next((w for w in checked if w.complete), None), (checked[0] if checked else None)
