"""The cross-node relay of a checkpoint request (``guard.inside.agent._dist``) with a stand-in for the job's store:
node 0's rank 0 publishes its guard's requests, a rank of another node publishes one its guard sent for a signal
there, and a rank that adopts such a request tells its own guard (``relayed``)."""

from __future__ import annotations

import json
import signal
import sys
import time
from typing import Any

from guard.contract import RunResult
from guard.inside.agent._dist import RUN_ID_KEY, DistRelay
from guard.protocol import ENV_RUN_ID
from guard.run.relay import agree_on_missing, relayed_signal
from guard.secure.outcome import missing_said


class Store:
    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def check(self, keys: list[str]) -> bool:
        return all(key in self.data for key in keys)

    def get(self, key: str) -> bytes:
        return self.data[key]


class Agent:
    def __init__(self) -> None:
        self.checkpoint_request: dict[str, Any] | None = None
        self.sent: list[dict[str, Any]] = []

    def send(self, message: dict[str, Any]) -> bool:
        self.sent.append(message)
        return True

    def warn(self, text: str) -> None:
        raise AssertionError(text)


def relay(store: Store, rank: int) -> tuple[DistRelay, Agent]:
    agent = Agent()
    dist = DistRelay(agent)
    dist.store, dist.rank, dist.probed = store, rank, True
    return dist, agent


def published(store: Store, timeout_s: float = 10.0) -> dict[str, Any]:
    end = time.monotonic() + timeout_s
    while not store.data and time.monotonic() < end:
        time.sleep(0.01)  # the write runs on the relay's own thread
    return json.loads(next(iter(store.data.values())))


def test_only_rank_0_publishes_node_0s_requests() -> None:
    store = Store()
    relay(store, 1)[0].publish({"t": "checkpoint", "stop": True, "at_step": 12})
    time.sleep(0.2)
    assert store.data == {}
    relay(store, 0)[0].publish({"t": "checkpoint", "stop": True, "at_step": 12})
    assert published(store)["at_step"] == 12


def test_a_signal_on_another_node_reaches_every_rank_and_their_guards() -> None:
    store = Store()
    sender, _ = relay(store, 3)  # node 1's first rank, whose guard got SIGTERM
    request = {"t": "checkpoint", "stop": True, "at_step": 24, "origin": 1, "signal": "SIGTERM"}
    sender.handled.add((24, True))  # as the agent marks a request its own guard sent
    sender.publish(request)
    assert published(store) == request
    receiver, agent = relay(store, 0)  # node 0's rank 0 polls the store
    receiver.poll(count=10, every=10)
    assert agent.checkpoint_request == request
    assert agent.sent == [{"t": "relayed", "signal": "SIGTERM", "origin": 1, "at_step": 24}]
    receiver.next_poll = 0
    receiver.poll(count=20, every=10)
    assert len(agent.sent) == 1  # adopted once
    assert relayed_signal(agent.sent[0]) == signal.SIGTERM and relayed_signal({"signal": "SIGNOPE"}) is None


def _stopped(missing: str | None, step: int | None, secured_step: int | None) -> RunResult:
    hint = "the next run resumes from step 600: jobguard --resume on --push-to DEST ..."
    extra: dict[str, Any] = {"secured": "yes" if secured_step is not None else "no"}
    details: dict[str, Any] = {}
    if secured_step is not None:
        extra["secured_step"] = secured_step
    if missing is not None:
        extra["missing"] = missing
        details["missing"] = {"step": step, "what": missing, "error": "not whole"}
        hint = f"{missing_said(step, missing)}; {hint}"
    return RunResult("TIMEOUT", "deadline", 75, 30.0, hint=hint, extra=extra, details=details)


def test_missing_is_what_the_destination_holds_of_the_newest_step_not_this_nodes_last_push() -> None:
    # node 0's own push of step 620 ended for want of node 1's part; node 1 then put its part of step 640 alone
    result = _stopped("node1", 620, 600)
    newest = {"step": 640, "complete": False, "missing": "node0", "present": [1], "missing_files": []}
    agree_on_missing(result, read=lambda deadline: newest, wait_s=5.0)
    assert result.extra["missing"] == "node0" and result.details["missing"]["step"] == 640
    assert result.hint is not None and result.hint.startswith(missing_said(640, "node0"))
    assert "step 620" not in result.hint and result.hint.endswith("jobguard --resume on --push-to DEST ...")


def test_nothing_is_missing_when_the_newest_step_is_whole_or_secured() -> None:
    for newest in ({"step": 640, "complete": True, "missing": "", "present": [0, 1]},
                   {"step": 600, "complete": False, "missing": "node1", "present": [0]}, None):
        result = _stopped("node1", 620, 600)
        agree_on_missing(result, read=lambda deadline, found=newest: found, wait_s=5.0)
        assert "missing" not in result.extra and "missing" not in result.details, newest
        assert result.hint == "the next run resumes from step 600: jobguard --resume on --push-to DEST ...", newest


