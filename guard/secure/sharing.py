"""Is the output folder shared by the job's nodes, or local to each? Found out, never assumed.

A many-node job writes its checkpoints either to one shared file system (NFS, Lustre, a bucket mount) or to each
node's own disk (node-local NVMe: DeepSpeed's ``use_node_local_storage``, DCP with a local ``checkpoint_id``). Paths
look the same either way, so each node's guard writes a probe file named by the run and the node,
``OUT/.guard/nodes/<run_id>/node-<k>.json``, and looks for the other nodes' probes: one seen means shared (and
which nodes share it); none within the bound means local. Before the bound passes the answer is unknown.

The probe runs on a thread of its own (a folder on a hung mount stops nothing but that thread), started before the
job; it keeps looking until every other node's probe was seen or ``bound_s`` passed. Without a run id every node
shares (plain torchrun), each node's is its own until node 0's reaches it through the job's store: then the probe
moves to node 0's run's folder (``adopt``), where node 0's is, and the nodes see each other there. The probe files
are removed when the run ends (``SharingProbe.close``); one left by a killed guard names its run, so no other run
reads it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

__all__ = ["PROBE_BOUND_S", "Sharing", "SharingProbe", "await_others_done", "await_secured", "once_per_folder",
           "post_secured", "probe_folder"]

log = logging.getLogger("guard.sharing")

#: How long a node looks for the other nodes' probes before it calls its output folder local (seconds). The nodes'
#: guards start within the launcher's rendezvous of each other (torchrun waits up to 600 s by default), and the
#: answer matters at the first push, after the first steps: 120 s covers a slow start without holding anything up.
PROBE_BOUND_S = 120.0
#: How often the folder is listed while looking (seconds).
PROBE_EVERY_S = 0.5


@dataclass(frozen=True)
class Sharing:
    """The answer: ``shared`` True (another node's probe was seen), False (none within the bound), None (not
    known yet, or the probe could not be written); ``nodes_seen``: the nodes whose probe was there (this one
    included); ``why``: one line for the log."""

    shared: bool | None
    nodes_seen: tuple[int, ...]
    why: str


def probe_folder(output_dir: str | os.PathLike[str], run_id: str) -> Path:
    """The folder that holds this run's probes: ``OUT/.guard/nodes/<run_id>``."""
    return Path(output_dir) / ".guard" / "nodes" / run_id


