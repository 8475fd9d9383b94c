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

The listings back off: each one doubles the time to the next, from ``every_s`` up to a cap: twice the slowest
recent arrival of node 0's part (from this node's save of a step to node 0's part of it listed: node 0's push time,
as this node sees it), at least ``LIST_CAP_FLOOR_S``, at most ``LIST_CAP_S``, and never above ``limit_s()``
(``Securing``: a quarter of the time left before the deadline's save is asked for, and ``every_s`` from then on or
once securing has begun, so that the deadline's part is put as soon as before). A newer part of this node's own (a
save: node 0's part of it comes about one push time later, found within about one more) or a newer step of node
0's starts again from ``every_s``. At S3 a listing is one LIST request per 1,000 keys of the run's staging place;
at 0.5 s while a part was held and 2 s otherwise, a node listed about 1,800 times an hour when nothing happened.

At a job's good end (:meth:`Follower.end`) the guard of a node other than 0 keeps listing, every ``every_s``
(``Securing``'s limit), until node 0 put its part of the newest step held here (then this node's follows and the
record moves to it), or a later step, or the wait's bound passed (:meth:`Follower.end_wait_s`: node 0 puts no part
of it when it pushes a final model instead, and nothing at the destination says so). Before, its guard ended at
once holding its part of the last save, while node 0's waited its whole final window for it: at a Hub repo node 0
said PASS after 206.6 s against node 1's 29.1 s, the record at step 20 of 200 (at a folder node 1's part had been
pushed during the run).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

from guard.core.helpers import Helpers, Submitter, wake_loop
from guard.secure.checkpoints import CheckpointInfo
from guard.secure.scans import Port

__all__ = ["DEST_HELPERS", "END_WAIT_FACTOR", "END_WAIT_MIN_S", "HELD_MAX", "LIST_CAP_FLOOR_S", "LIST_CAP_S",
           "LIST_EVERY_S", "Follower"]

log = logging.getLogger("guard.secure")

