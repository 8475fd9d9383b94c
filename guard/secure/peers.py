"""This node among the job's nodes, as securing sees it: its rank, parts mode, the run id it shares with node 0,
the following of node 0's steps, and what another node's guard did for it.

Many nodes secure a checkpoint one of two ways. Parts mode (:meth:`Peers.parts_mode`: output folders of their own
and a destination whose store keeps node parts): every node's guard puts its own part of each step, and a node other
than 0 feeds its plan a part only once node 0 put its part of that step (``guard.secure.follow.Follower``, made on
first use here); at the job's good end it waits for node 0's part of its last save (:meth:`Peers.end_follows`).
Otherwise node 0's guard secures the checkpoints alone and the others push nothing (:meth:`Peers.other_node_secures`).
The nodes' parts meet under one run id: node 0's guard's, adopted here when this node had only its own
(:meth:`Peers.adopt_run_id`). Another node's signal or deadline reaches every rank through the job's store
(``guard/run/relay.py``): then this node's guard asks the job for no save of its own (:meth:`Peers.asks_elsewhere`).
``guard.secure.securing.Securing`` holds one ``Peers``; one node is ``nodes=1``, and then nothing here acts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from guard.secure import checkpoints
from guard.secure.cadence import listing_interval_s
from guard.secure.follow import LIST_EVERY_S, Follower
from guard.secure.link import JobLink

if TYPE_CHECKING:
    from guard.secure.securer import Securer

__all__ = ["LIST_BOUND_S", "Peers", "destination_kind"]

log = logging.getLogger("guard.secure")

LIST_BOUND_S = 5.0  # many nodes: one listing of the destination's parts takes this long at most


def destination_kind(securer: Securer | None) -> str | None:
    """``"folder"``, ``"hub"`` or ``"s3"``: where ``securer`` pushes, or None."""
    kind = getattr(getattr(securer, "destination", None), "kind", None)
    return kind if isinstance(kind, str) else None


class Peers:
    """This node's part in a job of ``nodes`` nodes.

    Args:
        securer: ``() -> Securer | None``: securing's securer now (a Trainer's ``hub_model_id`` may bring one late).
        run_id: this run's id (``Securing``'s ``run_id``). own_run_id: it is this node's own (no launcher or
            scheduler gave every node one): node 0's guard's replaces it (:meth:`adopt_run_id`). run_id_taken:
            called with node 0's run id when it does, or None.
        node_rank, nodes: this node's index and the job's node count (default one node).
        shared: ``() -> bool | None``: whether the nodes share the output folder (None while unknown).
        to_plan: ``(info, requested) -> None``: a part this node held, fed to its plan (node 0 put its own).
        lookup: ``(step) -> None``: look for this node's part of ``step`` (``Follower``'s ``lookup``).
        limit_s: ``() -> float``: the longest time between two listings for node 0's parts (``Follower``'s).

    Attributes:
        follower: the ``Follower`` of node 0's steps (a node other than 0, in parts mode, once a part came), or None.
        follows_node_0: node 0's guard asked for the deadline's or signal's checkpoint (through the job's store).
        node_0_secures: node 0's guard secures the run's checkpoints and final model (not parts mode).
        node_0_pushes_final: the job ended well and node 0's guard pushes the final model.
        relayed: every rank already has another node's request to save and stop (``guard/run/relay.py``).
        end_awaits: the job's good end waits for node 0's part (``Follower.end``); None until asked (once).
    """

    def __init__(self, *, securer: Callable[[], Securer | None], run_id: str, own_run_id: bool = False,
                 run_id_taken: Callable[[str], None] | None = None, node_rank: int = 0, nodes: int = 1,
                 shared: Callable[[], bool | None] = lambda: None,
                 to_plan: Callable[[checkpoints.CheckpointInfo, bool | None], None],
                 lookup: Callable[[int], None], limit_s: Callable[[], float]) -> None:
        self._securer = securer
        self.run_id = run_id
        self.own_run_id, self._run_id_taken = own_run_id, run_id_taken
        self._run_id_conflict_logged = False
        self.node_rank, self.nodes, self.shared = node_rank, max(1, nodes), shared
        self._to_plan, self._lookup, self._limit_s = to_plan, lookup, limit_s
        self.follower: Follower | None = None
        self.follows_node_0 = False
        self.node_0_secures = False
        self.node_0_pushes_final = False
        self.relayed = False
        self.end_awaits: bool | None = None
        self._node_checked = False

    def parts_mode(self) -> bool:
        """Every node secures its own part of each checkpoint, the record moving once all are in
        (``securer.Securer``'s many-node push): many nodes, an output folder not known to be shared, and a destination
        whose store keeps node parts (a folder, S3, a Hub repo). Otherwise node 0's guard secures the checkpoints
        alone."""
        kind = getattr(getattr(self._securer(), "destination", None), "kind", None)
        return self.nodes > 1 and kind in ("s3", "folder", "hub") and self.shared() is not True

    def cadence_kind(self, securer: Securer | None) -> str | None:
        """The destination kind the background cadence follows (``cadence.background_interval_s``): ``"parts"``
        when many nodes secure their own parts of each checkpoint at S3 (every node pushes every complete save, so
        that all push the same steps); at a Hub repo ``"hub-parts"`` on node 0 (under its commit rate limit, each
        push being every node's commits and the record's) and ``"parts"`` on the others, which push only the steps
        node 0 put (``guard.secure.follow``): under an interval of their own, a part fed between two of node 0's
        pushes waited for the next one, and at the deadline for the save the job was asked for, past its time
        (node 1 held step 240 from 26.4 s to 2.3 s before its deadline); else the destination's."""
        kind = destination_kind(securer)
        if kind == "hub" and self.nodes > 1 and self.shared() is not True:
            return "hub-parts" if self.node_rank == 0 else "parts"
        return "parts" if kind == "s3" and self.nodes > 1 else kind

    def dest_run_id(self) -> str | None:
        """The run id this node's parts go under at the destination (the securer's, once there is one)."""
        return getattr(self._securer(), "run_id", None)

    def adopt_run_id(self, run_id: str) -> bool:
        """Node 0's guard's run id, read from the job's store by this node's agents (``guard.inside.agent._dist``):
        it replaces this node's own (``own_run_id``: none was given to every node), for the run's taints and the
        nodes' parts at the destination, so that they meet with node 0's. A run id given (``--run-id``, the
        launcher's, the scheduler's) is kept, the difference warned about once. Returns whether it was taken.

        This node's parts wait for node 0's of the same step under the run id (``guard.secure.follow``), so none
        was put under the one replaced."""
        if not run_id or run_id == self.run_id:
            return False
        if not self.own_run_id or self.node_rank == 0:
            if not self._run_id_conflict_logged:
                self._run_id_conflict_logged = True
                log.warning("node 0's guard's run id is %s, this node's %s: the nodes' parts of one checkpoint do not "
                            "meet; give every node the same --run-id (or none: node 0's then reaches the others "
                            "through the job's store)", run_id, self.run_id)
            return False
        log.info("run id %s: node 0's guard's, through the job's store (in place of this node's own %s)", run_id,
                 self.run_id)
        self.run_id, self.own_run_id = run_id, False
        securer = self._securer()
        if securer is not None:
            securer.run_id = run_id
        if self._run_id_taken is not None:
            self._run_id_taken(run_id)
        return True

    def other_node_secures(self, sup: JobLink, has_pusher: bool) -> bool:
        """Whether this guard just learnt it runs on a node other than 0 outside parts mode: node 0's guard secures
        the checkpoints and this one pushes nothing (True once; the node's rank may come late: the launcher's own
        agent says hello before the ranks do)."""
        if self._node_checked or not has_pusher or self.parts_mode():
            return False
        node = sup.node_rank
        if node not in (None, 0):
            log.info("node %d: the guard of node 0 secures checkpoints; this one does not push", node)
            self.node_0_secures = True
            self._node_checked = True
            return True
        if node == 0:
            self._node_checked = True
        return False  # None: not known yet: asked again next time

    def asks_elsewhere(self, sup: JobLink) -> bool:
        """The job's save and stop is asked for elsewhere, not by this guard: every rank already has another node's
        request (a signal there), or node 0's guard asks (through the job's store)."""
        if self.relayed:
            log.info("the job already saves at the step another node's guard asked for (a signal there); waiting "
                     "for that save")
            return True
        if sup.follows_node_0:
            self.follows_node_0 = True
            log.info("node %s: node 0's guard asks for the checkpoint (through the job's store); waiting for the "
                     "job to save and end", sup.node_rank)
            return True
        return False

    def holds(self, info: checkpoints.CheckpointInfo, requested: bool | None) -> bool:
        """Whether this node keeps ``info`` from its plan: in parts mode, on a node other than 0, a whole
        checkpoint (node 0's guard secures its own copy) or a part that waits for node 0's part of its step."""
        if not (self.parts_mode() and self.node_rank != 0):
            return False
        if not info.part:
            log.debug("node %d: %s is whole on this node's disk: node 0's guard secures its own copy",
                      self.node_rank, info.path)
            return True
        follower = self._following()
        if follower is not None:  # to the plan once node 0 put its part of that step (guard.secure.follow)
            follower.hold(info, requested)
            return True
        return False

    def _following(self) -> Follower | None:
        """This node's :class:`follow.Follower` (made on first use) when its store keeps node parts, else None."""
        securer = self._securer()
        if self.follower is None and securer is not None:
            def list_steps() -> dict[int, set[int]]:  # on the destination's thread
                from guard.secure.dest.base import PartsStore

                store = securer.store
                if not isinstance(store, PartsStore):
                    return {}
                return store.part_steps(run_id=securer.run_id, deadline=time.monotonic() + LIST_BOUND_S)

            every_s = listing_interval_s(destination_kind(securer) or "folder", nodes=self.nodes,
                                         least_s=LIST_EVERY_S)
            if every_s > LIST_EVERY_S:
                log.info("node %d lists %s for node 0's parts every %.1fs at most (the Hub's API rate limit, shared "
                         "by %d following nodes)", self.node_rank, securer.destination, every_s, self.nodes - 1)
            self.follower = Follower(list_steps, self._to_plan, lookup=self._lookup, every_s=every_s,
                                     limit_s=self._limit_s)
        return self.follower

    def tick(self, now: float) -> bool:
        """The follower's turn; True when the job's end waited for node 0's part and that wait is over now."""
        if self.follower is None:
            return False
        self.follower.tick(now)
        if self.end_awaits and not self.follower.waiting(now):
            self.end_awaits = False
            return True
        return False

    def end_follows(self, now: float, *, watching: bool, secure_by: float, window_s: Callable[[], float]) -> bool:
        """A node other than 0 whose job ended well holds its part of a step node 0 has not put yet (its last save,
        as a rule): whether the job's end waits (once) until node 0's part of it is listed, so that this node's part
        follows and the record moves to it (``follow.Follower.end``). The wait is ``Follower.end_wait_s`` at most
        (node 0 pushing a final model puts no part), and ``window_s()`` (the final window less this node's push and
        the record's move), never past ``secure_by``. ``watching``: the plan has not begun securing."""
        follower = self.follower
        if follower is None or self.end_awaits is not None or not watching:
            return False
        wait_s = min(follower.end_wait_s(), window_s())
        step = follower.end(min(now + wait_s, secure_by))
        self.end_awaits = step is not None
        if step is not None:
            log.info("node %d: the job ended; its part of step %d waits for node 0's (%.0fs at most)",
                     self.node_rank, step, min(wait_s, secure_by - now))
        return self.end_awaits
