"""A hypothesis state machine over the REAL securing code (``guard.secure.securing.Securing`` and its plan, scans
and snapshots) with a REAL folder destination (``guard.secure.securer.Securer`` writing ``DEST/last-checkpoint``) and
real files in a real output folder; only the clock, the loop (``fakes.FakeLink``) and the worker process are
stood in for (the push runs in-process when its fake duration is over, or hangs, or fails).

A fake job trains step by step: each step's loss is finite, NaN or inf (once not finite, every later one is, and
its weights are not finite from that step on); its losses are read every ``CHECK_EVERY`` steps (the agent's
window: a save inside it is reported before its losses are read), or at a read point. It saves a checkpoint folder
(``checkpoint-N/model.bin``), a file in place (``ckpt.pt``, the nanoGPT pattern), a new file per step, a file under a
temporary name renamed into place (timm's ``tmp.pth.tar`` -> ``last.pth.tar``) or a new folder per save; it rotates
its folders; its weights go non-finite under a finite loss (the agent's check says so in ``file_saved``). Each
saved file's bytes say which run and step saved it and whether its weights were finite.

After every step the destination is read **on the bytes**: ``DEST/last-checkpoint`` is absent or holds a whole
save of this run (every file as its manifest says, size and sha256), made before the first non-finite loss, with
finite weights. When the run ends (the job's exit, a deadline, a signal), ``Securing.finish`` fills the VERDICT's
fields and they must name what the destination holds: ``secured=no`` (or no push) with nothing recorded, else the
recorded step is the one ``secured_step`` names (or, when a taint reached the record and moving it back failed or
had no time, the hint says the destination still holds that suspect step); and what the next run's ``--resume on``
fetches from the destination (``Securer.fetch_last_checkpoint`` into a fresh folder) is that step's save, finite,
made before the first non-finite loss.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fakes import FakeClock, FakeLink, FakeResult, InlineFs
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from guard.contract import RunResult
from guard.core.state import Outcome
from guard.errors import GuardError
from guard.secure.budget import Deadline, MarginEstimator
from guard.secure.securer import Securer
from guard.secure.securing import Securing

RUN = "run-under-test"
CHECK_EVERY = 4
WALL_START = 1_700_000_000.0
CLOCK_START = 1000.0
FILE_BYTES = 4096


class InlineHandle:
    """A push run in this process by the real ``Securer`` once ``duration_s`` of the fake clock passed (``mode``
    ``ok``), or failing then (``fail``), or never ending until killed (``hang``)."""

    def __init__(self, pusher: InlinePusher, op: str, args: dict[str, Any], deadline: float, mode: str,
                 duration_s: float) -> None:
        self.pusher, self.op, self.args, self.deadline, self.mode = pusher, op, args, deadline, mode
        self.started = pusher.clock()
        self.duration_s = duration_s
        self.result: FakeResult | None = None

    @property
    def progress_at(self) -> float:
        return self.started if self.mode == "hang" else self.pusher.clock()

    def poll(self) -> FakeResult | None:
        if self.result is not None:
            return self.result
        now = self.pusher.clock()
        if self.mode != "hang" and now >= self.started + self.duration_s:
            self.result = self._run(now)
            return self.result
        if now >= self.deadline:
            return self.kill("deadline")
        return None

    def _run(self, now: float) -> FakeResult:
        elapsed = now - self.started
        if self.mode == "fail":
            return FakeResult(self.op, False, error=f"{self.op}: HTTP 503", error_type="PushFailedError",
                              elapsed_s=elapsed)
        securer = self.pusher.make_securer()
        self.pusher.pushes_run += 1  # the destination may change from here on
        try:
            if self.op == "push_final":
                pushed = securer.push_final(self.args["output_dir"], files=self.args.get("files"), deadline=1e18)
            elif self.op == "restore_checkpoint":  # the record moved back after a taint reached it
                pushed = securer.restore_checkpoint(**self.args, deadline=1e18)
            else:
                args = {k: v for k, v in self.args.items() if k in ("local_dir", "step", "files", "saved_by_s",
                                                                   "source")}
                pushed = securer.push_checkpoint(**args, deadline=1e18)
        except GuardError as exc:
            return FakeResult(self.op, False, error=exc.message, error_type=type(exc).__name__, elapsed_s=elapsed)
        return FakeResult(self.op, True, int(pushed.size_bytes), elapsed, step=self.args.get("step"),
                          files=tuple(pushed.files), destination=str(securer.destination), revision=pushed.revision)

    def kill(self, why: str = "killed") -> FakeResult:
        if self.result is None:
            self.result = FakeResult(self.op, False, error=f"{self.op} killed", error_type=why,
                                     elapsed_s=self.pusher.clock() - self.started)
        return self.result


class InlinePusher:
    """``events.Pusher`` for the machine: the next push's ``mode`` and ``duration_s`` are the machine's to set."""

    def __init__(self, clock: FakeClock, make_securer: Callable[[], Securer]) -> None:
        self.clock, self.make_securer = clock, make_securer
        self.next_mode, self.next_duration_s = "ok", 1.0
        self.started: list[InlineHandle] = []
        self.pushes_run = 0  # pushes that reached the destination (ran the real Securer)

    def start(self, op: str, args: dict[str, Any], deadline: float) -> InlineHandle:
        handle = InlineHandle(self, op, dict(args), deadline, self.next_mode, self.next_duration_s)
        self.next_mode, self.next_duration_s = "ok", 1.0
        self.started.append(handle)
        return handle


def content(step: int, finite: bool, salt: int) -> bytes:
    """A saved file's bytes: which run and step saved it, whether its weights were finite."""
    head = json.dumps({"run": RUN, "step": step, "finite": finite, "salt": salt}).encode() + b"\n"
    return head + b"w" * (FILE_BYTES - len(head))