#: The time between a node's listings of the destination for node 0's steps, after a change (seconds).
LIST_EVERY_S = 0.5
#: The longest time between two listings when nothing changes (seconds) ...
LIST_CAP_S = 60.0
#: ... and the least cap, whatever node 0's parts take to arrive (seconds).
LIST_CAP_FLOOR_S = 10.0
#: How many of the newest arrivals of node 0's parts the cap follows.
ARRIVALS_KEPT = 4
#: At a job's good end, the longest a node waits for node 0's part of its last save (seconds) is this ...
END_WAIT_MIN_S = 30.0
#: ... or this many times the slowest recent arrival of node 0's part, when more: node 0 puts no part of it when it
#: pushes a final model instead (a Trainer's), and the destination does not say so.
END_WAIT_FACTOR = 3.0
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
        every_s: the time between listings after a change (seconds; default ``LIST_EVERY_S``).
        limit_s: ``() -> float``: the longest time between listings now, whatever the backoff (seconds, asked at
            each listing); default ``every_s``: no backoff.
        leader: the node whose steps are followed (default 0).
    """

    def __init__(self, list_steps: Callable[[], dict[int, set[int]]], feed: Feed, *,
                 lookup: Callable[[int], None] | None = None, helpers: Submitter = DEST_HELPERS,
                 every_s: float = LIST_EVERY_S, limit_s: Callable[[], float] | None = None,
                 leader: int = 0) -> None:
        self._list, self._feed, self._lookup = list_steps, feed, lookup
        self._port = Port(helpers)
        self.every_s, self.leader = every_s, leader
        self._limit_s = limit_s if limit_s is not None else (lambda: every_s)
        self.wait_s = every_s  # the gap after the next listing: doubles while nothing changes
        self.listings = 0
        self._now = -math.inf  # the last tick's time
        self._held_at: dict[int, float] = {}  # step -> when this node's part of it was first held
        self.arrivals_s: list[float] = []  # the newest times from a save held here to node 0's part of it listed
        self.held: dict[int, tuple[CheckpointInfo, bool | None]] = {}
        self.fed_step: int | None = None
        self.led_step: int | None = None  # the newest step node 0 put, as last listed
        self._looked_up: int | None = None
        self._last_at = -math.inf  # when the last listing started
        self._gap_s = every_s  # the time from it to the next
        self._failed_logged = False
        self._awaited: int | None = None  # at the job's end: the step whose part waits for node 0's
        self._until = math.inf

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
            if not self.held or info.step > max(self.held):  # a new save: node 0's part of it comes soon
                self._back_to_start()
            self._held_at.setdefault(info.step, self._now)
        self.held[info.step] = (info, requested)
        for step in sorted(self.held)[:-HELD_MAX]:
            del self.held[step]
        for step in [s for s in self._held_at if s not in self.held]:
            del self._held_at[step]
        if info.step == self.led_step:
            self._follow(info.step)

    def tick(self, now: float) -> None:
        """On the loop: hand back a finished listing; start the next one ``wait_s`` after the last while a part is
        held, or once one was (see the module on the backoff). Never waits."""
        self._now = now
        self._port.drain()
        if self._listing() and not self._port.in_flight and now >= self._next_at():
            self._last_at, self._gap_s = now, self.wait_s
            self.wait_s = max(self.every_s, min(self.cap_s(), self.wait_s * 2))
            self.listings += 1
            self._port.submit(self._list, apply=self._listed)
            self._port.drain()  # answered already (a listing that runs inline, in tests)

    def cap_s(self) -> float:
        """The longest time between two listings now (seconds; the module says how)."""
        arrival_s = max(self.arrivals_s, default=0.0)
        return max(self.every_s, min(LIST_CAP_S, max(LIST_CAP_FLOOR_S, 2 * arrival_s), self._limit_s()))

    def _next_at(self) -> float:
        """When the next listing is due: the gap chosen at the last one, no longer than ``limit_s()`` allows now."""
        return self._last_at + min(self._gap_s, max(self.every_s, self._limit_s()))

    def _back_to_start(self) -> None:
        """Something changed: the next listing ``every_s`` after the last one, the backoff from there."""
        self._gap_s = min(self._gap_s, self.every_s)
        self.wait_s = self.every_s

    def _listing(self) -> bool:
        return bool(self.held) or self.fed_step is not None

    def due_at(self, now: float) -> float:
        """When ``tick`` has work next (the loop's clock), ``inf`` when it lists nothing; at the job's end the
        wait's bound too."""
        due = max(now, self._next_at()) if self._listing() else math.inf
        return min(due, self._until) if self._awaited is not None else due

    def end_wait_s(self) -> float:
        """The longest the job's end waits for node 0's part (seconds): ``END_WAIT_MIN_S``, or ``END_WAIT_FACTOR``
        times the slowest recent arrival of node 0's part when more."""
        return max(END_WAIT_MIN_S, END_WAIT_FACTOR * max(self.arrivals_s, default=0.0))

    def end(self, until: float) -> int | None:
        """The job ended well: the newest step held here that node 0 has not put (as last listed) is awaited until
        node 0 puts it or a later step, or until ``until`` (the loop's clock); see :meth:`waiting`. Returns that
        step, or None when nothing held waits (nothing to keep the guard for)."""
        self._awaited, self._until = self.unled_step(), until
        return self._awaited

    def waiting(self, now: float) -> bool:
        """At the job's end (:meth:`end`): node 0's part of the awaited step (or of a later one) is not listed yet
        and ``now`` is before the bound; False once either came (the wait is over for good)."""
        if self._awaited is None:
            return False
        if self.led_step is not None and self.led_step >= self._awaited:
            self._awaited = None
        elif now >= self._until:
            log.warning("node %d put no part of step %d (or later) in the time the job's end waits for it (it may "
                        "have pushed a final model instead): this node's part of it stays on its disk", self.leader,
                        self._awaited)
            self._awaited = None
        return self._awaited is not None

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
        if self.led_step is None or max(led) > self.led_step:
            self._back_to_start()
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
        held_at = self._held_at.get(step)
        if held_at is not None and math.isfinite(held_at):
            self.arrivals_s = [*self.arrivals_s, max(0.0, self._now - held_at)][-ARRIVALS_KEPT:]
        info, requested = self.held[step]
        self.held = {s: held for s, held in self.held.items() if s > step}
        self._held_at = {s: at for s, at in self._held_at.items() if s > step}
        self.fed_step = step
        log.debug("node %d put its part of step %d: this node's follows", self.leader, step)
        self._feed(info, requested)
