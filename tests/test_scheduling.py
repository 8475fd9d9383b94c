"""The order the slow tests start in (``conftest.interleaved``): waiting and computing units taken in step, each
longest first, so that the two cores stay busy while some workers wait out deadlines."""

from __future__ import annotations

from conftest import WAITER_CPU_SHARE, interleaved


def test_waiting_and_computing_units_start_in_step_each_longest_first() -> None:
    units = [("wait-40", 40.0, 4.0), ("wait-30", 30.0, 3.0), ("wait-10", 10.0, 1.0),
             ("cpu-40", 40.0, 30.0), ("cpu-20", 20.0, 15.0), ("cpu-20b", 20.0, 15.0)]
    order = interleaved(units)
    assert sorted(order) == sorted(u[0] for u in units)
    waits, cpus = [u for u in order if u.startswith("wait")], [u for u in order if u.startswith("cpu")]
    assert waits == ["wait-40", "wait-30", "wait-10"] and cpus == ["cpu-40", "cpu-20", "cpu-20b"]
    # never two of a kind ahead while the other list lags behind its share: here they alternate
    assert order == ["cpu-40", "wait-40", "cpu-20", "wait-30", "cpu-20b", "wait-10"]


def test_the_split_is_the_cpu_share_and_one_kind_alone_is_longest_first() -> None:
    at_share = ("edge", 10.0, WAITER_CPU_SHARE * 10.0)  # at the share: computes
    just_under = ("under", 10.0, WAITER_CPU_SHARE * 10.0 - 0.1)  # below it: waits
    assert interleaved([at_share, just_under]) == ["edge", "under"]
    assert interleaved([("a", 5.0, 0.0), ("b", 50.0, 0.0), ("c", 20.0, 0.0)]) == ["b", "c", "a"]
    assert interleaved([]) == []
