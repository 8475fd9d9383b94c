"""The background push interval fits the destination (guard.secure.cadence)."""

from __future__ import annotations

import pytest

from guard.secure.cadence import background_interval_s, listing_interval_s


def test_a_folder_secures_every_complete_save() -> None:
    assert background_interval_s("folder") == 0.0
    assert background_interval_s("folder", measured_push_s=120.0) == 0.0


def test_the_hub_stays_under_its_commit_rate_limit() -> None:
    # 128 commits/hour, a quarter for background pushes of 2 commits each: one push per 225 s at most
    assert background_interval_s("hub") == pytest.approx(225.0)
    pushes_per_hour = 3600 / background_interval_s("hub")
    assert pushes_per_hour * 2 <= 128 * 0.25


@pytest.mark.parametrize("nodes", [2, 4, 8])
def test_many_nodes_parts_at_the_hub_stay_under_its_commit_rate_limit(nodes: int) -> None:
    """Each push is every node's two commits (part files, manifest) and the record's: 2 * nodes + 1 commits. At the
    one-node interval (225 s) four nodes would make 9 commits every 225 s, 144 an hour: over the Hub's 128."""
    interval_s = background_interval_s("hub-parts", nodes=nodes)
    assert (3600 / interval_s) * (2 * nodes + 1) <= 128 * 0.25 + 1e-9
    assert (3600 / background_interval_s("hub")) * (2 * 4 + 1) > 128  # what the one-node cadence would do


def test_a_slow_push_widens_the_hub_interval() -> None:
    assert background_interval_s("hub", measured_push_s=10.0) == pytest.approx(225.0)
    assert background_interval_s("hub", measured_push_s=300.0) == pytest.approx(900.0)
    assert background_interval_s("hub", measured_push_s=float("nan")) == pytest.approx(225.0)


def test_other_limits_and_bad_input() -> None:
    assert background_interval_s("hub", commits_per_hour=1000, share=1.0) == pytest.approx(7.2)
    with pytest.raises(ValueError):
        background_interval_s("gs")
    # an object store: no commit limit, at most a third of the time spent pushing
    assert background_interval_s("s3") == 0.0
    assert background_interval_s("s3", measured_push_s=2.0) == pytest.approx(6.0)
    with pytest.raises(ValueError):
        background_interval_s("hub", share=0)


@pytest.mark.parametrize("nodes", [2, 4, 8])
def test_the_nodes_listings_of_a_hub_repo_stay_under_its_api_rate_limit(nodes: int) -> None:
    """The nodes that follow node 0 list the repo (about 3 API requests a listing); together at most a quarter of a
    free user's 1,000 requests per 5 minutes. At the 0.5 s a folder or a bucket gets, one node alone made 1,800."""
    every_s = listing_interval_s("hub", nodes=nodes, least_s=0.5)
    assert 3 * (nodes - 1) * 300 / every_s <= 1000 * 0.25 + 1e-9
    assert 3 * 300 / 0.5 > 1000
    assert listing_interval_s("folder", nodes=nodes, least_s=0.5) == listing_interval_s("s3", nodes=nodes,
                                                                                       least_s=0.5) == 0.5
    assert listing_interval_s("hub", nodes=2, least_s=0.5) == pytest.approx(3.6)


@pytest.mark.parametrize(("node_rank", "shared", "interval_s"), [(0, None, 562.5), (1, None, 0.0), (1, True, 225.0)])
def test_at_a_hub_repo_node_0_paces_the_nodes_parts_and_the_others_follow_at_once(
        node_rank: int, shared: bool | None, interval_s: float) -> None:
    """Two nodes, each on its own disk: node 0's background pushes keep to the commit budget of every node's part
    and the record; node 1 pushes each part node 0 put at once. Before, node 1 kept an interval of its own: a part
    fed after its last push waited, and at the deadline for the save its job was asked for, past its time (the
    deadline test at the local Hub secured step 20 of 533 and of 604; now 360 of 549). A shared output folder: node
    0 alone secures, as on one node."""
    from types import SimpleNamespace

    from guard.secure.budget import Deadline, MarginEstimator
    from guard.secure.dest.base import Destination
    from guard.secure.securing import Securing

    securing = Securing(deadline=Deadline(0.0, None, None, "none"), estimator=MarginEstimator(log_changes=False),
                        securer=SimpleNamespace(destination=Destination("hub", repo_id="alice/run"),  # type: ignore[arg-type]
                                                token=None),
                        push_interval_s=None, node_rank=node_rank, nodes=2, shared=lambda: shared,
                        pusher_factory=lambda dest, token: SimpleNamespace())  # type: ignore[arg-type,return-value]
    assert securing.plan._interval_s() == pytest.approx(interval_s)
