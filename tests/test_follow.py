"""Many nodes: a node other than node 0 feeds its plan its part of a step only once node 0 put that step
(``guard.secure.follow.Follower``), the newest such step; a step it holds no part of is looked for. Also the
description of a reported save as a node's part (``checkpoints.describe`` with ``parts``)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from fakes import InlineFs

from guard.secure import checkpoints
from guard.secure.checkpoints import CheckpointInfo
from guard.secure.follow import Follower


def part(step: int) -> CheckpointInfo:
    return CheckpointInfo(Path(f"/out/step_{step}"), step, 10, ("__1_0.distcp",), 0.0, part=True)


class Destination:
    """What node 0 and the others put: ``{step: {node ranks}}``, as ``PartsStore.part_steps`` says."""

    def __init__(self) -> None:
        self.steps: dict[int, set[int]] = {}
        self.listings = 0

    def put(self, step: int, node: int) -> None:
        self.steps.setdefault(step, set()).add(node)

    def list(self) -> dict[int, set[int]]:
        self.listings += 1
        return {step: set(nodes) for step, nodes in self.steps.items()}


@pytest.fixture
def dest() -> Destination:
    return Destination()


def follower(dest: Destination, fed: list[int], looked: list[int] | None = None) -> Follower:
    return Follower(dest.list, lambda info, requested: fed.append(info.step or -1), helpers=InlineFs(), every_s=1.0,
                    lookup=(looked.append if looked is not None else None))


def test_a_part_waits_for_node_0s_part_of_its_step(dest: Destination) -> None:
    fed: list[int] = []
    follow = follower(dest, fed)
    follow.hold(part(20))
    follow.hold(part(40))
    follow.tick(0.0)
    assert fed == [] and dest.listings == 1  # node 0 put nothing yet
    dest.put(20, 0)
    follow.tick(0.5)
    assert fed == [] and dest.listings == 1  # the next listing comes every_s later
    follow.tick(1.0)
    assert fed == [20] and set(follow.held) == {40}
    dest.put(40, 1)  # another follower's part is no lead
    follow.tick(2.0)
    assert fed == [20]
    dest.put(40, 0)
    follow.tick(3.0)
    assert fed == [20, 40] and not follow.held


def test_the_newest_step_node_0_put_is_followed_and_older_ones_dropped(dest: Destination) -> None:
    fed: list[int] = []
    follow = follower(dest, fed)
    for step in (20, 40, 60):
        follow.hold(part(step))
        dest.put(step, 0)
    follow.tick(0.0)
    assert fed == [60] and not follow.held
    follow.hold(part(40))  # older than the step fed: never to the plan
    assert not follow.held


def test_a_step_node_0_put_and_this_node_holds_no_part_of_is_looked_for(dest: Destination) -> None:
    fed: list[int] = []
    looked: list[int] = []
    follow = follower(dest, fed, looked)
    follow.hold(part(20))  # its scans found step 20; node 0 put 40
    dest.put(40, 0)
    follow.tick(0.0)
    assert looked == [40] and fed == []
    follow.hold(part(40))  # the lookup's answer: this node's part of 40, fed at once
    assert fed == [40] and not follow.held


def test_a_failed_listing_feeds_nothing(dest: Destination) -> None:
    fed: list[int] = []

    def broken() -> dict[int, set[int]]:
        raise OSError("unreachable")

    follow = Follower(broken, lambda info, requested: fed.append(1), helpers=InlineFs())
    follow.hold(part(20))
    follow.tick(0.0)
    assert fed == [] and set(follow.held) == {20}


@pytest.mark.parametrize(("files", "part"), [
    (["model.safetensors", "trainer_state.json", "rng_state_0.pth"], True),  # node 0: rng_state_1.pth elsewhere
    (["rng_state_1.pth"], True),  # node 1: its rank's file alone
    (["model.safetensors", "trainer_state.json", "rng_state_0.pth", "rng_state_1.pth"], False),  # whole here
])
def test_a_reported_trainer_checkpoint_of_two_nodes_is_a_part_by_the_jobs_world_size(tmp_path: Path,
                                                                                    files: list[str],
                                                                                    part: bool) -> None:
    folder = tmp_path / "checkpoint-10"
    folder.mkdir()
    for name in files:
        (folder / name).write_bytes(b"x")
    if "trainer_state.json" in files:
        (folder / "trainer_state.json").write_text('{"global_step": 10}')
    info = checkpoints.describe(folder, parts=True, world_size=2)
    assert info.part is part and info.step == 10
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= dict(info.requires).keys()
    assert not checkpoints.describe(folder).part  # one node: as before, no part


@pytest.mark.parametrize(("node_rank", "own", "taken"), [(1, True, True), (1, False, False), (0, True, False)])
def test_node_0s_run_id_replaces_only_another_nodes_own(node_rank: int, own: bool, taken: bool) -> None:
    """A node whose run id is its own (no launcher or scheduler gave every node one) takes node 0's, read from the
    job's store, for its parts at the destination (the securer's, which the pushes and listings use); a run id
    that was given (``--run-id``), or node 0's own, is kept."""
    from types import SimpleNamespace

    from guard.secure.budget import Deadline, MarginEstimator
    from guard.secure.dest.base import Destination
    from guard.secure.securing import Securing

    securer = SimpleNamespace(destination=Destination("folder", path="/dest"), token=None, run_id="mine")
    securing = Securing(deadline=Deadline(0.0, None, None, "none"), estimator=MarginEstimator(log_changes=False),
                        securer=securer, run_id="mine", node_rank=node_rank, nodes=2,  # type: ignore[arg-type]
                        own_run_id=own, pusher_factory=lambda dest, token: SimpleNamespace())  # type: ignore[arg-type,return-value]
    assert securing.peers.adopt_run_id("node0s") is taken
    assert (securing.run_id, securer.run_id) == (("node0s",) * 2 if taken else ("mine",) * 2)
    assert securing.peers.adopt_run_id("node0s") is False  # once