def test_an_unreadable_destination_leaves_this_nodes_word() -> None:
    def fails(deadline: float) -> dict[str, Any] | None:
        raise OSError("stale file handle")

    for read in (fails, lambda deadline: time.sleep(2.0)):
        result = _stopped("node1", 620, 600)
        agree_on_missing(result, read=read, wait_s=0.2)
        assert result.extra["missing"] == "node1" and result.details["missing"]["step"] == 620


def test_node_0s_run_id_reaches_the_other_nodes_guards_through_the_store(monkeypatch: Any) -> None:
    """Without a run id every node shares (plain torchrun), global rank 0 puts node 0's guard's in the job's store
    when it finds it, and a rank of another node tells its own guard once (``run_id``); a rank whose guard already
    has that id says nothing."""
    import types

    store = Store()
    c10d = types.SimpleNamespace(_get_default_store=lambda: store)
    fake = types.SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True, get_rank=lambda: 0,
                                 get_world_size=lambda: 2, distributed_c10d=c10d)
    monkeypatch.setitem(sys.modules, "torch.distributed", fake)
    monkeypatch.setenv(ENV_RUN_ID, "node0id")
    rank_0 = DistRelay(Agent())
    rank_0.probe()
    end = time.monotonic() + 10
    while RUN_ID_KEY not in store.data and time.monotonic() < end:
        time.sleep(0.01)  # the write runs on the relay's own thread
    assert json.loads(store.data[RUN_ID_KEY]) == {"run_id": "node0id"}
    monkeypatch.setenv(ENV_RUN_ID, "node1id")
    other, agent = relay(store, 1)
    other.poll(0, 1)
    other.poll(1, 1)
    assert [m for m in agent.sent if m["t"] == "run_id"] == [{"t": "run_id", "run_id": "node0id", "origin": 0}]
    monkeypatch.setenv(ENV_RUN_ID, "node0id")
    same, agent = relay(store, 1)
    same.poll(0, 1)
    assert agent.sent == [] and same.run_id_read


def test_a_rank_that_polled_before_rank_0_put_the_run_id_reads_it_at_the_next_step_and_before_a_save(
        monkeypatch: Any) -> None:
    """A short job (a Trainer of 6 steps, --check-every 10) polled once, before rank 0 had put the run id, and
    never again: its node's part went under its own run id. Now a rank looks at every step of its first
    ``RUN_ID_EVERY_STEP_UNTIL``, and at a save (``learn_run_id``), whatever ``check_every``."""
    monkeypatch.setenv(ENV_RUN_ID, "node1id")
    store = Store()
    other, agent = relay(store, 1)
    other.poll(1, 10)  # rank 0 has not put it yet
    assert not other.run_id_read and agent.sent == []
    store.set(RUN_ID_KEY, json.dumps({"run_id": "node0id"}))
    other.poll(2, 10)  # inside the check_every window
    assert agent.sent == [{"t": "run_id", "run_id": "node0id", "origin": 0}] and other.run_id_read
    late, agent = relay(Store(), 1)
    late.poll(1, 10)
    late.store.set(RUN_ID_KEY, json.dumps({"run_id": "node0id"}))
    late.learn_run_id()  # the job saves before its next poll
    assert agent.sent == [{"t": "run_id", "run_id": "node0id", "origin": 0}]
    late.learn_run_id()  # read once
    assert len(agent.sent) == 1


def test_a_part_node_0_never_put_stays_missing_when_the_destination_holds_an_older_step_whole() -> None:
    """Node 0 lost: this node's part of step 80 waits on its disk, the destination's newest step (40) is whole;
    missing=node0 of step 80 stands (before, the destination's listing said nothing missing of step 40 and erased
    it). A destination whose newest step is as new as the held one decides as before."""
    from guard.secure.outcome import leader_missing

    result = RunResult("FAIL", "crash", 1, 1.0, extra={"secured": "yes", "secured_step": 40}, hint="crash")
    result.hint = leader_missing(result.extra, result.details, result.hint, step=80)
    agree_on_missing(result, read=lambda _: {"step": 40, "complete": True, "missing": ""}, wait_s=5)
    assert result.extra["missing"] == "node0" and result.details["missing"]["step"] == 80
    assert result.hint is not None and result.hint.startswith("checkpoint step 80 is not whole")
    agree_on_missing(result, read=lambda _: {"step": 80, "complete": False, "missing": "node1", "present": [0]},
                     wait_s=5)
    assert result.extra["missing"] == "node1" and "missing node0" not in (result.hint or "")
