"""``guard.run.ranks.RankWatch`` with plain numbers for the clock."""

from __future__ import annotations

import math

from guard.run.ranks import RankWatch


def test_the_primary_rank_is_the_lowest_seen_not_the_first() -> None:
    ranks = RankWatch(stall_timeout_s=60)
    assert ranks.primary is None
    assert ranks.on_step(1, 1, now=0.0)  # alone so far: rank 1 stands for the job
    assert ranks.on_step(0, 1, now=0.1)  # rank 0 arrives: it is primary from now on
    assert ranks.primary == 0
    assert not ranks.on_step(1, 2, now=1.0)
    assert ranks.on_step(0, 2, now=1.1)
    assert not ranks.on_step(3, 2, now=1.2)


def test_a_rank_silent_while_others_go_on_is_stalled() -> None:
    ranks = RankWatch(stall_timeout_s=10)
    for rank in (0, 1):
        ranks.on_step(rank, 1, now=0.0)
    assert ranks.due_at() == 10.0
    for t in range(1, 12):  # rank 1 stops; rank 0 goes on
        ranks.on_step(0, 1 + t, now=float(t))
        assert ranks.stalled_rank(float(t)) is (1 if t >= 10 else None), t
    assert ranks.silent_for_s(1, 11.0) == 11.0


def test_all_ranks_silent_together_is_left_to_the_job_wide_watch() -> None:
    ranks = RankWatch(stall_timeout_s=10)
    for rank in (0, 1, 2):
        ranks.on_step(rank, 5, now=0.0)
    assert ranks.stalled_rank(100.0) is None


def test_the_longest_silent_rank_is_named() -> None:
    ranks = RankWatch(stall_timeout_s=10)
    ranks.on_step(2, 1, now=0.0)
    ranks.on_step(1, 1, now=3.0)
    ranks.on_step(0, 1, now=14.0)
    assert ranks.stalled_rank(14.0) == 2
    assert ranks.due_at() == 10.0


def test_a_finished_rank_and_a_paused_watch_are_not_stalled() -> None:
    ranks = RankWatch(stall_timeout_s=10)
    ranks.on_step(0, 1, now=0.0)
    ranks.on_step(1, 1, now=0.0)
    ranks.finished(1)
    ranks.on_step(0, 2, now=20.0)
    assert ranks.stalled_rank(20.0) is None and ranks.due_at() == math.inf
    ranks.on_step(1, 2, now=20.0)
    ranks.pause()
    assert ranks.stalled_rank(100.0) is None and ranks.due_at() == math.inf


def test_a_step_without_number_counts_on() -> None:
    ranks = RankWatch(stall_timeout_s=10)
    ranks.on_step(0, None, now=0.0)
    ranks.on_step(0, None, now=1.0)
    assert ranks.last_step[0] == (2, 1.0)


def test_progress_without_a_step_keeps_a_rank_alive() -> None:
    ranks = RankWatch(stall_timeout_s=10)
    ranks.on_step(0, 5, now=0.0)
    ranks.on_step(1, 5, now=0.0)
    ranks.on_step(0, 9, now=12.0)
    ranks.alive(1, now=12.0)  # CUDA-graph replays
    assert ranks.stalled_rank(12.0) is None
    assert ranks.last_step[1] == (5, 12.0)
