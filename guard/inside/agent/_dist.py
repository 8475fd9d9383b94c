"""One checkpoint step for every rank of a multi-machine job, through torch.distributed's own store.

Each machine has its own guard, and only node 0's guard decides when to checkpoint. Its request (with a step
chosen ahead, ``at_step``) reaches global rank 0, which writes it into the job's key-value store (the
``TCPStore`` torchrun sets up; ``torch.distributed.distributed_c10d._get_default_store()``); every rank checks the
store every ``check_every`` steps (``Store.check``, a non-blocking round trip) and adopts the request, so all
ranks save at the same step and collective saves do not deadlock. Without an initialized process group, or when
the store cannot be reached, nothing happens here and each machine's guard asks its own ranks.

A termination signal that reaches one node only (a spot node reclaimed, one pod evicted) takes the same path the
other way: that node's guard sends its ranks a request with ``origin`` (its node) and ``signal``, which they publish;
every rank adopts it, and the agents of the other nodes tell their guard (``relayed``), which then handles the
signal as if it had received it: every node saves at one step, stops, and says the same.

Rank 0's ``store.set`` runs on a thread of its own (``guard-relay``), never on the agent's reader thread: a store
that hangs (its host gone, a network partition) must not keep ``stop`` and ``dump`` from being read. The key
carries the elastic restart (``TORCHELASTIC_RESTART_COUNT``, set by torchrun for each attempt): after a restart
the store is the same, and a request of the attempt before must not be taken for one of this attempt.

The nodes' run id travels the same way. Without one the launcher or the scheduler gives every node (plain torchrun
has no job id; its ``--rdzv-id`` defaults to ``none``), each guard names its own, and the nodes' parts of one
checkpoint, kept under the run id at the destination, would never meet. So global rank 0 puts node 0's guard's run
id (``GUARD_AGENT_RUN_ID``) under ``RUN_ID_KEY`` once it finds the store, and every rank of another node, until it
has read it, checks that key at its polls; when it differs from its own guard's, it tells its guard (``run_id``),
which takes it in place of its own. The store is this job run's (torchrun's, at ``MASTER_ADDR:MASTER_PORT``): an
id read there is never an earlier run's, as one derived from the job's command line would be.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
from collections.abc import Mapping

from ...protocol import ENV_RUN_ID

TYPE_CHECKING = False  # typing's own flag, without importing typing in every job process (see protocol.py)
if TYPE_CHECKING:
    from typing import Any, Protocol

__all__ = ["KEY", "RUN_ID_KEY", "DistRelay", "store_key"]

KEY = "jobguard/checkpoint"
#: Where global rank 0 puts node 0's guard's run id: ``{"run_id": ...}`` (one key for every elastic attempt: the
#: guards, and their run, outlive an attempt).
RUN_ID_KEY = "jobguard/run-id"
#: Until node 0's run id is read, another node's rank looks for it at every step of its first this many (one
#: ``Store.check`` round trip each), not every ``check_every``: a short job (a Trainer of 6 steps) polled once,
#: before rank 0 had put it, and its node's part went under its own run id, where node 0's guard never looks.
RUN_ID_EVERY_STEP_UNTIL = 100


def store_key(environ: Mapping[str, str] | None = None) -> str:
    """The store key of this attempt: ``jobguard/checkpoint/<TORCHELASTIC_RESTART_COUNT>`` (0 without one)."""
    env = os.environ if environ is None else environ
    restart = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"{KEY}/{restart if restart.isdigit() else 0}"


if TYPE_CHECKING:
    class _RelayAgent(Protocol):
        """What the relay needs of ``_core.Agent`` (a protocol: this module imports nothing of the agent's)."""

        checkpoint_request: dict[str, Any] | None

        def send(self, message: dict[str, Any]) -> bool: ...

        def warn(self, text: str) -> None: ...


class DistRelay:
    """Relays checkpoint requests between ranks through the job's store (see the module docstring)."""

    def __init__(self, agent: _RelayAgent) -> None:
        self.agent = agent
        self.store: Any = None
        self.rank: int | None = None
        self.probed = False
        self.next_poll = 0
        self.handled: set[Any] = set()
        self.key = store_key()
        self.run_id = os.environ.get(ENV_RUN_ID) or None  # this node's guard's, when it watches one of many nodes
        self.run_id_read = False  # node 0's was read from the store (another node's rank), or put there (rank 0)
        self._outbox: queue.Queue[tuple[str, str]] = queue.Queue()
        self._writer: threading.Thread | None = None

    def probe(self) -> None:
        """Find the store once the job has initialized torch.distributed (cheap until then)."""
        if self.probed:
            return
        dist = sys.modules.get("torch.distributed")
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return
        self.probed = True
        world_size = None
        try:
            self.rank, world_size = dist.get_rank(), dist.get_world_size()
            if world_size > 1:
                self.store = dist.distributed_c10d._get_default_store()
        except Exception:  # a private API: without it, each machine's guard asks its own ranks
            self.store = None
        self.agent.send({"t": "dist", "store": self.store is not None, "global_rank": self.rank,
                         "world_size": world_size})
        if self.store is not None and self.rank == 0 and self.run_id:
            self.run_id_read = True
            self._put(RUN_ID_KEY, json.dumps({"run_id": self.run_id}))

    def publish(self, request: dict[str, Any]) -> None:
        """On global rank 0: put the guard's request where every rank will see it. Returns at once: the write
        runs on the relay's own thread (called from the agent's reader thread, which must go on reading)."""
        if self.store is None or (self.rank != 0 and request.get("origin") is None):
            return  # rank 0 relays node 0's requests; any rank one its own node's guard sent for a signal there
        self._put(self.key, json.dumps(request))

    def _put(self, key: str, text: str) -> None:
        self._outbox.put((key, text))
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_forever, name="guard-relay", daemon=True)
            self._writer.start()

    def _write_forever(self) -> None:
        while True:
            key, text = self._outbox.get()
            store = self.store
            if store is None:
                continue
            try:
                store.set(key, text)
            except Exception as exc:
                self.store = None
                what = "the run id" if key == RUN_ID_KEY else "the checkpoint request"
                self.agent.warn(f"cannot pass {what} to the other ranks: {exc!r}")

    def poll(self, count: int, every: int) -> None:
        """Every ``every`` steps (never per step): find the store once the job has one, then adopt a request
        rank 0 published (once per request)."""
        if not self.run_id_read and count < RUN_ID_EVERY_STEP_UNTIL:
            self.learn_run_id()
        if count < self.next_poll:
            return
        self.next_poll = count + every
        self.probe()
        if self.store is None:
            return
        if not self.run_id_read and self.run_id:
            self._read_run_id()
        try:
            if not self.store.check([self.key]):
                return
            request = json.loads(self.store.get(self.key))
        except Exception:
            return
        marker = (request.get("at_step"), request.get("stop"))
        if marker in self.handled or self.agent.checkpoint_request is not None:
            return
        self.handled.add(marker)
        self.agent.checkpoint_request = request
        if request.get("signal"):  # another node's guard got a termination signal: this node's guard must know
            self.agent.send({"t": "relayed", "signal": request["signal"], "origin": request.get("origin"),
                             "at_step": request.get("at_step")})
        elif request.get("stop") and request.get("trigger") == "deadline" and request.get("origin") is None:
            # node 0's guard's deadline request: this node's guard must know too, or its job ends on a request it
            # never heard of (node 0's margin, larger by its record's time, came before this node's own deadline
            # request: node 1 said PASS exit=0 and put no part of that step)
            self.agent.send({"t": "relayed", "trigger": "deadline", "origin": 0, "at_step": request.get("at_step")})

    def learn_run_id(self) -> None:
        """Read node 0's guard's run id now, when this node's rank has not yet (one ``Store.check`` round trip;
        nothing without a store or a run id). Called before a save is reported and at the job's end, so that the
        save goes under the run id the other nodes use."""
        if self.run_id_read or not self.run_id:
            return
        self.probe()
        if self.store is not None and not self.run_id_read:
            self._read_run_id()

    def _read_run_id(self) -> None:
        """Another node's rank: node 0's guard's run id, once rank 0 put it; told to this node's guard when it
        differs from its own."""
        try:
            if not self.store.check([RUN_ID_KEY]):
                return
            run_id = json.loads(self.store.get(RUN_ID_KEY)).get("run_id")
        except Exception:
            return
        self.run_id_read = True
        if isinstance(run_id, str) and run_id and run_id != self.run_id:
            self.agent.send({"t": "run_id", "run_id": run_id, "origin": 0})
