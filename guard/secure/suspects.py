"""Suspect saves and tainted runs: what was saved at or after a run's first non-finite step, on disk.

Two records, for two questions:

- **The taint belongs to the run.** When a run's loss (or its saved weights) first goes non-finite, the guard
  writes ``OUT/.guard/taints/<run_id>.json`` beside each output folder the run saves into: the run's id, its first
  non-finite step, when the run started and when the guard heard of the taint (epoch seconds), and, once a later
  run touches that folder, when this one ended. A checkpoint *of that run* is one whose newest file was written in
  that window; resume (``guard.secure.resume``) refuses every such checkpoint at or after the first non-finite step
  (by its step; by its time when its step is unknown), wherever in the folder it lies and whatever happened to its
  marker: a folder still being written when the taint arrived never got one (``checkpoint-108`` saved one step
  after the NaN of step 107).
- **A marker names the save it marks.** ``PATH/guard_suspect.json`` (a folder) or ``PATH.guard-suspect.json``
  (a file) holds the marked save's path, step, run id, first non-finite step and signature (total size in bytes
  and newest mtime in nanoseconds over its files, the marker left out). It counts only while the save is that
  save: once the path is written again (another size or mtime) the marker is void; during a run, a marker of
  another run is void too (``is_marked_suspect(..., run_id=...)``). A run that saves ``out/ckpt.pt`` in place
  after an earlier NaN run is never locked out by the earlier run's marker; the earlier run's own checkpoints stay
  refused by its taint.

Every write here is best effort (logged, never raised): a read-only folder must not end the run.
"""

from __future__ import annotations

import json
import logging
import math
import os
import stat as _stat
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["SUSPECT_MARKER_NAME", "SUSPECT_SUFFIX", "TAINTS_FOLDER", "RunTaint", "close_taints",
           "is_marked_suspect", "mark_suspect", "marker_of", "read_taints", "record_taint", "tainted_by"]

log = logging.getLogger("guard.checkpoints")

#: Written into a checkpoint folder saved at or after the first non-finite loss (``mark_suspect``).
SUSPECT_MARKER_NAME = "guard_suspect.json"
SUSPECT_SUFFIX = ".guard-suspect.json"  # beside a loose checkpoint file: ``FILE.guard-suspect.json``
#: The runs' taints, relative to an output folder: ``.guard/taints/<run_id>.json``.
TAINTS_FOLDER = Path(".guard") / "taints"


def marker_of(path: str | os.PathLike[str]) -> Path:
    """The marker's path for the checkpoint at ``path`` (a folder or a single file)."""
    where = Path(path)
    return where / SUSPECT_MARKER_NAME if where.is_dir() else where.with_name(where.name + SUSPECT_SUFFIX)


def _signature(path: Path) -> tuple[int, int] | None:
    """``(total size in bytes, newest mtime in ns)`` of the regular files of ``path`` (a file, or a folder walked
    without following links, the marker left out); None when it is gone or holds no file."""
    try:
        top = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    if _stat.S_ISREG(top.st_mode):
        return top.st_size, top.st_mtime_ns
    if not _stat.S_ISDIR(top.st_mode):
        return None
    size, newest, found = 0, 0, False
    for root, _dirs, names in os.walk(path):
        for name in names:
            if name == SUSPECT_MARKER_NAME and root == os.fspath(path):
                continue
            try:
                st = os.stat(os.path.join(root, name), follow_symlinks=False)
            except OSError:
                continue
            if _stat.S_ISREG(st.st_mode):
                size, newest, found = size + st.st_size, max(newest, st.st_mtime_ns), True
    return (size, newest) if found else None


def mark_suspect(path: str | os.PathLike[str], *, step: int | None, first_non_finite_step: int,
                 run_id: str | None = None) -> Path | None:
    """Mark the save at ``path`` as made at or after the first non-finite step of run ``run_id``: the marker
    (``marker_of``) holds ``{"path", "step", "run_id", "first_non_finite_step", "size_bytes", "mtime_ns"}``, the
    last two the save's signature as it is now (see the module docstring).

    Returns:
        The marker's path, or None when it could not be written (the save is gone, a read-only folder: logged,
        never raised).
    """
    where = Path(path)
    signature = _signature(where)
    if signature is None:
        log.warning("cannot mark %s as suspect: it is gone", where)
        return None
    marker = marker_of(where)
    body = {"path": os.path.abspath(where), "step": step, "run_id": run_id,
            "first_non_finite_step": first_non_finite_step, "size_bytes": signature[0], "mtime_ns": signature[1]}
    try:
        marker.write_text(json.dumps(body) + "\n", encoding="utf-8")
    except OSError as exc:
        log.warning("cannot mark %s as suspect: %s", where, exc)
        return None
    return marker


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_marked_suspect(path: str | os.PathLike[str], *, run_id: str | None = None) -> bool:
    """Whether a marker names the save now at ``path``: it exists, its signature is the save's as it is now (a
    path written again voids it; a marker without one names no save) and, with ``run_id``, it is that run's
    (during a run, another run's marker is void: that run's checkpoints are its taint's to refuse)."""
    where = Path(path)
    body = _read_json(marker_of(where))
    if body is None:
        return False
    if run_id is not None and body.get("run_id") not in (None, run_id):
        return False
    return _signature(where) == (body.get("size_bytes"), body.get("mtime_ns"))


