"""Deadline sources and priority, Slurm refresh, margin estimation, and the checkpoint plan (injected clocks)."""

from __future__ import annotations

import logging
import subprocess
import time
from types import SimpleNamespace

import psutil
import pytest

from guard.core.durations import format_size, parse_size
from guard.errors import BudgetError, UsageError
from guard.run.slurm import SlurmRefresher, parse_scontrol_job, parse_slurm_duration_s
from guard.secure.budget import (
    CLOCK_SKEW_S,
    Deadline,
    MarginEstimator,
    checkpoint_due,
    format_duration_s,
    parse_started_at,
    resolve_deadline,
)

NOW = 1_787_236_200.0  # 2026-08-20T14:30:00Z
HOUR = 3600.0
DAY = 86400.0


@pytest.fixture
def tz_plus2(monkeypatch):
    """Local time = UTC+2 (POSIX TZ string, no tz database needed)."""
    monkeypatch.setenv("TZ", "XYZ-2")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


# ---------------------------------------------------------------------------------------------------------------
# --started-at
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1787236200", NOW),
        ("1787236200.5", NOW + 0.5),
        ("2026-08-20T14:30:00Z", NOW),
        ("2026-08-20T16:30:00+02:00", NOW),
        ("2026-08-20T14:30:00", NOW),  # naive = UTC
        ("2026-08-20 14:30:00", NOW),
        (" 1787236200 ", NOW),
    ],
)
def test_parse_started_at_accepts_epoch_and_iso(text, expected):
    assert parse_started_at(text) == pytest.approx(expected)


def test_parse_started_at_naive_is_utc_whatever_the_local_zone(tz_plus2):
    assert parse_started_at("2026-08-20T14:30:00") == NOW


@pytest.mark.parametrize("text", ["banana", "", "2026-13-45", "-5", "1787236200000"])
def test_parse_started_at_rejects_with_the_option_and_the_forms(text):
    with pytest.raises(UsageError) as info:
        parse_started_at(text, option="GUARD_STARTED_AT")
    assert info.value.option == "GUARD_STARTED_AT"
    assert "GUARD_STARTED_AT" in info.value.message
    assert "epoch seconds" in info.value.hint and "ISO 8601" in info.value.hint


# ---------------------------------------------------------------------------------------------------------------
# resolve_deadline: sources and priority
# ---------------------------------------------------------------------------------------------------------------


def test_explicit_timeout_counts_from_started_at_first():
    env = {"SLURM_JOB_START_TIME": str(int(NOW - 500)), "SLURM_JOB_END_TIME": str(int(NOW + 10 * HOUR))}
    deadline = resolve_deadline(timeout_s=2 * HOUR, started_at_s=NOW - 100, environ=env, platform="hf_jobs",
                                now_s=NOW, pid1_start_s=NOW - 900)
    assert deadline.deadline_s == NOW - 100 + 2 * HOUR
    assert deadline.started_at_s == NOW - 100
    assert deadline.timeout_s == 2 * HOUR
    assert deadline.source == "--timeout 2h from --started-at"
    assert deadline.remaining_s(NOW) == 2 * HOUR - 100


def test_explicit_timeout_counts_from_slurm_start_without_started_at():
    env = {"SLURM_JOB_START_TIME": str(int(NOW - 500))}
    deadline = resolve_deadline(timeout_s=HOUR, timeout_source="GUARD_TIMEOUT", environ=env, now_s=NOW)
    assert deadline.deadline_s == NOW - 500 + HOUR
    assert deadline.source == "GUARD_TIMEOUT 1h from SLURM_JOB_START_TIME"


def test_explicit_timeout_on_hf_jobs_counts_from_pid1():
    deadline = resolve_deadline(timeout_s=1800, environ={}, platform="hf_jobs", now_s=NOW, pid1_start_s=NOW - 120)
    assert deadline.deadline_s == NOW - 120 + 1800
    assert deadline.source == "--timeout 30m from container start (PID 1)"