def parse(data: bytes) -> dict[str, Any]:
    return dict(json.loads(data.split(b"\n", 1)[0]))


def recorded(dest: Path) -> tuple[int | None, list[dict[str, Any]]] | None:
    """What ``DEST/last-checkpoint`` holds: the manifest's step and each model file's header, every file checked
    against the manifest (size, sha256); None when there is no record."""
    folder = dest / "last-checkpoint"
    if not folder.is_dir():
        return None
    manifest = json.loads((folder / "guard_manifest.json").read_text())
    heads = []
    for rel, meta in manifest["files"].items():
        data = (folder / rel).read_bytes()
        assert len(data) == meta["size"] and hashlib.sha256(data).hexdigest() == meta["sha256"], \
            f"{rel} at the destination is not what its manifest says"
        heads.append(parse(data))
    return manifest.get("step"), heads


class SecureMachine(RuleBasedStateMachine):
    """The real securing code, a real folder destination, a fake job (see the module docstring). A subclass with
    another destination overrides ``securer`` and ``held`` (``HubSecureMachine``)."""

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="secure-machine-"))

    def securer(self) -> Securer:
        """A ``Securer`` of this example's destination (a new one for every push, as each worker process makes)."""
        return Securer(str(self.dest))

    def held(self) -> tuple[int | None, list[dict[str, Any]]] | None:
        """What the destination's record names, read on its bytes (``recorded``)."""
        return recorded(self.dest)

    @initialize(timeout_s=st.sampled_from([None, 60.0, 200.0]), background=st.booleans(), warm=st.integers(0, 6),
                how=st.sampled_from(["folder", "in_place", "new_file", "renamed", "new_folder"]))
    def start(self, timeout_s: float | None, background: bool, warm: int = 0, how: str = "folder") -> None:
        """The run starts; with ``warm``, the job first trains that many finite steps and saves (read, a second
        to push): without it most examples end before any push (a NaN drawn early ends the job, and hypothesis
        leaves whole rules out of an example)."""
        self._begin(timeout_s, background)
        if warm:
            self.train(n=warm, bad=None)
            self.save(how=how, read_first=True, requested=False)
            self.tick(dt=1.0)

    def _begin(self, timeout_s: float | None, background: bool) -> None:
        self.out, self.dest = self.root / "out", self.root / "dest"
        self.out.mkdir()
        self.clock = FakeClock(CLOCK_START)
        self.pusher = InlinePusher(self.clock, self.securer)
        deadline = (Deadline(WALL_START, timeout_s, WALL_START + timeout_s, "--timeout") if timeout_s
                    else Deadline(WALL_START, None, None, "none"))
        securer = self.securer()
        self.securing = Securing(deadline=deadline, estimator=MarginEstimator(log_changes=False), securer=securer,
                                 output_dir=str(self.out), clock=self.clock,
                                 wall=lambda: WALL_START + (self.clock.now - CLOCK_START), grace_s=20.0,
                                 background=background, push_interval_s=0.0,
                                 pusher_factory=lambda dest, token: self.pusher, fs=InlineFs())
        self.link = FakeLink(check_every=CHECK_EVERY)
        self.link.state.facts.api_used.add("checkpoint_saved")
        self.securing.before_start(WALL_START - 1.0)
        self.step = 0
        self.pending: list[tuple[int, float]] = []  # losses not read yet
        self.first_bad: int | None = None  # the first non-finite loss (read or not)
        self.weights_bad_from: int | None = None
        self.saves: dict[int, bool] = {}  # step -> its weights were finite
        self.salt = 0
        self.exited = False
        self.ended = False

    # -- the job ---------------------------------------------------------------------------------------------

    def _weights_finite(self) -> bool:
        return self.weights_bad_from is None or self.step < self.weights_bad_from

    @precondition(lambda self: not self.exited)
    @rule(n=st.integers(1, 6), bad=st.sampled_from([None, None, "nan", "inf"]))
    def train(self, n: int, bad: str | None) -> None:
        """``n`` steps; with ``bad``, the last one's loss is not finite (and every later one)."""
        for i in range(n):
            self.step += 1
            value = 1.0 / self.step
            if bad is not None and i == n - 1 and self.first_bad is None:
                self.first_bad = self.step
            if self.first_bad is not None or (self.weights_bad_from is not None and self.step > self.weights_bad_from):
                value = float("nan") if bad != "inf" else float("inf")
                self.first_bad = self.step if self.first_bad is None else self.first_bad
                if self.weights_bad_from is None:
                    self.weights_bad_from = self.step
            self.pending.append((self.step, value))
            if len(self.pending) >= CHECK_EVERY:
                self.read_losses()
                if self.exited:
                    return

    @precondition(lambda self: not self.exited and self.first_bad is None and self.weights_bad_from is None
                  and self.step not in self.saves)
    @rule()
    def weights_go_bad(self) -> None:
        """The update of this step made the weights non-finite under a finite loss (ModernBERT #233); the next
        loss is NaN. Not once this step was saved: the weights change only with an update, so two saves of one
        step hold the same weights (a finite save of step N, then a NaN one of step N, is no job's)."""
        self.weights_bad_from = self.step

    @precondition(lambda self: not self.exited)
    @rule()
    def read_losses(self) -> None:
        """The agent reads its window (every ``CHECK_EVERY`` steps, or at a read point)."""
        if not self.pending:
            return
        window, self.pending = self.pending, []
        bad = next((step for step, value in window if value != value or abs(value) == float("inf")), None)
        link, now = self.link, self.clock()
        if bad is None:
            last = window[-1][0]
            link.state.progress.step, link.state.progress.loss = last, window[-1][1]
            link.state.progress.loss_source = "agent"
            link.ranks = {0: last}
            self.securing.on_step(link, now)
            return
        if link.state.outcome is None:
            link.state.progress.step = bad
            outcome = Outcome("FAIL", "non_finite_loss", 4)
            link.decide(outcome)
            self.securing.on_decided(link, outcome)
            self.job_exit(code=-signal.SIGTERM)  # the guard stops the job
        else:
            self.securing.on_taint(link, bad)

    def _report_file(self, path: Path, finite: bool) -> None:
        st_ = path.stat()
        self.securing.on_file_saved(self.link, {"t": "file_saved", "path": str(path), "step": self.step,
                                                "rank": 0, "size": st_.st_size, "mtime_ns": st_.st_mtime_ns,
                                                "inode": st_.st_ino, "finite": finite,
                                                "bad_tensor": None if finite else "layer.weight"})

    @precondition(lambda self: not self.exited and self.step > 0)
    @rule(how=st.sampled_from(["folder", "folder", "in_place", "new_file", "renamed", "new_folder"]),
          read_first=st.booleans(),
          requested=st.booleans())
    def save(self, how: str, read_first: bool, requested: bool) -> None:
        """A save; ``read_first``: the agent reads the pending losses first (a save as a read point)."""
        if read_first:
            self.read_losses()
            if self.exited:
                return
        finite = self._weights_finite()
        self.salt += 1
        self.saves[self.step] = finite
        data = content(self.step, finite, self.salt)
        if how == "folder":
            folder = self.out / f"checkpoint-{self.step}"
            folder.mkdir(exist_ok=True)
            (folder / "model.bin").write_bytes(data)
            self._report_file(folder / "model.bin", finite)
            self.securing.on_checkpoint_saved(self.link, {"t": "checkpoint_saved", "path": str(folder),
                                                          "step": self.step, "rank": 0, "zero": True,
                                                          "requested": bool(self.link.sent) and requested})
        elif how == "renamed":  # timm's CheckpointSaver: torch.save to tmp.pth.tar, then renamed (timm PR #693)
            tmp = self.out / "tmp.pth.tar"
            tmp.write_bytes(data)
            self._report_file(tmp, finite)
            tmp.replace(self.out / "last.pth.tar")
        elif how == "new_folder":  # a folder of its own per save, reported by torch.save alone
            folder = self.out / f"run-{self.step}"
            folder.mkdir(exist_ok=True)
            (folder / "model.pt").write_bytes(data)
            self._report_file(folder / "model.pt", finite)
        else:
            path = self.out / ("ckpt.pt" if how == "in_place" else f"ckpt-{self.step}.pt")
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(data)
            tmp.replace(path)
            self._report_file(path, finite)

    @precondition(lambda self: not self.exited)
    @rule()
    def rotate(self) -> None:
        """The job deletes its oldest checkpoint folder but the newest two (``save_total_limit=2``)."""
        folders = sorted(self.out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
        for folder in folders[:-2]:
            shutil.rmtree(folder)

    @rule(mode=st.sampled_from(["ok", "ok", "fail", "hang"]), duration_s=st.sampled_from([0.5, 3.0, 15.0]))
    def next_push(self, mode: str, duration_s: float) -> None:
        """The next push succeeds, fails or hangs, and takes ``duration_s``."""
        self.pusher.next_mode, self.pusher.next_duration_s = mode, duration_s

    @precondition(lambda self: not self.ended)
    @rule(dt=st.sampled_from([0.3, 1.0, 4.0, 12.0]))
    def tick(self, dt: float) -> None:
        self.clock.advance(dt)
        self.securing.tick(self.link, self.clock())
        if self.link.sent and not self.exited and self.link.state.outcome is not None \
                and self.clock() >= min((at for at, _ in self.link.stops), default=float("inf")):
            self.job_exit(code=-signal.SIGTERM)  # the stop the guard set came

    @precondition(lambda self: not self.exited and not self.ended and self.step >= 4)
    @rule()
    def sigterm(self) -> None:
        self.securing.on_signal(self.link, signal.SIGTERM, self.clock())

    @precondition(lambda self: not self.exited and self.step >= 6)
    @rule(code=st.sampled_from([0, 0, 1, -9]))
    def job_exit(self, code: int) -> None:
        self.exited = True
        self.link.exit(code)
        if code == 0 and self.link.state.outcome is None:
            self.link.state.facts.train_end = None
        self.securing.on_job_exit(self.link, self.clock())

    @precondition(lambda self: not self.ended and self.step >= 8)
    @rule()
    def end(self) -> None:
        """The run ends: the loop turns until securing is over (or the deadline passed), then the VERDICT."""
        if not self.exited:
            self.job_exit(code=-signal.SIGTERM if self.link.state.outcome is not None else 0)
        for _ in range(400):
            if not self.securing.busy():
                break
            self.clock.advance(0.5)
            self.securing.tick(self.link, self.clock())
        outcome = self.link.state.outcome
        result = RunResult(outcome.status if outcome else "PASS", outcome.reason if outcome else "ok",
                           outcome.exit_code if outcome else 0, step=self.step)
        self.securing.finish(result, step=self.step)
        self.ended = True
        held = self.held()
        secured = result.extra.get("secured")
        push = result.details.get("push")
        suspect_from = self.securing.plan.report().suspect_from_step  # a save at or after it is suspect
        if held is None:
            assert secured != "yes" and push is None, f"VERDICT secured={secured} {push}, nothing at DEST"
        elif suspect_from is not None and held[0] is not None and held[0] >= suspect_from:
            # a taint reached the record and moving it back failed or had no time: never said to be secured
            assert secured != "yes" and push is None and "the destination still holds" in (result.hint or ""), \
                f"DEST/last-checkpoint holds the suspect step {held[0]}; VERDICT secured={secured} {result.hint}"
        else:
            step, _ = held
            assert push is not None and push.get("step") == step, \
                f"DEST/last-checkpoint holds step {step}; the VERDICT names {push and push.get('step')}"
        self._what_a_resume_loads(held)

    def _what_a_resume_loads(self, held: tuple[int | None, list[dict[str, Any]]] | None) -> None:
        """The next run's fetch (``Securer.fetch_last_checkpoint``, as ``--resume on`` runs it) into a fresh folder:
        nothing when nothing is recorded, else the recorded step's files, each a save of this run made before the
        first non-finite loss, with finite weights."""
        into = self.root / f"resume-{self.salt}"
        fetched = self.securer().fetch_last_checkpoint(into, deadline=float("inf"))
        if held is None:
            assert fetched is None, f"nothing is recorded at DEST, yet a resume fetched {fetched}"
            return
        assert fetched is not None and fetched.step == held[0], f"a resume fetched {fetched}, DEST records {held[0]}"
        suspect_from = self.securing.plan.report().suspect_from_step
        if suspect_from is not None and held[0] is not None and held[0] >= suspect_from:
            return  # the suspect save the VERDICT says is still there: --resume refuses it (the run's taint)
        paths = [fetched.path] if fetched.path.is_file() else [p for p in fetched.path.rglob("*") if p.is_file()]
        heads = [parse(p.read_bytes()) for p in paths if p.name != "guard_manifest.json"]
        assert heads, f"a resume fetched no model file from {fetched.path}"
        for head in heads:
            assert head["run"] == RUN and head["finite"], f"a resume loads {head}: weights not finite"
            if self.first_bad is not None:
                assert head["step"] < self.first_bad, (
                    f"a resume loads the save of step {head['step']}, at or after the first non-finite loss "
                    f"(step {self.first_bad})")

    # -- what the destination holds, after every step ------------------------------------------------------------

    @invariant()
    def destination_holds_a_good_save(self) -> None:
        if not hasattr(self, "dest"):
            return
        held = self.held()
        if held is None:
            return
        step, heads = held
        for head in heads:
            assert head["run"] == RUN
            assert head["finite"], f"DEST/last-checkpoint (step {step}) holds weights that are not finite"
            if self.first_bad is not None:
                assert head["step"] < self.first_bad, (
                    f"DEST/last-checkpoint holds the save of step {head['step']}, at or after the first non-finite "
                    f"loss (step {self.first_bad})")

    def teardown(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


class HubSecureMachine(SecureMachine):
    """The same machine with the local Hub server as the destination (``tests/hubserver.py``, Xet on: every model
    file is an LFS file that hf_xet uploads and downloads through the server's Xet storage, ``tests/xetcas.py``), a
    new repo per example. ``hub`` is set by the test module (one server for all examples). What the destination
    holds is read on its bytes: the record commit's ``last-checkpoint/`` downloaded (once per record revision) and
    every file checked against its manifest. Every example starts warm (``SecureMachine.start``): the random
    orders that follow start from a destination that holds a record."""

    hub: Any = None

    @initialize(timeout_s=st.sampled_from([None, 60.0, 200.0]), background=st.booleans(), warm=st.integers(1, 6),
                how=st.sampled_from(["folder", "in_place", "new_file", "renamed", "new_folder"]))
    def start(self, timeout_s: float | None, background: bool, warm: int = 0, how: str = "folder") -> None:
        """As the folder machine's, always warm: the Hub allows fewer examples."""
        super().start(timeout_s, background, warm, how)

    def securer(self) -> Securer:
        from huggingface_hub import HfApi

        from tests.hubserver import TOKENS

        if not hasattr(self, "repo_id"):
            self.repo_id = f"alice/machine-{self.root.name[-8:]}"
        return Securer(self.repo_id, api=HfApi(endpoint=self.hub.url, token=TOKENS["write"]))

    def held(self) -> tuple[int | None, list[dict[str, Any]]] | None:
        """The record read through the Hub client again only once a push ran since the last read (nothing else
        writes to the repo); its files downloaded once per record revision."""
        ran = self.pusher.pushes_run
        if self.__dict__.get("_read_after") == ran:
            return self.__dict__["_last_held"]
        record = self.securer().peek_last_checkpoint(deadline=float("inf"))
        self._read_after, self._last_held = ran, None
        if record is None:
            return None
        cache: dict[str, tuple[int | None, list[dict[str, Any]]] | None] = self.__dict__.setdefault("_held", {})
        if record.revision not in cache:
            from huggingface_hub import HfApi

            from tests.hubserver import TOKENS

            local = self.root / f"hub-{record.revision[:12]}"
            HfApi(endpoint=self.hub.url, token=TOKENS["write"]).snapshot_download(
                self.repo_id, revision=record.revision, allow_patterns=["last-checkpoint/*"], local_dir=local,
                cache_dir=local / ".cache")
            # None: no last-checkpoint/ at that revision (the store's fallback to HEAD when no commit is a record:
            # a resume fetches nothing from it, which ``_what_a_resume_loads`` checks)
            cache[record.revision] = recorded(local)
        self._last_held = cache[record.revision]
        return self._last_held
