"""Fake collaborators of the securing plan: a clock, a pusher whose pushes take size / rate seconds."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from guard.core.helpers import Pending
from guard.secure.checkpoints import CheckpointInfo

T = TypeVar("T")


class FakeClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class SleepClock(FakeClock):
    """Monotonic seconds that move only when ``sleep`` is called (records every wait): a push's retries and
    ``Retry-After`` waits, without waiting."""

    def __init__(self, now: float = 1000.0) -> None:
        super().__init__(now)
        self.sleeps: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@dataclass(frozen=True)
class FakeResult:
    op: str
    ok: bool
    size_bytes: int = 0
    elapsed_s: float = 0.0
    error: str | None = None
    hint: str | None = None
    error_type: str | None = None
    step: int | None = None
    files: tuple[str, ...] = ("model.safetensors",)
    attempts: int = 1
    destination: str = "hf://alice/run"
    revision: str = "0" * 40
    recorded_step: int | None = None  # killed after the destination's record moved to this step

    @property
    def killed(self) -> bool:
        return self.error_type in ("deadline", "killed")

    @property
    def pushed(self) -> str | None:
        return f"{self.destination}@{self.revision}" if self.ok or self.recorded_step is not None else None


@dataclass
class FakeHandle:
    """Ends ``duration_s`` after its start (ok unless ``fail``), or is killed at ``deadline`` like the worker; a
    ``stalled`` one moves no byte and never ends on its own (a commit the Hub never answers)."""

    pusher: FakePusher
    op: str
    args: dict[str, Any]
    deadline: float
    started: float
    duration_s: float
    fail: bool = False
    stalled: bool = False
    stalled_at: float | None = None  # when a running push stopped moving bytes (None: from its start)
    rewritten: bool = False  # refused: the job saved over the checkpoint after that save (CheckpointRewrittenError)
    recorded: bool = False  # its record has moved (its cleanup is what runs): a kill leaves its step secured
    result: FakeResult | None = None

    @property
    def progress_at(self) -> float:
        if not self.stalled:
            return self.pusher.clock()
        return self.started if self.stalled_at is None else self.stalled_at

    def stall(self) -> None:
        """From now on it moves no byte and never ends on its own."""
        self.stalled, self.stalled_at = True, self.pusher.clock()

    def poll(self) -> FakeResult | None:
        if self.result is not None:
            return self.result
        now = self.pusher.clock()
        if now >= self.started + self.duration_s and not self.stalled:
            size = self.pusher.size_of(self.args)
            self.result = (FakeResult(self.op, False, error="push failed: HTTP 403", error_type="PushFailedError",
                                      elapsed_s=now - self.started) if self.fail else
                           FakeResult(self.op, False, error="cannot secure it: rewritten after that save",
                                      error_type="CheckpointRewrittenError", elapsed_s=now - self.started)
                           if self.rewritten else
                           FakeResult(self.op, True, size, now - self.started, step=self.args.get("step")))
            self.pusher.ended.append(self)
            return self.result
        if now >= self.deadline:
            return self.kill("deadline")
        return None

    def kill(self, why: str = "killed") -> FakeResult:
        if self.result is None:
            self.result = FakeResult(self.op, False, error=f"{self.op} killed", error_type=why,
                                     elapsed_s=self.pusher.clock() - self.started, step=self.args.get("step"),
                                     recorded_step=self.args.get("step") if self.recorded else None)
            self.pusher.killed.append(self)
        return self.result


@dataclass
class FakePusher:
    """Pushes at ``rate(now)`` bytes per second (a function of the clock, for rate drops), plus ``overhead_s``."""

    clock: FakeClock
    sizes: dict[str, int] = field(default_factory=dict)
    rate: Any = lambda now: 10e6
    overhead_s: float = 1.0
    fail_next: bool = False
    stall_next: bool = False
    rewritten_next: bool = False
    started: list[FakeHandle] = field(default_factory=list)
    ended: list[FakeHandle] = field(default_factory=list)
    killed: list[FakeHandle] = field(default_factory=list)

    def size_of(self, args: dict[str, Any]) -> int:
        return self.sizes.get(args.get("local_dir") or args.get("output_dir") or "", 1_000_000)

    def start(self, op: str, args: dict[str, Any], deadline: float) -> FakeHandle:
        now = self.clock()
        duration = self.overhead_s + self.size_of(args) / max(self.rate(now), 1.0)
        handle = FakeHandle(self, op, dict(args), deadline, now, duration, fail=self.fail_next,
                            stalled=self.stall_next, rewritten=self.rewritten_next)
        self.fail_next = self.stall_next = self.rewritten_next = False
        self.started.append(handle)
        return handle


def ckpt(step: int, size_bytes: int = 1_000_000, root: str = "/out") -> CheckpointInfo:
    return CheckpointInfo(path=Path(root) / f"checkpoint-{step}", step=step, size_bytes=size_bytes,
                          files=("model.safetensors",), newest_mtime_s=float(step))


class FakeLink:
    """The supervisor's loop as securing sees it (``guard.secure.link.JobLink``), with no process behind it.

    ``agents``/``world_size``: what the agents said; ``running``/``alive``/``exit_code``: the job; ``ranks``: rank
    -> last step; what securing asks for lands in ``sent`` (broadcasts), ``signals``, ``stops`` (``(at,
    grace_s)``), ``woken`` and ``state.outcome``.
    """

    def __init__(self, *, agents: int = 1, world_size: int = 1, **kwargs: Any) -> None:
        from guard.core.state import RunState

        self.agents, self.world_size_seen = agents, world_size
        self.running, self.alive, self.exit_code = True, True, None
        self.ranks, self.node, self.follows, self.check_every = {}, None, False, 10
        self.sent, self.signals, self.stops, self.woken = [], [], [], 0
        self.state = RunState()
        for name, value in kwargs.items():
            setattr(self, name, value)

    @property
    def node_rank(self) -> int | None:
        return self.node

    @property
    def follows_node_0(self) -> bool:
        return self.follows

    def job_running(self) -> bool:
        return self.running

    def job_alive(self) -> bool:
        return self.alive

    def job_exit_code(self) -> int | None:
        return self.exit_code

    def job_stopped(self) -> bool:
        return bool(getattr(self, "stopped", False))

    def agents_connected(self) -> int:
        return self.agents

    def world_size(self) -> int:
        return self.world_size_seen

    def training_ranks(self) -> set[int]:
        return set(self.ranks)

    def newest_rank_step(self) -> int | None:
        return max(self.ranks.values(), default=None)

    def rank_steps(self) -> dict[int, int]:
        return dict(self.ranks)

    def broadcast(self, message: dict[str, Any]) -> int:
        self.sent.append(message)
        return self.agents

    def signal_job(self, signum: int) -> None:
        self.signals.append(signum)

    def stop_job_at(self, at: float, grace_s: float | None) -> None:
        self.stops.append((at, grace_s))

    def decide(self, outcome: Any) -> None:
        if self.state.outcome is None:
            self.state.outcome = outcome

    def wake(self) -> None:
        self.woken += 1

    def exit(self, code: int) -> None:
        """The job exited with ``code``."""
        self.running, self.alive, self.exit_code = False, False, code


class InlineFs:
    """A ``guard.core.helpers.Submitter`` that runs each call at once, on the caller's thread: securing's file
    system calls (``guard.secure.scans``) answered before ``submit`` returns, for tests of what securing does with
    the answers. ``calls`` counts them."""

    def __init__(self) -> None:
        self.calls = 0

    def submit(self, func: Callable[..., T], *args: Any, **kwargs: Any) -> Pending[T]:
        self.calls += 1
        pending: Pending[T] = Pending(getattr(func, "__qualname__", repr(func)))
        try:
            pending._finish(func(*args, **kwargs), None)
        except Exception as exc:  # kept in the Pending, as the helper thread does
            pending._finish(None, exc)
        return pending


class GatedStat:
    """An ``os.stat`` for securing's scans (the ``stat=`` seam) that blocks, like ``stat()`` on a hung NFS or Lustre
    hard mount, for every path under ``under`` until ``release()``; ``entered`` is set once a call blocks there and
    ``blocked`` counts such calls. A call from ``loop`` (default: the thread that made it, the test's, which drives
    the loop's hooks) fails at once instead: the loop never stats."""

    def __init__(self, under: Path, *, loop: threading.Thread | None = None) -> None:
        self.under = str(under)
        self.loop = loop or threading.current_thread()
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.blocked = 0

    def __call__(self, path: str) -> os.stat_result:
        if str(path).startswith(self.under) and threading.current_thread() is self.loop:
            raise AssertionError(f"stat({path}) on the loop's thread")
        if str(path).startswith(self.under) and not self.gate.is_set():
            self.blocked += 1
            self.entered.set()
            self.gate.wait()
        return os.stat(path)

    def release(self) -> None:
        self.gate.set()