def test_hf_jobs_platform_may_be_an_enum():
    platform = SimpleNamespace(value="hf-jobs")
    deadline = resolve_deadline(timeout_s=1800, environ={}, platform=platform, now_s=NOW, pid1_start_s=NOW - 60)
    assert deadline.started_at_s == NOW - 60


def test_hf_jobs_platform_from_detect():
    from guard.run.platform import detect

    platform = detect({"JOB_ID": "699d874f1aad19adb8aaeadc", "CPU_CORES": "8", "MEMORY": "32Gi"})
    deadline = resolve_deadline(timeout_s=1800, environ={}, platform=platform, now_s=NOW, pid1_start_s=NOW - 60)
    assert deadline.source == "--timeout 30m from container start (PID 1)"


def test_pid1_is_ignored_off_hf_jobs():
    deadline = resolve_deadline(timeout_s=1800, environ={}, platform="local", now_s=NOW, pid1_start_s=NOW - 120)
    assert deadline.started_at_s == NOW
    assert deadline.source == "--timeout 30m from guard start"


def test_pid1_older_than_the_whole_budget_is_not_the_container(caplog):
    with caplog.at_level(logging.WARNING, logger="guard.budget"):
        deadline = resolve_deadline(timeout_s=1800, environ={}, platform="hf_jobs", now_s=NOW,
                                    pid1_start_s=NOW - 40 * DAY)
    assert deadline.started_at_s == NOW
    assert "not the container's start" in caplog.text


def test_pid1_unreadable_falls_back_to_guard_start(monkeypatch):
    def denied(pid):
        raise psutil.AccessDenied(pid)

    monkeypatch.setattr(psutil, "Process", denied)
    deadline = resolve_deadline(timeout_s=1800, environ={}, platform="hf_jobs", now_s=NOW)
    assert deadline.started_at_s == NOW
    assert deadline.source.endswith("from guard start")


def test_pid1_read_with_psutil_by_default(monkeypatch):
    monkeypatch.setattr(psutil, "Process", lambda pid: SimpleNamespace(create_time=lambda: NOW - 77.0))
    deadline = resolve_deadline(timeout_s=1800, environ={}, platform="hf_jobs", now_s=NOW)
    assert deadline.started_at_s == NOW - 77.0


def test_explicit_timeout_alone_counts_from_now():
    deadline = resolve_deadline(timeout_s=5400, environ={}, now_s=NOW)
    assert deadline.deadline_s == NOW + 5400
    assert deadline.source == "--timeout 1h30m from guard start"


def test_slurm_end_earlier_than_explicit_timeout_wins(caplog):
    env = {"SLURM_JOB_START_TIME": str(int(NOW - 100)), "SLURM_JOB_END_TIME": str(int(NOW + HOUR))}
    with caplog.at_level(logging.WARNING, logger="guard.budget"):
        deadline = resolve_deadline(timeout_s=4 * HOUR, environ=env, now_s=NOW)
    assert deadline.deadline_s == NOW + HOUR
    assert deadline.explicit_deadline_s == NOW - 100 + 4 * HOUR
    assert deadline.source.startswith("SLURM_JOB_END_TIME (before --timeout 4h")
    assert "using SLURM_JOB_END_TIME" in caplog.text


def test_explicit_timeout_shorter_than_slurm_wins():
    env = {"SLURM_JOB_START_TIME": str(int(NOW - 100)), "SLURM_JOB_END_TIME": str(int(NOW + 10 * HOUR))}
    deadline = resolve_deadline(timeout_s=HOUR, environ=env, now_s=NOW)
    assert deadline.deadline_s == NOW - 100 + HOUR


