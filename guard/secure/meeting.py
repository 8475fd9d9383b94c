"""Many nodes meet at the destination: a node whose part of a step is in waits there for the others' parts.

Each node's guard puts its own part of a checkpoint, then calls :func:`await_whole`, which polls the destination's
listing (every ``PARTS_POLL_S``) until every node's part of that step is there and their union is whole
(``guard.secure.nodes.whole``), and returns the parts for the record. Any node may then move the record (a
conditional write: the second writer finds it done). The nodes share nothing but the destination, so a node that
died simply never adds its part, and the wait ends in a ``PartsMissingError`` naming it. At the end of the run,
:func:`newest_part` tells every node the same: which nodes' parts of the newest step are there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from guard.errors import PartsMissingError, PushFailedError
from guard.secure import nodes as many
from guard.secure.dest.base import PartManifest, PartsStore, Store

__all__ = ["PARTS_POLL_S", "RECORD_CUTOFF_S", "await_whole", "newest_part", "parts_store"]

#: How often a node whose part is in looks for the others' (seconds; one listing each).
PARTS_POLL_S = 0.5
#: No node moves the record later than this before its push's deadline (seconds), so that every node, waiting
#: until ``2 * PARTS_POLL_S`` before its own, sees it (the nodes' deadlines agree within a second or so).
RECORD_CUTOFF_S = 3.0


def parts_store(store: Store, *, destination: str, kind: str, nodes: int) -> PartsStore:
    """``store`` as a ``PartsStore`` (a folder, S3, a Hub repo: where each node can keep its own part).

    Raises:
        PushFailedError: the store keeps no node parts.
    """
    if not isinstance(store, PartsStore):
        raise PushFailedError(f"a {kind} destination keeps no node parts: {nodes} nodes cannot each secure their "
                              "own part there", destination=destination,
                              hint="secure from node 0 alone (a shared output folder), or use a folder, s3:// or "
                                   "hf:// destination")
    return store


def await_whole(store: PartsStore, *, run_id: str, step: int, node_rank: int, nodes: int, deadline: float,
                destination: str, clock: Callable[[], float], sleep: Callable[[float], None],
                log: logging.Logger) -> list[PartManifest]:
    """This node's part of ``step`` is in: wait until every node's part is and their union is whole, then return
    the parts for the record.

    Args:
        store: the destination's store.
        run_id, step: the checkpoint (this run's).
        node_rank, nodes: this node's index and the job's node count (``SecureSettings``).
        deadline: clock value by which this node's push must be over.
        destination: the destination's text, for messages.
        clock, sleep: monotonic seconds (``deadline``'s clock) and the wait between listings.
        log: where the wait is logged.

    Returns:
        Every node's manifest of ``step``, by node order.

    Raises:
        PartsMissingError: not whole before ``deadline`` (less the time of two more listings), whole only after
            ``RECORD_CUTOFF_S`` before it with no record naming it yet, or the other nodes put a later step (they
            skipped this one). Its ``missing`` is the VERDICT's ``missing=`` value.
    """
    said = None
    while True:
        found = many.whole(store.parts(run_id=run_id, step=step, deadline=deadline), run_id=run_id, step=step,
                           nodes=nodes)
        if found.complete and clock() > deadline - RECORD_CUTOFF_S and not _records(store, run_id, step, deadline):
            # the other nodes stop waiting PARTS_POLL_S * 2 before their deadline: a record moved later than this
            # could be unseen by some of them, whose VERDICT would then name an older step than the record (one
            # another node moved in time is this node's too: the record's write finds it in place)
            raise PartsMissingError(
                f"checkpoint step {step} became whole at {destination} too late to move the record "
                f"({RECORD_CUTOFF_S:.0f}s before the deadline)", missing="", destination=destination,
                hint="a larger --margin leaves the nodes time to secure the checkpoint together")
        if found.complete:
            log.info("%s", found.describe())
            return list(found.parts.values())
        if found.describe() != said:
            said = found.describe()
            log.info("waiting for the other nodes' parts: %s", said)
        ahead = _others_ahead(store, run_id, step, node_rank, nodes, deadline)
        if ahead is not None:  # the nodes missing here put a later step: they will never put this one
            raise PartsMissingError(
                f"checkpoint step {step} will not be whole at {destination}: {said}; the other nodes put step "
                f"{ahead}", missing=found.missing_text(), destination=destination,
                hint="the nodes secure the same steps when their saves are as fast as their pushes; a later step is "
                     "secured instead")
        if clock() + 2 * PARTS_POLL_S >= deadline:
            raise PartsMissingError(
                f"checkpoint step {step} is not whole at {destination}: {said}", missing=found.missing_text(),
                destination=destination,
                hint=f"node {node_rank}'s part is there, verified; the record was not moved: look at the VERDICT of "
                     "the missing nodes")
        sleep(PARTS_POLL_S)


def _records(store: PartsStore, run_id: str, step: int, deadline: float) -> bool:
    """Whether the destination's record names ``step`` of this run already (another node moved it)."""
    record = store.read_record(deadline=deadline)
    return record is not None and record.step == step and record.run_id in (None, run_id)


def _others_ahead(store: PartsStore, run_id: str, step: int, node_rank: int, nodes: int,
                  deadline: float) -> int | None:
    """The lowest step after ``step`` that every other node has put a part of (they skipped ``step``: its push
    would wait for parts that never come), or None."""
    others = set(range(nodes)) - {node_rank}
    later = [s for s, ranks in store.part_steps(run_id=run_id, deadline=deadline).items()
             if s > step and others <= ranks]
    return min(later) if later else None


def newest_part(store: PartsStore, *, run_id: str, nodes: int, deadline: float) -> many.Whole | None:
    """What the destination holds of ``run_id``'s newest step that any node put a part of (one listing of the
    steps, one of that step's manifests), or None when it holds no part of the run: every node that asks after the
    pushes are over gets the same answer, whatever its own pushes saw (the VERDICT's ``missing=``)."""
    steps = store.part_steps(run_id=run_id, deadline=deadline)
    if not steps:
        return None
    step = max(steps)
    return many.whole(store.parts(run_id=run_id, step=step, deadline=deadline), run_id=run_id, step=step, nodes=nodes)