class SharingProbe:
    """Finds out whether ``output_dir`` is shared by the job's nodes (see the module's docstring).

    Args:
        output_dir: the job's output folder.
        run_id: this run's id (the same on every node).
        node_rank: this node's index; nodes: the node count (at least 2: one node shares with no one).
        bound_s: how long to look before answering "local" (default ``PROBE_BOUND_S``).
        clock: monotonic seconds (tests); sleep: waits between listings (tests).
    """

    def __init__(self, output_dir: str | os.PathLike[str], run_id: str, node_rank: int, nodes: int, *,
                 bound_s: float = PROBE_BOUND_S, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.folder = probe_folder(output_dir, run_id)
        self.path = self.folder / f"node-{node_rank}.json"
        self.run_id, self.node_rank, self.nodes = run_id, node_rank, nodes
        self.bound_s, self._clock, self._sleep = bound_s, clock, sleep
        self._answer = Sharing(None, (), "not probed yet")
        self._done = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._adopted: str | None = None  # node 0's run id, to move to (``adopt``)

    @property
    def answer(self) -> Sharing:
        """The answer so far (``shared`` None until known)."""
        return self._answer

    def start(self) -> SharingProbe:
        """Write the probe and look for the others on a daemon thread; returns at once."""
        self._thread = threading.Thread(target=self.run, name="guard-sharing", daemon=True)
        self._thread.start()
        return self

    def wait(self, timeout_s: float) -> Sharing:
        """The answer once known, or what is known after ``timeout_s``."""
        self._done.wait(timeout_s)
        return self._answer

    def adopt(self, run_id: str) -> None:
        """This node takes node 0's run id (``Peers.adopt_run_id``): the probe moves to that run's folder, on the
        probe's thread (before its bound passes; after, the answer stands). Returns at once."""
        self._adopted = run_id

    def _write(self) -> bool:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            body = {"run_id": self.run_id, "node_rank": self.node_rank, "nodes": self.nodes,
                    "host": socket.gethostname(), "pid": os.getpid(), "written_at_s": time.time()}
            tmp = self.folder / f".node-{self.node_rank}.json.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(body))
            os.replace(tmp, self.path)
        except OSError as exc:
            self._finish(Sharing(None, (), f"cannot write the probe {self.path}: {exc.strerror or exc}"))
            return False
        return True

    def _move(self, run_id: str) -> bool:
        """Remove this node's probe and write it under ``run_id``'s folder."""
        self._adopted = None
        self._remove()
        self.run_id, self.folder = run_id, probe_folder(self.folder.parent.parent.parent, run_id)
        self.path = self.folder / f"node-{self.node_rank}.json"
        log.debug("output folder probe moved to %s (node 0's run id)", self.folder)
        return self._write()

    def run(self) -> None:
        """Write this node's probe, then list the folder until every node's probe was seen or the bound passed."""
        started = self._clock()
        if not self._write():
            return
        seen: tuple[int, ...] = (self.node_rank,)
        while not self._stop.is_set():
            adopted = self._adopted
            if adopted is not None and adopted != self.run_id and not self._move(adopted):
                return
            seen = self._seen()
            late = self._clock() - started >= self.bound_s
            if len(seen) > 1:
                answer = Sharing(True, seen, f"shared: the probes of nodes {', '.join(map(str, seen))} are in "
                                             f"{self.folder}")
                if answer != self._answer:
                    self._finish(answer)
                if len(seen) >= self.nodes or late:
                    return
            elif late:
                self._finish(Sharing(False, seen, f"local to this node: no other node's probe appeared in "
                                                  f"{self.folder} within {self.bound_s:.0f}s"))
                return
            self._sleep(PROBE_EVERY_S)
        if self._answer.shared is None:
            self._finish(Sharing(None, seen, "stopped before an answer"))

    def close(self) -> None:
        """Stop looking and remove this node's probe (and the run's folder once empty)."""
        self._stop.set()
        self._remove()

    def _remove(self) -> None:
        try:
            self.path.unlink(missing_ok=True)
            for claim in self.folder.glob("*.lock"):  # once_per_folder's claims, by whichever node made them
                if _read_text(claim) == str(self.node_rank):
                    claim.unlink(missing_ok=True)
                    claim.with_suffix(".done").unlink(missing_ok=True)
            self.folder.rmdir()
            self.folder.parent.rmdir()  # .guard/nodes, when no other run's probes are there
        except OSError:
            pass  # another node's probe is still there, or the folder is gone

    def _seen(self) -> tuple[int, ...]:
        try:
            names = os.listdir(self.folder)
        except OSError:
            return (self.node_rank,)
        nodes = {self.node_rank}
        for name in names:
            if name.startswith("node-") and name.endswith(".json") and name[5:-5].isdigit():
                nodes.add(int(name[5:-5]))
        return tuple(sorted(nodes))

    def _finish(self, answer: Sharing) -> None:
        self._answer = answer
        if answer.shared is not None:
            log.info("output folder: %s", answer.why)
        else:
            log.warning("output folder shared or not: unknown (%s)", answer.why)
        self._done.set()


def once_per_folder(output_dir: str | os.PathLike[str], run_id: str, node_rank: int, name: str,
                    work: Callable[[], T], *, deadline: float, abort: Callable[[], bool],
                    clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> T:
    """Run ``work()`` once per folder: the first node to claim ``OUT/.guard/nodes/<run_id>/<name>.lock`` runs it
    (every node when each has its own folder); a node that finds the claim already made (the folder is shared)
    waits until ``<name>.done`` appears, then runs ``work()`` too, which finds the result in place (the resume
    fetch: the checkpoint already there is chosen, nothing is downloaded twice into one folder).

    Args:
        output_dir, run_id, node_rank: the folder, the run and this node.
        name: what is done once (``fetch``).
        work: the work; its result is returned.
        deadline: monotonic seconds: a wait for another node's work ends then (and ``work()`` runs anyway).
        abort: True once a signal arrived: the wait ends at once.
        clock, sleep: for tests.

    Raises:
        Whatever ``work()`` raises.
    """
    folder = probe_folder(output_dir, run_id)
    lock, done = folder / f"{name}.lock", folder / f"{name}.done"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        holder = _read_text(lock)
        log.info("%s: node %s claimed it in this shared folder (%s): waiting for it", name, holder or "?", folder)
        while not done.exists() and not abort() and clock() < deadline:
            sleep(PROBE_EVERY_S)
        if not done.exists() and not abort():
            log.warning("%s: node %s did not finish by the deadline: doing it here", name, holder or "?")
        return work()
    except OSError as exc:
        log.info("%s: cannot claim it in %s (%s): doing it here", name, folder, exc.strerror or exc)
        return work()
    with os.fdopen(handle, "w") as claim:
        claim.write(str(node_rank))
    try:
        return work()
    finally:
        try:
            done.write_text(str(node_rank))
        except OSError as exc:
            log.warning("%s: cannot mark it done in %s: %s", name, folder, exc.strerror or exc)


def _read_text(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


#: What node 0's guard posts for the other nodes of a shared output folder: its VERDICT's story.
SECURED_KEYS = ("checkpoint", "pushed", "secured", "secured_step")


def post_secured(output_dir: str | os.PathLike[str], run_id: str, status: str, exit_code: int,
                 extra: dict[str, object]) -> None:
    """On node 0, with a shared output folder: its VERDICT's status, exit code and what it secured, in
    ``OUT/.guard/nodes/<run_id>/secured.json`` (written whole, then renamed), for the other nodes' guards
    (``await_secured``). A failure to write is logged, never raised."""
    folder = probe_folder(output_dir, run_id)
    body = {"status": status, "exit": exit_code, **{key: extra[key] for key in SECURED_KEYS if key in extra}}
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".secured.json.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(body, default=str))
        os.replace(tmp, folder / "secured.json")
    except OSError as exc:
        log.warning("cannot tell the other nodes what was secured (%s): %s", folder, exc.strerror or exc)


def await_secured(output_dir: str | os.PathLike[str], run_id: str, *, wait_s: float,
                  clock: Callable[[], float] = time.monotonic,
                  sleep: Callable[[float], None] = time.sleep) -> dict[str, object] | None:
    """On another node, with a shared output folder: what node 0's guard posted (``post_secured``), waiting up to
    ``wait_s`` seconds for it; None when it did not come."""
    path = probe_folder(output_dir, run_id) / "secured.json"
    end = clock() + max(0.0, wait_s)
    while True:
        try:
            found = json.loads(path.read_text())
            if isinstance(found, dict):
                return found
        except (OSError, ValueError):
            pass
        if clock() >= end:
            return None
        sleep(PROBE_EVERY_S / 5)


def await_others_done(output_dir: str | os.PathLike[str], run_id: str, *, wait_s: float,
                      clock: Callable[[], float] = time.monotonic,
                      sleep: Callable[[float], None] = time.sleep) -> bool:
    """Wait (``wait_s`` at most) until no node's probe is left in a shared output folder: every other node's guard
    has ended its run and is printing its VERDICT (a probe goes just before it). Before a requeue, which ends every
    node's processes. True when none is left (at once on a folder of this node's own)."""
    folder = probe_folder(output_dir, run_id)
    end = clock() + max(0.0, wait_s)
    while True:
        try:
            left = [name for name in os.listdir(folder) if name.startswith("node-") and name.endswith(".json")]
        except OSError:
            left = []
        if not left:
            sleep(1.0)  # the VERDICT follows its probe's removal at once; give it the time to be written
            return True
        if clock() >= end:
            log.info("before the requeue: %s still running after %.0fs", ", ".join(sorted(left)), wait_s)
            return False
        sleep(PROBE_EVERY_S / 5)