def test_slurm_end_time_without_timeout():
    env = {"SLURM_JOB_START_TIME": str(int(NOW - 100)), "SLURM_JOB_END_TIME": str(int(NOW + HOUR))}
    deadline = resolve_deadline(timeout_s=None, environ=env, now_s=NOW)
    assert deadline.deadline_s == NOW + HOUR
    assert deadline.started_at_s == NOW - 100
    assert deadline.timeout_s == HOUR + 100
    assert deadline.source == "SLURM_JOB_END_TIME"


def test_slurm_unlimited_means_no_deadline():
    env = {"SLURM_JOB_START_TIME": str(int(NOW - 100)), "SLURM_JOB_END_TIME": str(int(NOW - 100 + 365 * DAY))}
    deadline = resolve_deadline(timeout_s=None, environ=env, now_s=NOW)
    assert deadline.deadline_s is None and deadline.timeout_s is None
    assert deadline.remaining_s(NOW) is None


def test_slurm_just_under_a_year_is_a_limit():
    env = {"SLURM_JOB_START_TIME": str(int(NOW)), "SLURM_JOB_END_TIME": str(int(NOW + 363 * DAY))}
    assert resolve_deadline(timeout_s=None, environ=env, now_s=NOW).deadline_s == NOW + 363 * DAY


def test_no_source_means_no_deadline():
    deadline = resolve_deadline(timeout_s=None, environ={}, now_s=NOW)
    assert deadline.deadline_s is None
    assert deadline.started_at_s == NOW
    assert deadline.source.startswith("none")


@pytest.mark.parametrize("name", ["SLURM_JOB_END_TIME", "SLURM_JOB_START_TIME"])
@pytest.mark.parametrize("value", ["tomorrow", "-5", "1.5e9", "12:00"])
def test_malformed_slurm_variable_is_a_budget_error(name, value):
    with pytest.raises(BudgetError) as info:
        resolve_deadline(timeout_s=None, environ={name: value}, now_s=NOW)
    assert name in info.value.message
    assert name in info.value.hint


def test_slurm_end_before_start_is_a_budget_error():
    env = {"SLURM_JOB_START_TIME": str(int(NOW)), "SLURM_JOB_END_TIME": str(int(NOW - 10))}
    with pytest.raises(BudgetError):
        resolve_deadline(timeout_s=None, environ=env, now_s=NOW)


def test_start_in_the_future_is_a_budget_error_beyond_clock_skew():
    resolve_deadline(timeout_s=HOUR, started_at_s=NOW + CLOCK_SKEW_S - 1, environ={}, now_s=NOW)
    with pytest.raises(BudgetError) as info:
        resolve_deadline(timeout_s=HOUR, started_at_s=NOW + 3600, environ={}, now_s=NOW)
    assert "future" in info.value.message and "clock" in info.value.hint
    with pytest.raises(BudgetError):
        resolve_deadline(timeout_s=None, environ={"SLURM_JOB_START_TIME": str(int(NOW + 600))}, now_s=NOW)


@pytest.mark.parametrize("timeout_s", [0, -1, float("nan"), float("inf")])
def test_non_positive_timeout_is_a_budget_error(timeout_s):
    with pytest.raises(BudgetError):
        resolve_deadline(timeout_s=timeout_s, environ={}, now_s=NOW)


def test_refreshed_moves_a_slurm_deadline_both_ways():
    deadline = Deadline(NOW, HOUR, NOW + HOUR, "SLURM_JOB_END_TIME")
    later = deadline.refreshed(NOW + 2 * HOUR, "scontrol EndTime")
    assert later.deadline_s == NOW + 2 * HOUR and later.timeout_s == 2 * HOUR and later.source == "scontrol EndTime"
    assert deadline.refreshed(NOW + 600, "scontrol EndTime").deadline_s == NOW + 600
    assert deadline.refreshed(None, "scontrol EndTime") is deadline


