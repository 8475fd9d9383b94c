"""Fake collaborators of the securing plan: a clock, a pusher whose pushes take size / rate seconds."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from guard.secure.checkpoints import CheckpointInfo


class FakeClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
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

    @property
    def killed(self) -> bool:
        return self.error_type in ("deadline", "killed")

    @property
    def pushed(self) -> str | None:
        return f"{self.destination}@{self.revision}" if self.ok else None


@dataclass
class FakeHandle:
    """Ends ``duration_s`` after its start (ok unless ``fail``), or is killed at ``deadline`` like the worker."""

    pusher: FakePusher
    op: str
    args: dict[str, Any]
    deadline: float
    started: float
    duration_s: float
    fail: bool = False
    result: FakeResult | None = None

    def poll(self) -> FakeResult | None:
        if self.result is not None:
            return self.result
        now = self.pusher.clock()
        if now >= self.started + self.duration_s:
            size = self.pusher.size_of(self.args)
            self.result = (FakeResult(self.op, False, error="push failed: HTTP 403", error_type="PushFailedError",
                                      elapsed_s=now - self.started) if self.fail else
                           FakeResult(self.op, True, size, now - self.started, step=self.args.get("step")))
            self.pusher.ended.append(self)
            return self.result
        if now >= self.deadline:
            return self.kill("deadline")
        return None

    def kill(self, why: str = "killed") -> FakeResult:
        if self.result is None:
            self.result = FakeResult(self.op, False, error=f"{self.op} killed", error_type=why,
                                     elapsed_s=self.pusher.clock() - self.started)
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
    started: list[FakeHandle] = field(default_factory=list)
    ended: list[FakeHandle] = field(default_factory=list)
    killed: list[FakeHandle] = field(default_factory=list)

    def size_of(self, args: dict[str, Any]) -> int:
        return self.sizes.get(args.get("local_dir") or args.get("output_dir") or "", 1_000_000)

    def start(self, op: str, args: dict[str, Any], deadline: float) -> FakeHandle:
        now = self.clock()
        duration = self.overhead_s + self.size_of(args) / max(self.rate(now), 1.0)
        handle = FakeHandle(self, op, dict(args), deadline, now, duration, fail=self.fail_next)
        self.fail_next = False
        self.started.append(handle)
        return handle


def ckpt(step: int, size_bytes: int = 1_000_000, root: str = "/out") -> CheckpointInfo:
    return CheckpointInfo(path=Path(root) / f"checkpoint-{step}", step=step, size_bytes=size_bytes,
                          files=("model.safetensors",), newest_mtime_s=float(step))
