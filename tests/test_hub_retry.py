"""The Hub client's retries: Retry-After honoured (never sooner, never past the time left), and the hint naming
the cause (rate limit, unreachable, auth). Real HTTP against the local Hub server (tests/hubserver.py)."""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import pytest
from fakes import SleepClock

from guard.errors import PushFailedError
from guard.secure.hubhttp import cause_hint, failure_cause, parse_retry_after
from guard.secure.securer import Securer
from tests.hubserver import TOKENS, HubServer, client_constants

pytest.importorskip("huggingface_hub")
from huggingface_hub import HfApi


@pytest.fixture(scope="module")
def hub():
    with client_constants(), HubServer() as server:
        yield server


@pytest.fixture(autouse=True)
def _clean(hub):
    yield
    hub.reset_faults()


@pytest.fixture
def api(hub):
    return HfApi(endpoint=hub.url, token=TOKENS["write"])


def checkpoint(root: Path, step: int) -> Path:
    folder = root / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"step": step}))
    (folder / "model.safetensors").write_bytes(os.urandom(64 * 1024))
    return folder


def test_retry_after_is_parsed_as_seconds_or_an_http_date() -> None:
    assert parse_retry_after("271") == 271.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now_epoch_s=1445412470.0) == 10.0
    assert parse_retry_after("soon") is None and parse_retry_after(None) is None


def test_causes_and_their_hints() -> None:
    assert failure_cause("#1 HTTP 429 on POST /api/models/a/b/commit/main (Retry-After 271s)") == "rate_limit"
    assert failure_cause("HTTP 401: Invalid credentials") == "auth"
    assert failure_cause("#2 ConnectError on GET /api/whoami-v2: [Errno -2] Name or service not known") == \
        "unreachable"
    assert "--push-interval" in (cause_hint("rate_limit", retry_after=271) or "")
    assert "271s" in (cause_hint("rate_limit", retry_after=271) or "")
    assert "HF_ENDPOINT" in (cause_hint("unreachable") or "")


@pytest.mark.hub
def test_a_429_with_retry_after_is_waited_out_before_the_next_commit(hub, api, tmp_path) -> None:
    repo_id = f"alice/run-{uuid.uuid4().hex[:8]}"
    hub.inject(status=429, count=2, path_contains="/commit/", headers={"Retry-After": "7"})
    clock = SleepClock()
    hub.requests.clear()
    result = Securer(repo_id, api=api, clock=clock, sleep=clock.sleep).push_checkpoint(
        checkpoint(tmp_path, 3), step=3, deadline=clock() + 120)
    assert result.attempts == 3
    assert clock.sleeps == [7.0, 7.0]  # the Hub's wait, not the 1 s / 2 s backoff
    assert result.elapsed_s == 14.0 and result.attempt_s == 0.0  # the waits are the push's time, not its attempt's
    # the checkpoint's commit after two 429s, then the resume record written once every file verified
    assert [r.status for r in hub.requests if "/commit/" in r.path] == [429, 429, 200, 200]


@pytest.mark.hub
def test_a_retry_after_longer_than_the_time_left_stops_at_once_and_names_the_rate_limit(hub, api, tmp_path) -> None:
    repo_id = f"alice/run-{uuid.uuid4().hex[:8]}"
    hub.inject(status=429, count=None, path_contains="/commit/", headers={"Retry-After": "271"})
    clock = SleepClock()
    hub.requests.clear()
    with pytest.raises(PushFailedError) as info:
        Securer(repo_id, api=api, clock=clock, sleep=clock.sleep).push_checkpoint(
            checkpoint(tmp_path, 3), step=3, deadline=clock() + 60)
    assert [r.status for r in hub.requests if "/commit/" in r.path] == [429]  # one commit, no storm
    assert clock.sleeps == []
    assert "271s (Retry-After)" in info.value.message
    assert "rate-limiting" in (info.value.hint or "") and "--push-interval" in (info.value.hint or "")


@pytest.mark.hub
def test_an_unreachable_hub_is_named_in_the_hint(hub, api, tmp_path) -> None:
    repo_id = f"alice/run-{uuid.uuid4().hex[:8]}"
    hub.set_down(True)
    clock = SleepClock()
    started = time.monotonic()
    with pytest.raises(PushFailedError) as info:
        Securer(repo_id, api=api, clock=clock, sleep=clock.sleep).push_checkpoint(
            checkpoint(tmp_path, 3), step=3, deadline=clock() + 20)
    assert "could not be reached" in (info.value.hint or ""), info.value.message
    assert time.monotonic() - started < 60


@pytest.mark.hub
def test_a_hub_without_xet_storage_is_named_in_the_hint_with_HF_HUB_DISABLE_XET(hub, api, tmp_path) -> None:
    # hf_xet is used whatever the Hub says; a Hub without Xet answers its token route 404 (huggingface_hub #4507)
    hub.xet = False
    try:
        with pytest.raises(PushFailedError) as info:
            Securer(f"alice/run-{uuid.uuid4().hex[:8]}", api=api).push_checkpoint(
                checkpoint(tmp_path, 3), step=3, deadline=time.monotonic() + 60)
    finally:
        hub.xet = True
    assert "HF_HUB_DISABLE_XET=1" in (info.value.hint or ""), (info.value.message, info.value.hint)
    assert info.value.attempts == 1  # no retry: the same request would get the same answer


@pytest.mark.hub
def test_a_commit_that_never_answers_is_logged_as_no_progress_and_retried(hub, api, tmp_path, monkeypatch,
                                                                          caplog) -> None:
    from guard.secure import hubhttp

    monkeypatch.setitem(hubhttp.REQUEST_TIMEOUTS_S, "read", 2.0)
    repo_id = f"alice/run-{uuid.uuid4().hex[:8]}"
    hub.inject(latency_s=600, count=1, path_contains="/commit/", methods=("POST",))
    clock = SleepClock()
    started = time.monotonic()
    with caplog.at_level("WARNING", logger="guard.secure.securer"):
        result = Securer(repo_id, api=api, clock=clock, sleep=clock.sleep).push_checkpoint(
            checkpoint(tmp_path, 3), step=3, deadline=clock() + 120)
    assert result.attempts == 2
    assert any("no progress for 2s on POST" in r.getMessage() for r in caplog.records), caplog.text
    assert time.monotonic() - started < 30


def test_the_throughput_learns_from_the_successful_attempt_alone() -> None:
    from guard.secure.securer import PushResult
    from guard.secure.worker import WorkResult

    result = PushResult("hf://a/b", "0" * 40, ("model.safetensors",), 100_000_000, 290.0, 3, 7, attempt_s=10.0)
    assert result.bytes_per_s == 10_000_000  # not 100 MB over the 290 s that include a 271 s Retry-After wait
    work = WorkResult("push_checkpoint", True, {"attempt_s": 10.0, "size_bytes": 100_000_000}, None, None, None,
                      290.0)
    assert work.transfer_s == 10.0
    assert WorkResult("push_checkpoint", True, {}, None, None, None, 290.0).transfer_s == 290.0