def test_listings_back_off_while_nothing_changes_and_start_again_on_a_new_save(dest: Destination) -> None:
    """Nothing new at the destination: the time between listings doubles from every_s to the cap (LIST_CAP_FLOOR_S
    while node 0's parts arrive fast), so an idle hour takes 360 listings, not 1,800 (every 2 s) or 7,200 (every
    0.5 s while a part is held); this node's next save, or node 0's part of a newer step, starts again from
    every_s, and a limit (the deadline near) holds them at every_s."""
    from guard.secure.follow import LIST_CAP_FLOOR_S

    fed: list[int] = []
    limit = [math.inf]
    follow = Follower(dest.list, lambda info, requested: fed.append(info.step or -1), helpers=InlineFs(),
                      every_s=0.5, limit_s=lambda: limit[0])
    follow.tick(0.0)
    follow.hold(part(20))
    times = []
    for tenth in range(1, 600):
        before = dest.listings
        follow.tick(tenth / 10)
        if dest.listings > before:
            times.append(tenth / 10)
    assert times[:5] == [0.1, 0.6, 1.6, 3.6, 7.6]  # 0.5, 1, 2, 4 s apart
    assert times[-1] - times[-2] == LIST_CAP_FLOOR_S
    dest.put(20, 0)
    follow.hold(part(40))  # a new save: from every_s again
    start = dest.listings
    for tenth in range(600, 620):
        follow.tick(tenth / 10)
    assert fed == [20] and dest.listings - start >= 2  # found at once, and listed again within 2 s
    idle_start = dest.listings
    for second in range(62, 3662):
        follow.tick(float(second))
    assert dest.listings - idle_start <= 3600 / LIST_CAP_FLOOR_S + 6, dest.listings - idle_start
    limit[0] = 0.0  # the deadline's save asked for: every every_s, as before
    start = dest.listings
    for tenth in range(36620, 36720):
        follow.tick(tenth / 10)
    assert dest.listings - start == 20


def test_at_the_jobs_end_the_last_part_waits_for_node_0s_then_follows(dest: Destination) -> None:
    """The job ended well holding its part of step 200, which node 0 has not put yet: the end waits, listing at the
    same pace, until node 0's part is listed (then this node's is fed), not at once."""
    fed: list[int] = []
    follow = follower(dest, fed)
    dest.put(180, 0)
    follow.hold(part(180))
    follow.tick(0.0)
    follow.hold(part(200))
    assert fed == [180] and follow.end(until=100.0) == 200
    follow.tick(1.0)
    assert follow.waiting(1.0) and fed == [180] and follow.due_at(1.5) == 2.0
    dest.put(200, 0)
    follow.tick(2.0)
    assert fed == [180, 200] and not follow.waiting(2.0)


def test_at_the_jobs_end_the_wait_ends_at_its_bound_or_a_later_step(dest: Destination) -> None:
    fed: list[int] = []
    follow = follower(dest, fed)
    follow.hold(part(200))
    assert follow.end(until=10.0) == 200
    follow.tick(0.0)
    assert follow.waiting(9.9) and follow.due_at(9.5) == 9.5
    assert not follow.waiting(10.0) and not follow.waiting(1.0) and fed == []  # over for good
    later = follower(dest, fed)
    later.hold(part(200))
    later.end(until=10.0)
    dest.put(220, 0)  # node 0 put a later step: this one's part will never be its
    later.tick(0.0)
    assert not later.waiting(0.0)
    # node 0 pushing a final model puts no part of the last save: the wait is END_WAIT_MIN_S, or 3x the slowest
    # arrival of node 0's part seen
    from guard.secure.follow import END_WAIT_MIN_S

    assert follow.end_wait_s() == END_WAIT_MIN_S
    follow.arrivals_s = [4.0, 25.0]
    assert follow.end_wait_s() == 75.0


def test_at_the_jobs_end_nothing_held_past_node_0s_steps_keeps_the_guard(dest: Destination) -> None:
    fed: list[int] = []
    follow = follower(dest, fed)
    dest.put(200, 0)
    follow.hold(part(200))
    follow.tick(0.0)
    assert fed == [200] and follow.end(until=10.0) is None and not follow.waiting(0.0)
