"""The limit found through Slurm is the budget everywhere: exact end times, the margin's caps and floor, the
preflight rows (no cluster needed; the real cluster's tests are in test_slurm_e2e.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from guard.preflight import PreflightOptions
from guard.preflight.misc import check_distributed
from guard.secure.budget import Deadline, MarginEstimator, margin_bounds, resolve_deadline

NOW = 1_787_236_200.0
HOUR = 3600.0


def test_the_exact_sources_are_marked_exact() -> None:
    assert resolve_deadline(timeout_s=HOUR, started_at_s=NOW - 10, now_s=NOW).exact
    assert resolve_deadline(timeout_s=None, environ={"SLURM_JOB_START_TIME": str(int(NOW - 5)),
                                                    "SLURM_JOB_END_TIME": str(int(NOW + 55))}, now_s=NOW).exact
    assert resolve_deadline(timeout_s=HOUR, environ={"SLURM_JOB_START_TIME": str(int(NOW - 5))}, now_s=NOW).exact
    # counted from the guard's own start: known to about a minute only
    assert not resolve_deadline(timeout_s=HOUR, now_s=NOW).exact
    # scontrol's EndTime (a refresh) is exact; an earlier --timeout from the guard's start stays inexact
    assert Deadline(NOW, None, None, "none").refreshed(NOW + 60, "scontrol EndTime").exact
    explicit = resolve_deadline(timeout_s=60, now_s=NOW)
    assert not explicit.refreshed(NOW + HOUR, "scontrol EndTime").exact


def test_margin_bounds_are_the_same_for_every_source_and_an_exact_end_has_no_floor() -> None:
    slurm = Deadline(NOW, 60.0, NOW + 60, "scontrol EndTime", exact=True)
    flag = Deadline(NOW, 60.0, NOW + 60, "--timeout 1m from guard start")
    assert margin_bounds(slurm) == (0.0, 30.0)  # capped at half the budget, no floor
    assert margin_bounds(flag) == (15.0, 30.0)  # the floor scaled to a quarter of a short budget
    assert margin_bounds(Deadline(NOW, 4 * HOUR, NOW + 4 * HOUR, "--timeout 4h")) == (60.0, 2 * HOUR)
    assert margin_bounds(Deadline(NOW, None, None, "none")) == (60.0, None)


def test_a_short_slurm_limit_gets_a_short_margin_once_the_saves_are_measured() -> None:
    # --time=1 with a 0.4 MB checkpoint pushed in 0.2 s: the margin is the measured times, not 60 s or 98 s.
    floor_s, cap_s = margin_bounds(Deadline(NOW, 60.0, NOW + 60, "scontrol EndTime", exact=True))
    estimator = MarginEstimator(floor_s=floor_s, max_margin_s=cap_s)
    assert estimator.margin_s() == 30.0  # the defaults (1 GB at 20 MB/s) are capped at half the budget
    estimator.observe_save(0.1, 0.4e6)
    estimator.observe_push(0.4e6, 0.2)
    assert estimator.margin_s() == pytest.approx((0.1 + 0.2) * 1.5 + 15, abs=0.5)


def test_a_single_slurm_task_says_nothing_about_a_launcher() -> None:
    plain = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NODEID": "0"}  # sbatch without -n: no SLURM_NTASKS
    rows = check_distributed(PreflightOptions(platform="slurm"), environ=plain, gpus=None)
    assert [r.status for r in rows] == ["n/a"] and "launcher" not in rows[0].seen
    assert "one Slurm task" in rows[0].seen
    rows = check_distributed(PreflightOptions(platform="torchrun"), environ={}, gpus=None)
    assert "Slurm" not in rows[0].seen  # not under Slurm: nothing said about Slurm tasks
    two = {**plain, "SLURM_NTASKS": "2"}
    rows = check_distributed(PreflightOptions(platform="slurm"), environ=two, gpus=None)
    assert rows[0].status == "pass" and "world size 2" in rows[0].seen


def test_preflight_reports_the_limit_scontrol_gives(tmp_path: Path) -> None:
    # Slurm 22.05 sets no SLURM_JOB_END_TIME: the budget row reports scontrol's EndTime (a stand-in scontrol here;
    # test_slurm_e2e.py checks the real one).
    import time

    from conftest import JOBS, run_guard

    start, end = int(time.time()) - 3, int(time.time()) + 57
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(f"#!/bin/sh\necho 'JobId=99 JobName=x TimeLimit=00:01:00 StartTime={start} EndTime={end}'\n")
    scontrol.chmod(0o755)
    env = {"PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "99", "SLURM_PROCID": "0"}
    run = run_guard(["preflight", "--skip-check", "python=not this test's subject", str(JOBS / "plain_loop.py")],
                    env=env, timeout_s=60)
    budget_rows = [line for line in run.stderr.splitlines() if " budget " in line]
    assert any("pass" in line and "timeout 1m (from scontrol EndTime)" in line for line in budget_rows), run.stderr
    assert not any("no timeout known" in line for line in budget_rows)
    distributed = [line for line in run.stderr.splitlines() if " distributed " in line]
    assert distributed and not any("launcher detected" in line for line in distributed), distributed


def test_a_timeout_counts_from_slurms_start_time_the_same_on_every_node(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # Slurm 22.05 gives no SLURM_JOB_START_TIME: --timeout counts from scontrol's StartTime, which every node's guard
    # reads alike, not from each guard's own start (a stand-in scontrol here).
    import time

    from guard.run.cli import build_config
    from guard.run.platform import detect
    from guard.run.stages import resolve_budget

    start, end = int(time.time()) - 40, int(time.time()) + 3600
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(f"#!/bin/sh\necho 'JobId=99 JobName=x TimeLimit=01:00:40 StartTime={start} EndTime={end}'\n")
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    env = {"PATH": os.environ["PATH"], "SLURM_JOB_ID": "99", "SLURM_PROCID": "0", "SLURM_NODEID": "1"}
    config = build_config(["--timeout", "10m", "--", "true"], env)
    deadline = resolve_budget(config, detect(env))
    assert (deadline.started_at_s, deadline.deadline_s) == (start, start + 600), deadline
    assert deadline.source == "--timeout 10m from scontrol StartTime" and deadline.exact
    given = build_config(["--timeout", "10m", "--started-at", str(start + 5), "--", "true"], env)
    assert resolve_budget(given, detect(env)).deadline_s == start + 605  # --started-at stays the user's word
