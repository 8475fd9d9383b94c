"""Many nodes, each with its own disk: every other node puts its part of the step node 0 put.

Each node's guard finds its own part of every save, and a step is secured only once every node put its part of it
(``guard.secure.meeting``). When each node pushed the newest part on its own disk, the nodes seldom agreed: node 0's
reported save was put at once while node 1's counted only once unchanged for 2 s, a node waiting for a step the
others skipped pushed its newest next, and at a save every 0.5 s (or 4 s) two nodes never put the same step within
150 s. So node 0 leads: its guard pushes its newest part, as on one node. The guard of every other node holds its
parts (:class:`Follower`) and feeds its plan one only once node 0's part of that step is at the destination: the
newest such step. When this node holds no part of that step (its scans return only the newest complete folder, and
an unreported save counts only once unchanged for 2 s), it looks for that step's folder (``lookup``). Node 0's wait
then ends as soon as the others put theirs: every rank saves at the same steps. The nodes meet through the
destination's listing alone; it runs on a thread of its own (``DEST_HELPERS``), never on the loop.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

from guard.core.helpers import Helpers, Submitter, wake_loop
from guard.secure.checkpoints import CheckpointInfo
from guard.secure.scans import Port

__all__ = ["DEST_HELPERS", "HELD_MAX", "IDLE_LIST_EVERY_S", "LIST_EVERY_S", "Follower"]

log = logging.getLogger("guard.secure")

#: How often a node that holds a part lists the destination for node 0's steps (seconds).
LIST_EVERY_S = 0.5
#: ... and when it holds none (it looks for the part of each new step node 0 put: ``lookup``).
IDLE_LIST_EVERY_S = 2.0
#: How many of its newest parts a node holds for node 0 to put (older ones are dropped: node 0 leads with newer).
HELD_MAX = 16
#: The thread of the destination's listings (a slow bucket holds up no scan and no helper command).
DEST_HELPERS = Helpers(wake_loop, name="guard-dest")

Feed = Callable[[CheckpointInfo, "bool | None"], None]


class Follower:
    """A node other than node 0: its parts go to its plan once node 0 put the same step (see the module).

    Args:
        list_steps: ``() -> {step: {node ranks}}``, which nodes put a part of which step of this run
            (``PartsStore.part_steps``; it may block: it runs on ``helpers``' thread).
        feed: ``(info, requested)``: a part to the plan (``Securing``'s ``CheckpointSeen``).
        lookup: ``(step) -> None``: look for this node's part of ``step`` (node 0 put it, this node holds none);
            the answer, when found, comes back through ``hold``. Default: none.
        helpers: where the listings run (default ``DEST_HELPERS``; tests pass one that runs them inline).
        every_s: the time between listings (seconds; default ``LIST_EVERY_S``).
        leader: the node whose steps are followed (default 0).
    """

    def __init__(self, list_steps: Callable[[], dict[int, set[int]]], feed: Feed, *,
                 lookup: Callable[[int], None] | None = None, helpers: Submitter = DEST_HELPERS,
                 every_s: float = LIST_EVERY_S, leader: int = 0) -> None:
        self._list, self._feed, self._lookup = list_steps, feed, lookup
        self._port = Port(helpers)
        self.every_s, self.leader = every_s, leader
        self.held: dict[int, tuple[CheckpointInfo, bool | None]] = {}
        self.fed_step: int | None = None
        self.led_step: int | None = None  # the newest step node 0 put, as last listed
        self._looked_up: int | None = None
        self._next_at = -math.inf
        self._failed_logged = False

    def hold(self, info: CheckpointInfo, requested: bool | None = None) -> None:
        """This node's part ``info`` (a step newer than the last fed; one without a step is fed at once: nothing
        to follow it by)."""
        if info.step is None:
            self._feed(info, requested)
            return
        if self.fed_step is not None and info.step <= self.fed_step:
            return
        if info.step not in self.held:
            log.debug("part of step %d held until node %d's part of it is at the destination", info.step,
                      self.leader)
        self.held[info.step] = (info, requested)
        for step in sorted(self.held)[:-HELD_MAX]:
            del self.held[step]
        if info.step == self.led_step:
            self._follow(info.step)

    def tick(self, now: float) -> None:
        """On the loop: hand back a finished listing; start the next one ``every_s`` after the last while a part
        is held (``IDLE_LIST_EVERY_S`` when none is, once one was). Never waits."""
        self._port.drain()
        if self._listing() and not self._port.in_flight and now >= self._next_at:
            self._next_at = now + (self.every_s if self.held else max(self.every_s, IDLE_LIST_EVERY_S))
            self._port.submit(self._list, apply=self._listed)
            self._port.drain()  # answered already (a listing that runs inline, in tests)

    def _listing(self) -> bool:
        return bool(self.held) or self.fed_step is not None

    def due_at(self, now: float) -> float:
        """When ``tick`` has work next (the loop's clock), ``inf`` when it lists nothing."""
        return max(now, self._next_at) if self._listing() else math.inf

    def _listed(self, steps: object, error: BaseException | None) -> None:
        if not isinstance(steps, dict):
            if not self._failed_logged:
                self._failed_logged = True
                log.warning("cannot list the destination for node %d's parts (%r): this node's parts wait",
                            self.leader, error)
            return
        led = [step for step, nodes in steps.items() if self.leader in nodes
               and (self.fed_step is None or step > self.fed_step)]
        if not led:
            return
        self.led_step = step = max(led)
        if step in self.held:
            self._follow(step)
        elif self._lookup is not None and step != self._looked_up:
            self._looked_up = step
            self._lookup(step)
        else:
            self._looked_up = None  # looked for once: again at the next listing

    def unled_step(self) -> int | None:
        """The newest step this node holds a part of that node 0 (the leader) never put, as last listed: its part
        waits on this node's disk; None when there is none."""
        waiting = [step for step in self.held if self.led_step is None or step > self.led_step]
        return max(waiting) if waiting else None

    def _follow(self, step: int) -> None:
        info, requested = self.held[step]
        self.held = {s: held for s, held in self.held.items() if s > step}
        self.fed_step = step
        log.debug("node %d put its part of step %d: this node's follows", self.leader, step)
        self._feed(info, requested)