def test_refreshed_never_passes_the_explicit_timeout():
    deadline = Deadline(NOW, HOUR, NOW + HOUR, "--timeout 1h from guard start", explicit_deadline_s=NOW + HOUR)
    assert deadline.refreshed(NOW + 5 * HOUR, "scontrol EndTime") is deadline
    shorter = deadline.refreshed(NOW + 600, "scontrol EndTime")
    assert shorter.deadline_s == NOW + 600
    back = shorter.refreshed(NOW + 5 * HOUR, "scontrol EndTime")
    assert back.deadline_s == NOW + HOUR
    assert "is later" in back.source


@pytest.mark.parametrize(("seconds", "text"), [(7200, "2h"), (5400, "1h30m"), (45, "45s"), (0, "0s"),
                                                (90061, "1d1h1m1s")])
def test_format_duration(seconds, text):
    assert format_duration_s(seconds) == text


@pytest.mark.parametrize(("size_bytes", "text"), [(0, "0 B"), (812, "812 B"), (43_100, "43.1 kB"),
                                                  (999_999, "1.0 MB"), (64_000_000, "64.0 MB"),
                                                  (1_250_000_000, "1.25 GB")])
def test_format_size_reads_back(size_bytes, text):
    """A test job's checkpoint of a few kB is not '0.0 MB' (the trials' logs said 'step 6, 0.0 MB'); what it
    writes, parse_size reads back."""
    assert format_size(size_bytes) == text
    assert abs(parse_size(text.replace(" ", "")) - size_bytes) <= max(1, size_bytes * 0.001)


# ---------------------------------------------------------------------------------------------------------------
# scontrol
# ---------------------------------------------------------------------------------------------------------------

SCONTROL_EPOCH = (
    "JobId=4242 JobName=train UserId=alice(1000) GroupId=alice(1000) MCS_label=N/A Priority=1 Nice=0 "
    "Account=ml QOS=normal JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 "
    "Reboot=0 ExitCode=0:0 RunTime=00:10:00 TimeLimit=02:00:00 TimeMin=N/A SubmitTime=1787235000 "
    "EligibleTime=1787235000 AccrueTime=1787235000 StartTime=1787235600 EndTime=1787242800 Deadline=N/A "
    "Partition=gpu AllocNode:Sid=login1:123 NodeList=gpu01 NumNodes=1 NumCPUs=8 "
    "Command=/home/alice/run job.sh WorkDir=/home/alice"
)


def test_parse_scontrol_epoch_form():
    times = parse_scontrol_job(SCONTROL_EPOCH + "\n", job_id="4242")
    assert times.start_time_s == 1787235600
    assert times.end_time_s == 1787242800
    assert times.time_limit_s == 2 * HOUR
    assert times.deadline_s == 1787242800


def test_parse_scontrol_iso_form_is_local_time(tz_plus2):
    line = "JobId=7 JobState=RUNNING TimeLimit=1-00:00:00 StartTime=2026-08-20T16:30:00 EndTime=2026-08-21T16:30:00"
    times = parse_scontrol_job(line)
    assert times.start_time_s == NOW
    assert times.time_limit_s == DAY
    assert times.deadline_s == NOW + DAY


def test_parse_scontrol_unknown_end_uses_start_plus_limit():
    line = "JobId=7 TimeLimit=01:30:00 StartTime=1787236200 EndTime=Unknown"
    assert parse_scontrol_job(line).deadline_s == NOW + 5400


@pytest.mark.parametrize("limit", ["UNLIMITED", "INFINITE"])
def test_parse_scontrol_unlimited(limit):
    line = f"JobId=7 TimeLimit={limit} StartTime=1787236200 EndTime=Unknown"
    times = parse_scontrol_job(line)
    assert times.unlimited and times.deadline_s is None


def test_parse_scontrol_unlimited_by_a_year_long_end():
    line = f"JobId=7 TimeLimit=Partition_Limit StartTime=1787236200 EndTime={int(NOW + 365 * DAY)}"
    times = parse_scontrol_job(line)
    assert times.time_limit_s is None and times.deadline_s is None


def test_parse_scontrol_none_values():
    times = parse_scontrol_job("JobId=7 TimeLimit=NONE StartTime=None EndTime=None")
    assert times.deadline_s is None