@dataclass(frozen=True)
class RunTaint:
    """One run's taint as recorded beside an output folder.

    Attributes:
        run_id: the run. first_step: its first suspect save step (the guard's step count; ``Tainted.saves_from``).
            witness: what went non-finite (``"loss"``). started_s: when the run's job started (epoch seconds).
            tainted_at_s: when the guard heard of it. ended_s: when a later run started, as that run recorded it; None
            while none did.
    """

    run_id: str
    first_step: int
    started_s: float
    tainted_at_s: float
    witness: str = "loss"
    ended_s: float | None = None

    def covers(self, step: int | None, newest_mtime_s: float) -> bool:
        """A checkpoint whose newest file was written at ``newest_mtime_s`` (epoch seconds) at ``step`` (None:
        unknown) is this run's, at or after its first non-finite step: written within the run (from its start to
        its end, open while no later run said), and its step at or past ``first_step``, or, step unknown, written
        after the guard heard of the taint."""
        end = self.ended_s if self.ended_s is not None else math.inf
        if not self.started_s - 1.0 <= newest_mtime_s <= end:  # a second for coarse file system clocks
            return False
        return step >= self.first_step if step is not None else newest_mtime_s >= self.tainted_at_s

    def describe(self) -> str:
        return f"run {self.run_id} went non-finite: its saves from step {self.first_step} on are suspect"


def _taint_path(folder: str | os.PathLike[str], run_id: str) -> Path:
    return Path(folder) / TAINTS_FOLDER / f"{run_id}.json"


def _write(path: Path, taint: RunTaint) -> bool:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(asdict(taint)) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("cannot record the taint of run %s in %s: %s", taint.run_id, path.parent, exc)
        return False
    return True


def record_taint(folder: str | os.PathLike[str], taint: RunTaint) -> Path | None:
    """Write ``taint`` beside the output folder ``folder``; an earlier record of the same run keeps the lower
    first step. Returns its path, or None when it could not be written (logged, never raised)."""
    path = _taint_path(folder, taint.run_id)
    before = _parse(_read_json(path))
    if before is not None and before.first_step <= taint.first_step:
        return path
    return path if _write(path, taint) else None


def _parse(body: dict[str, Any] | None) -> RunTaint | None:
    if body is None:
        return None
    try:
        ended = body.get("ended_s")
        return RunTaint(str(body["run_id"]), int(body["first_step"]), float(body["started_s"]),
                        float(body["tainted_at_s"]), str(body.get("witness", "loss")),
                        float(ended) if ended is not None else None)
    except (KeyError, TypeError, ValueError):
        return None


def read_taints(folder: str | os.PathLike[str]) -> list[RunTaint]:
    """Every run's taint recorded beside the output folder ``folder`` (unreadable records are skipped)."""
    base = Path(folder) / TAINTS_FOLDER
    try:
        names = sorted(n for n in os.listdir(base) if n.endswith(".json"))
    except OSError:
        return []
    found = (_parse(_read_json(base / name)) for name in names)
    return [taint for taint in found if taint is not None]


def close_taints(folder: str | os.PathLike[str], *, run_id: str | None, at_s: float) -> list[RunTaint]:
    """A run (``run_id``; None: a resume before any run) starts at ``at_s`` (epoch seconds) on ``folder``: every
    other run's taint there that has no end yet ends at ``at_s`` (what is written in that folder from then on is not
    that run's). Returns the taints as they stand now."""
    taints = []
    for taint in read_taints(folder):
        if taint.ended_s is None and taint.run_id != run_id:
            ended = RunTaint(taint.run_id, taint.first_step, taint.started_s, taint.tainted_at_s, taint.witness,
                             max(at_s, taint.tainted_at_s))
            if _write(_taint_path(folder, taint.run_id), ended):
                taint = ended
        taints.append(taint)
    return taints


def tainted_by(taints: Iterable[RunTaint]) -> Callable[[int | None, float], str | None]:
    """A check of a checkpoint ``(step, newest mtime in epoch seconds)`` against ``taints``: the reason it is
    refused (``RunTaint.covers``), or None."""
    kept = list(taints)

    def check(step: int | None, newest_mtime_s: float) -> str | None:
        for taint in kept:
            if taint.covers(step, newest_mtime_s):
                return f"saved by a run at or after its first non-finite step ({taint.describe()})"
        return None
    return check
