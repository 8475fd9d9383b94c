"""The background push interval fits the destination (guard.secure.cadence)."""

from __future__ import annotations

import pytest

from guard.secure.cadence import background_interval_s


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