def test_parse_scontrol_prefers_the_line_of_the_job():
    text = ("JobId=10 HetJobId=9 TimeLimit=00:10:00 StartTime=1787236200 EndTime=1787236800\n"
            "JobId=9 HetJobId=9 TimeLimit=01:00:00 StartTime=1787236200 EndTime=1787239800\n")
    assert parse_scontrol_job(text, job_id="9").deadline_s == 1787239800
    assert parse_scontrol_job(text).deadline_s == 1787236800


@pytest.mark.parametrize("text", ["", "slurm_load_jobs error: Invalid job id specified",
                                  "JobId=7 TimeLimit=soon EndTime=Unknown", "JobId=7 EndTime=yesterday"])
def test_parse_scontrol_rejects_garbage(text):
    with pytest.raises(ValueError):
        parse_scontrol_job(text)


@pytest.mark.parametrize(("text", "seconds"), [("30", 1800), ("5:30", 330), ("01:02:03", 3723), ("2-00", 172800),
                                               ("1-02:03", 93780), ("1-02:03:04", 93784)])
def test_parse_slurm_duration_forms(text, seconds):
    assert parse_slurm_duration_s(text) == seconds


class FakeRunner:
    """Stands in for subprocess.run: answers from a list, records every call."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.calls = []

    def __call__(self, argv, **kwargs):
        self.calls.append((argv, kwargs))
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, BaseException):
            raise answer
        return subprocess.CompletedProcess(argv, answer[0], stdout=answer[1], stderr=answer[2])


def test_refresher_runs_scontrol_with_timeout_and_epoch_format():
    runner = FakeRunner((0, SCONTROL_EPOCH, ""))
    refresher = SlurmRefresher("4242", runner=runner, call_timeout_s=5, environ={"PATH": "/usr/bin"})
    assert refresher.maybe_refresh(0.0) == 1787242800
    argv, kwargs = runner.calls[0]
    assert argv == ["scontrol", "show", "job", "-o", "4242"]
    assert kwargs["timeout"] == 5
    assert kwargs["env"]["SLURM_TIME_FORMAT"] == "%s" and kwargs["env"]["PATH"] == "/usr/bin"
    assert refresher.last_source == "scontrol EndTime"


def test_refresher_runs_at_most_once_per_interval():
    runner = FakeRunner((0, SCONTROL_EPOCH, ""))
    clock = SimpleNamespace(now=1000.0)
    refresher = SlurmRefresher("4242", runner=runner, interval_s=300, clock=lambda: clock.now)
    assert refresher.maybe_refresh() == 1787242800
    clock.now += 299
    assert refresher.maybe_refresh() is None
    assert len(runner.calls) == 1
    clock.now += 1
    assert refresher.maybe_refresh() == 1787242800
    assert len(runner.calls) == 2


def test_refresher_sees_a_moved_end_time():
    moved = SCONTROL_EPOCH.replace("EndTime=1787242800", "EndTime=1787240000")
    runner = FakeRunner((0, SCONTROL_EPOCH, ""), (0, moved, ""))
    refresher = SlurmRefresher("4242", runner=runner, interval_s=10)
    assert refresher.maybe_refresh(0) == 1787242800
    assert refresher.maybe_refresh(10) == 1787240000


def test_refresher_timeout_and_errors_are_counted_and_logged_once(caplog):
    runner = FakeRunner(subprocess.TimeoutExpired(["scontrol"], 5), (1, "", "slurm_load_jobs error: timeout\n"),
                        (0, "garbage", ""), RuntimeError("boom"), (0, SCONTROL_EPOCH, ""))
    refresher = SlurmRefresher("4242", runner=runner, interval_s=1)
    with caplog.at_level(logging.DEBUG, logger="guard.slurm"):
        results = [refresher.maybe_refresh(float(t)) for t in range(5)]
    assert results == [None, None, None, None, 1787242800]
    assert refresher.failures == 4 and refresher.calls == 5
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no answer within 5s" in warnings[0].getMessage()
    assert not refresher.disabled


def test_refresher_missing_binary_disables_it_with_one_line(caplog):
    runner = FakeRunner(FileNotFoundError("scontrol"))
    refresher = SlurmRefresher("4242", runner=runner, interval_s=1)
    with caplog.at_level(logging.INFO, logger="guard.slurm"):
        assert refresher.maybe_refresh(0) is None
        assert refresher.maybe_refresh(100) is None
    assert refresher.disabled
    assert len(runner.calls) == 1
    assert len([r for r in caplog.records if "not on PATH" in r.getMessage()]) == 1


def test_refresher_from_environ():
    assert SlurmRefresher.from_environ({}) is None
    refresher = SlurmRefresher.from_environ({"SLURM_JOB_ID": "77"}, runner=FakeRunner((0, "", "")))
    assert refresher is not None and refresher.job_id == "77"


def test_refresher_result_feeds_the_deadline():
    deadline = resolve_deadline(timeout_s=None, now_s=NOW,
                                environ={"SLURM_JOB_START_TIME": "1787235600", "SLURM_JOB_END_TIME": "1787242800"})
    moved = SCONTROL_EPOCH.replace("EndTime=1787242800", "EndTime=1787239000")
    refresher = SlurmRefresher("4242", runner=FakeRunner((0, moved, "")))
    updated = deadline.refreshed(refresher.maybe_refresh(0), refresher.last_source)
    assert updated.deadline_s == 1787239000 and updated.source == "scontrol EndTime"


# ---------------------------------------------------------------------------------------------------------------
# Margin
# ---------------------------------------------------------------------------------------------------------------


def test_margin_defaults_before_any_measurement():
    estimator = MarginEstimator()
    # 1 GB: save at 200 MB/s = 5 s, push at 20 MB/s = 50 s; (5 + 50) x 1.5 + 15 = 97.5 s
    assert estimator.expected_size_bytes == 1e9
    assert estimator.margin_s() == pytest.approx(97.5)


def test_margin_uses_the_size_hint_and_a_default_save_time():
    estimator = MarginEstimator(size_hint_bytes=200e6, default_save_s=10, floor_s=0)
    assert estimator.margin_s() == pytest.approx((10 + 10) * 1.5 + 15)


def test_margin_after_observations():
    estimator = MarginEstimator(floor_s=0)
    estimator.observe_save(4.0, 400e6)
    estimator.observe_push(400e6, 8.0)  # 50 MB/s
    estimator.observe_step(2.0)
    assert estimator.push_bytes_per_s == pytest.approx(50e6)
    assert estimator.margin_s() == pytest.approx((2 + 4 + 8) * 1.5 + 15)


def test_margin_never_under_the_floor():
    estimator = MarginEstimator(floor_s=60)
    estimator.observe_save(0.1, 1e6)
    estimator.observe_push(1e6, 0.1)
    estimate = estimator.estimate()
    assert estimate.margin_s == 60 and estimate.floored


def test_fixed_margin_ignores_measurements():
    estimator = MarginEstimator(fixed_margin_s=300)
    estimator.observe_save(100, 10e9)
    estimator.observe_push(10e9, 1000)
    assert estimator.margin_s() == 300
    assert estimator.estimate().describe() == "margin now 300s (fixed by --margin)"


def test_push_throughput_is_the_slowest_recent_push():
    estimator = MarginEstimator(history=3)
    estimator.observe_push(100e6, 1.0)  # 100 MB/s replaces the default
    estimator.observe_push(100e6, 4.0)  # 25 MB/s: adopted at once
    assert estimator.push_bytes_per_s == pytest.approx(25e6)
    estimator.observe_push(100e6, 1.0)
    estimator.observe_push(100e6, 1.0)  # still among the last 3: the slow push counts
    assert estimator.push_bytes_per_s == pytest.approx(25e6)
    estimator.observe_push(100e6, 1.0)  # the slow one left the history
    assert estimator.push_bytes_per_s == pytest.approx(100e6)


def test_a_running_push_slower_than_the_estimate_lowers_it_before_it_ends():
    estimator = MarginEstimator(floor_s=0)
    estimator.observe_push(100e6, 1.0)  # 100 MB/s
    estimator.observe_push_progress(100e6, 0.5)  # as fast as expected: no change
    assert estimator.push_bytes_per_s == pytest.approx(100e6)
    before = estimator.margin_s()
    estimator.observe_push_progress(100e6, 3.0)  # 3 s for 100 MB and not done: at most 33 MB/s
    assert estimator.push_bytes_per_s == pytest.approx(100e6 / 3)
    assert estimator.margin_s() > before
    estimator.observe_push(100e6, 3.5)  # it ended: its measured rate replaces the bound
    assert estimator.push_bytes_per_s == pytest.approx(100e6 / 3.5)


def test_save_time_is_the_max_of_recent_saves_scaled_to_size():
    estimator = MarginEstimator(history=3)
    estimator.observe_save(10.0, 1e9)
    estimator.observe_save(2.0, 1e9)
    assert estimator.save_estimate_s() == 10.0
    assert estimator.save_estimate_s(2e9) == 20.0
    for _ in range(3):
        estimator.observe_save(2.0, 1e9)
    assert estimator.save_estimate_s() == 2.0  # the slow one left the history


def test_observe_size_sets_the_expected_size():
    estimator = MarginEstimator(size_hint_bytes=5e9)
    estimator.observe_size(300e6)
    assert estimator.expected_size_bytes == 300e6


def test_bad_observations_are_ignored():
    estimator = MarginEstimator()
    before = estimator.margin_s()
    estimator.observe_push(0, 1.0)
    estimator.observe_push(1e9, float("nan"))
    estimator.observe_save(-1, 1e9)
    estimator.observe_step(float("inf"))
    assert estimator.margin_s() == before


@pytest.mark.parametrize("kwargs", [{"safety_factor": 0.5}, {"floor_s": -1}, {"default_push_bytes_per_s": 0},
                                    {"fixed_margin_s": float("nan")}])
def test_bad_settings_are_budget_errors(kwargs):
    with pytest.raises(BudgetError):
        MarginEstimator(**kwargs)


def test_margin_is_logged_when_it_changes_by_more_than_a_few_percent(caplog):
    estimator = MarginEstimator(floor_s=0)
    with caplog.at_level(logging.INFO, logger="guard.budget"):
        estimator.margin_s()
        estimator.observe_step(0.5)  # 97.5 -> 98.25: under 5 %, not logged
        estimator.observe_push(1e9, 10.0)  # 100 MB/s: 1 GB push now 10 s -> logged
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("margin now")]
    assert lines[0] == ("margin now 98s ((save 5.0s + push 50.0s of 1000 MB (a guess: no checkpoint seen yet) at "
                        "20.0 MB/s) x1.5 + 15s)")
    assert len(lines) == 2
    assert lines[1] == ("margin now 38s ((step 0.5s + save 5.0s + push 10.0s of 1000 MB (a guess: no checkpoint seen "
                        "yet) at 100.0 MB/s) x1.5 + 15s)")
    estimator.observe_size(20e6)
    assert "of 20 MB (the newest checkpoint seen on disk)" in estimator.estimate().describe()
    estimator.observe_save(0.5, 21e6)
    assert "of 21 MB (the last save)" in estimator.estimate().describe()


def test_a_capped_margin_says_so() -> None:
    estimator = MarginEstimator(floor_s=10, max_margin_s=20)
    assert estimator.margin_s() == 20
    assert estimator.estimate().describe().endswith("x1.5 + 15s, capped at half the budget (20s))")


# ---------------------------------------------------------------------------------------------------------------
# Plan
# ---------------------------------------------------------------------------------------------------------------


def test_checkpoint_due_edges():
    deadline = Deadline(NOW, HOUR, NOW + HOUR, "test")
    assert not checkpoint_due(NOW + HOUR - 100.001, deadline, 100)
    assert checkpoint_due(NOW + HOUR - 100, deadline, 100)
    assert checkpoint_due(NOW + 2 * HOUR, deadline, 100)
    assert not checkpoint_due(NOW + 10 * HOUR, Deadline(NOW, None, None, "none"), 100)




def test_a_failed_push_drops_the_bound_its_running_time_set() -> None:
    estimator = MarginEstimator(log_changes=False)
    rate = estimator.push_bytes_per_s
    estimator.observe_push_progress(1_000, 7.5)  # retries against an unreachable Hub look like a slow transfer
    assert estimator.push_bytes_per_s < rate
    estimator.discard_push_progress()  # ... until the push ends with its error
    assert estimator.push_bytes_per_s == rate


def test_a_margin_at_or_above_the_budget_is_a_usage_error() -> None:
    from guard.errors import UsageError
    from guard.run.config import resolve

    with pytest.raises(UsageError, match="--margin 2h is not less than the budget"):
        resolve({"margin": "2h", "timeout": "1h"}, {})
    with pytest.raises(UsageError, match="GUARD_MARGIN"):
        resolve({"timeout": "1h"}, {"GUARD_MARGIN": "1h"})
    values, _ = resolve({"margin": "10m", "timeout": "1h"}, {})
    assert values["margin"] == 600.0


def test_the_secure_estimate_is_what_measured_pushes_cost_not_the_guessed_overhead() -> None:
    est = MarginEstimator(log_changes=False)
    # before a measured push: the guess, 10 MB at 20 MB/s x 1.5 + 15 s of commit round trips
    assert est.secure_estimate_s(10e6) == pytest.approx(0.5 * 1.5 + 15.0)
    est.observe_push(10e6, 1.5)
    est.observe_push_cost(10e6, 2.0)  # start to verified end: the fixed costs are in it
    assert est.secure_estimate_s(10e6) == pytest.approx(2.0 * 1.5)
    assert est.secure_estimate_s(40e6) == pytest.approx(8.0 * 1.5)  # scaled up to a larger checkpoint
    assert est.secure_estimate_s(1e6) == pytest.approx(2.0 * 1.5)  # never scaled down
    est.observe_push_cost(10e6, 0.1)
    assert est.secure_estimate_s(10e6) == pytest.approx(3.0)  # the slowest recent push


def test_the_measured_secure_estimate_is_bounded() -> None:
    from guard.secure.budget import MIN_PUSH_COST_S

    est = MarginEstimator(log_changes=False)
    est.observe_push(10e6, 0.01)
    est.observe_push_cost(10e6, 0.02)
    assert est.secure_estimate_s(10e6) == pytest.approx(MIN_PUSH_COST_S)  # one fast sample is no promise
    est = MarginEstimator(log_changes=False)
    est.observe_push(1e6, 0.1)
    est.observe_push_cost(1e6, 30.0)  # a tiny push that waited long: never above the guess (1000 MB at 10 MB/s)
    assert est.secure_estimate_s(1e9) == pytest.approx(1e9 / 10e6 * 1.5 + 15.0)
    est.observe_push_progress(1e9, 400.0)  # a push running slower than measured raises the bound too
    assert est.secure_estimate_s(1e9) == pytest.approx(400.0 * 1.5 + 15.0)
    est = MarginEstimator(log_changes=False)
    est.observe_push(10e6, 1.0)
    est.observe_push_cost(10e6, 1.0)
    est.observe_push_progress(10e6, 4.0)  # still running after 4 s: at least 4 s x 1.5 now
    assert est.secure_estimate_s(10e6) == pytest.approx(4.0 * 1.5)
