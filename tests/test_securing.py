"""Securing's hooks, driven with a fake clock, the fake pusher and a fake loop (``fakes.FakeLink``): no process,
no Hub. Checkpoints are real folders under ``tmp_path`` (their size and completeness are read from disk)."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fakes import FakeClock, FakeLink, FakePusher, InlineFs

from guard.contract import RunResult
from guard.core.state import Outcome
from guard.secure.budget import Deadline, MarginEstimator
from guard.secure.securing import Securing


def save(out: Path, step: int, size_bytes: int = 1000) -> Path:
    folder = out / f"checkpoint-{step}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.safetensors").write_bytes(b"0" * size_bytes)
    return folder


class Rig:
    def __init__(self, tmp_path: Path, *, timeout_s: float | None = None, destination: str | None = "alice/run",
                 background: bool = True, margin_s: float = 30.0, **link: Any) -> None:
        self.clock = FakeClock(1000.0)
        self.wall_start = time.time()
        self.out = tmp_path / "out"
        self.out.mkdir()
        self.pusher = FakePusher(self.clock)
        deadline = (Deadline(self.wall_start, timeout_s, self.wall_start + timeout_s, "--timeout") if timeout_s
                    else Deadline(self.wall_start, None, None, "none"))
        securer = SimpleNamespace(destination=destination, token=None) if destination else None
        self.securing = Securing(deadline=deadline, estimator=MarginEstimator(fixed_margin_s=margin_s,
                                                                              log_changes=False),
                                 securer=securer, output_dir=str(self.out), clock=self.clock,  # type: ignore[arg-type]
                                 wall=lambda: self.wall_start + (self.clock.now - 1000.0), grace_s=30.0,
                                 background=background, pusher_factory=lambda dest, token: self.pusher,
                                 fs=InlineFs())  # the file system calls answered at once (test_scan_port.py: not)
        self.link = FakeLink(**link)

    def saved(self, step: int, *, rank: int | None = 0, zero: bool = True) -> None:
        path = self.out / f"checkpoint-{step}"
        if zero:
            save(self.out, step)
        self.securing.on_checkpoint_saved(self.link, {"t": "checkpoint_saved", "path": str(path), "step": step,
                                                      "rank": rank, "zero": zero, "save_s": 0.2})

    def run_for(self, seconds: float, every_s: float = 0.5) -> None:
        end = self.clock.now + seconds
        while self.clock.now < end:
            self.clock.advance(every_s)
            self.securing.tick(self.link, self.clock.now)


def test_a_reported_save_is_pushed_in_the_background(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.saved(5)
    assert [h.op for h in rig.pusher.started] == ["push_checkpoint"]
    assert rig.pusher.started[0].args["step"] == 5
    assert rig.securing.intake.latest_reported is not None and rig.securing.intake.latest_reported.step == 5


def test_without_background_pushes_a_save_is_only_remembered(tmp_path: Path) -> None:
    rig = Rig(tmp_path, background=False)
    rig.saved(5)
    assert rig.pusher.started == [] and rig.securing.plan.report().newest is not None


def test_a_collective_save_waits_for_every_ranks_part(tmp_path: Path) -> None:
    rig = Rig(tmp_path, ranks={0: 10, 1: 10})
    rig.saved(10, rank=0)
    assert rig.pusher.started == []  # rank 1's shard is not written yet
    rig.saved(10, rank=1, zero=False)
    assert len(rig.pusher.started) == 1


@pytest.mark.parametrize("path", ["/", "."])
def test_a_reported_path_that_is_no_checkpoint_is_refused(tmp_path: Path, path: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    rig = Rig(tmp_path)
    rig.securing.on_checkpoint_saved(rig.link, {"t": "checkpoint_saved", "path": path, "step": 1, "rank": 0})
    assert rig.pusher.started == [] and rig.securing.intake.latest_reported is None


def test_the_deadline_asks_a_trainer_for_a_checkpoint_then_secures_it(tmp_path: Path) -> None:
    rig = Rig(tmp_path, timeout_s=100.0)
    rig.link.state.facts.trainer_config = {"output_dir": str(rig.out)}
    rig.link.state.progress.step = 40
    rig.run_for(69.0)
    assert rig.link.sent == [] and rig.link.state.outcome is None
    rig.run_for(2.0)  # past deadline - margin
    assert rig.link.sent == [{"t": "checkpoint", "stop": True, "trigger": "deadline"}]
    assert rig.link.state.outcome is not None and rig.link.state.outcome.status == "TIMEOUT"
    assert rig.link.stops, "the job is stopped before the deadline"
    rig.saved(41)
    rig.run_for(5.0)
    rig.link.exit(0)
    rig.securing.on_job_exit(rig.link, rig.clock.now)
    rig.run_for(2.0)
    result = RunResult("TIMEOUT", "deadline", 0, 75.0)
    rig.securing.finish(result, step=41)
    assert result.exit_code == 75 and result.extra["secured"] == "yes"
    assert result.extra["checkpoint"] == str(rig.out / "checkpoint-41")
    assert "resumes from step 41" in (result.hint or "")


def test_with_several_ranks_the_request_names_a_step_ahead_of_all(tmp_path: Path) -> None:
    rig = Rig(tmp_path, timeout_s=100.0, agents=2, world_size=2, ranks={0: 50, 1: 48}, check_every=10)
    rig.link.state.facts.trainer_config = {"output_dir": str(rig.out)}
    rig.link.state.progress.step = 50
    rig.run_for(71.0)
    assert rig.link.sent == [{"t": "checkpoint", "stop": True, "trigger": "deadline", "at_step": 50 + 2 * 10 + 2}]


def test_a_job_that_cannot_save_is_not_asked(tmp_path: Path) -> None:
    rig = Rig(tmp_path, timeout_s=100.0)
    rig.link.state.progress.step = 40  # a plain loop past its first steps, no guard API used, no Trainer
    rig.run_for(71.0)
    assert not any(m["t"] == "checkpoint" for m in rig.link.sent)
    assert rig.link.state.outcome is not None and rig.link.state.outcome.reason == "deadline"


def test_a_signal_is_left_to_the_loop_without_a_destination(tmp_path: Path) -> None:
    rig = Rig(tmp_path, destination=None)
    assert not rig.securing.on_signal(rig.link, signal.SIGTERM, rig.clock.now)
    assert not rig.securing.on_signal(rig.link, signal.SIGHUP, rig.clock.now)


def test_a_crash_secures_the_newest_checkpoint_saved_before_it(tmp_path: Path) -> None:
    rig = Rig(tmp_path, background=False)
    rig.saved(20)
    rig.link.state.progress.step = 27
    rig.link.exit(1)
    rig.securing.on_job_exit(rig.link, rig.clock.now)
    assert len(rig.pusher.started) == 1 and rig.pusher.started[0].args["step"] == 20
    rig.run_for(5.0)
    result = RunResult("FAIL", "crash", 1, 5.0)
    rig.securing.finish(result, step=27)
    assert result.extra["secured"] == "yes" and result.details["steps_lost"] == 7
    assert result.exit_code == 1  # a failure keeps its own exit code


def test_a_non_finite_loss_never_pushes_a_checkpoint_saved_after_it(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.saved(10)  # pushed in the background
    rig.saved(30)  # queued behind it (--push-interval)
    rig.link.state.progress.step = 25  # the first non-finite step
    rig.securing.on_decided(rig.link, Outcome("FAIL", "non_finite_loss", 4))
    rig.run_for(5.0)
    assert [h.args["step"] for h in rig.pusher.started] == [10]
    assert rig.securing.plan.report().suspect is not None and rig.securing.plan.report().suspect.step == 30
    result = RunResult("FAIL", "non_finite_loss", 4, 5.0)
    rig.securing.finish(result, step=25)
    assert result.extra["secured"] == "yes" and result.details["suspect_checkpoint"] == str(rig.out / "checkpoint-30")


def test_a_guard_on_another_node_never_pushes(tmp_path: Path) -> None:
    rig = Rig(tmp_path, node=1)
    rig.saved(5)
    assert rig.pusher.started == [] and not rig.securing.plan.has_pusher


def test_a_trainer_names_the_output_folder_and_the_destination(tmp_path: Path) -> None:
    clock = FakeClock()
    made: list[str] = []

    def factory(text: str) -> Any:
        made.append(text)
        return SimpleNamespace(destination=text, token=None)

    securing = Securing(deadline=Deadline(0.0, None, None, "none"), estimator=MarginEstimator(log_changes=False),
                        securer_factory=factory, clock=clock, pusher_factory=lambda dest, token: FakePusher(clock))
    assert not securing.plan.has_pusher
    securing.on_trainer_config({"output_dir": str(tmp_path / "run"), "push_to_hub": True, "hub_model_id": "bob/m"})
    assert securing.output_dir == str(tmp_path / "run") and made == ["bob/m"]
    assert securing.plan.has_pusher


def test_files_saved_with_torch_save_form_one_checkpoint_once_settled(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    folder = rig.out / "weights"  # a folder of no checkpoint layout (``step-8`` is torchtitan's since 51cc829)
    folder.mkdir()
    for name in ("model.pt", "optim.pt"):
        (folder / name).write_bytes(b"1" * 500)
        rig.securing.on_file_saved(rig.link, {"t": "file_saved", "path": str(folder / name), "step": 8, "rank": 0,
                                              "save_s": 0.1})
    assert rig.link.woken == 2 and rig.pusher.started == []  # the set may still grow
    rig.run_for(1.5)
    assert len(rig.pusher.started) == 1
    assert rig.securing.intake.latest_reported is not None and rig.securing.intake.latest_reported.step == 8


def test_the_agent_never_waits_for_a_stop_already_asked_for() -> None:
    from guard.inside.agent import Agent
    from guard.inside.settings import AgentSettings

    agent = Agent(AgentSettings(socket_path="/nonexistent/guard.sock"))
    agent.checkpoint_request = {"t": "checkpoint", "stop": True}  # the deadline's request, not yet answered
    started = time.monotonic()
    agent.wait_stop(timeout_s=5.0)
    assert time.monotonic() - started < 1.0
    agent.checkpoint_request, agent.stop_requested = None, True
    started = time.monotonic()
    agent.wait_stop(timeout_s=5.0)
    assert time.monotonic() - started < 1.0


def test_a_taint_marks_the_saves_after_it_on_disk(tmp_path: Path) -> None:
    from guard.secure.checkpoints import is_marked_suspect

    rig = Rig(tmp_path, timeout_s=1000.0)
    rig.link.ranks = {0: 40}
    rig.saved(10)
    rig.run_for(2.0)
    rig.saved(40)
    rig.securing.on_taint(rig.link, 30)
    assert is_marked_suspect(rig.out / "checkpoint-40") and not is_marked_suspect(rig.out / "checkpoint-10")
    marker = json.loads((rig.out / "checkpoint-40" / "guard_suspect.json").read_text())
    assert {k: marker[k] for k in ("step", "first_non_finite_step", "run_id")} == {
        "step": 40, "first_non_finite_step": 30, "run_id": rig.securing.run_id}
    assert marker["path"] == str(rig.out / "checkpoint-40") and marker["size_bytes"] > 0
    report = rig.securing.plan.report()
    assert report.secured is not None and report.secured.step == 10


def test_a_loose_checkpoint_file_is_marked_beside_it(tmp_path: Path) -> None:
    from guard.secure.checkpoints import is_marked_suspect, mark_suspect

    loose = tmp_path / "ckpt.pt"
    loose.write_bytes(b"0")
    assert not is_marked_suspect(loose)
    marker = mark_suspect(loose, step=12, first_non_finite_step=9)
    assert marker == tmp_path / "ckpt.pt.guard-suspect.json" and is_marked_suspect(loose)
    body = json.loads(marker.read_text())
    assert (body["step"], body["first_non_finite_step"], body["size_bytes"]) == (12, 9, 1)
    assert mark_suspect(tmp_path / "gone" / "x.pt", step=1, first_non_finite_step=1) is None  # logged, never raised


def _trainer_part(out: Path, step: int, rank: int, *, zero: bool) -> Path:
    """One rank's part of a Trainer checkpoint under DDP: rank 0 the model and trainer_state.json, every rank its
    rng_state_R.pth (raw bytes: a format the checks take as it is)."""
    folder = out / f"checkpoint-{step}"
    folder.mkdir(parents=True, exist_ok=True)
    if zero:
        (folder / "model.bin").write_bytes(b"0" * 1000)
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (folder / f"rng_state_{rank}.pth").write_bytes(b"1" * 100)
    return folder


def newest_step(rig: Rig) -> int | None:
    """The newest complete checkpoint the plan was given (pushed, or queued behind --push-interval)."""
    newest = rig.securing.plan.report().newest
    return newest.step if newest is not None else None


def _report(rig: Rig, step: int, rank: int) -> None:
    rig.securing.on_checkpoint_saved(rig.link, {"t": "checkpoint_saved", "path": str(rig.out / f"checkpoint-{step}"),
                                                "step": step, "rank": rank, "zero": rank == 0, "save_s": 0.2})


def test_a_rank_that_saved_before_owes_its_part_even_when_no_longer_counted_as_training(tmp_path: Path) -> None:
    # issue 18: checkpoint-210 was pushed while rank 1 still wrote rng_state_1.pth; the rule waited only while more
    # than one rank counted as training. Every rank that reported its part of an earlier checkpoint owes this one.
    rig = Rig(tmp_path, ranks={0: 10, 1: 10}, world_size=2, agents=2)
    for rank in (0, 1):
        _trainer_part(rig.out, 10, rank, zero=rank == 0)
        _report(rig, 10, rank)
    assert [h.args["step"] for h in rig.pusher.started] == [10]
    # described once every part is there: rank 1's file, written after rank 0's report, is pushed too
    assert "rng_state_1.pth" in rig.pusher.started[0].args["files"]
    rig.run_for(5.0)
    rig.link.ranks = {0: 20}  # rank 1's steps are not heard now (ended, or not reported yet)
    _trainer_part(rig.out, 20, 0, zero=True)
    _report(rig, 20, 0)
    rig.run_for(12.0)  # scans too: trainer_state.json is there, settled
    assert newest_step(rig) == 10  # not before rank 1's part
    _trainer_part(rig.out, 20, 1, zero=False)
    _report(rig, 20, 1)
    assert newest_step(rig) == 20


def test_the_scan_never_takes_a_trainer_folder_without_every_ranks_file(tmp_path: Path) -> None:
    # no report at all (the scan alone): trainer_state.json is rank 0's; rank 1's rng_state_1.pth is still to come
    rig = Rig(tmp_path, world_size=2, agents=2)
    rig.securing.trainer_seen = True
    _trainer_part(rig.out, 30, 0, zero=True)
    rig.run_for(12.0)
    assert rig.pusher.started == []
    _trainer_part(rig.out, 30, 1, zero=False)
    rig.run_for(12.0)
    assert [h.args["step"] for h in rig.pusher.started] == [30]


def test_a_waiting_folder_counts_once_its_layout_says_every_rank_wrote(tmp_path: Path) -> None:
    # rank 1's report is lost (its agent gone), but its file is there: the layout's own marker completes it
    rig = Rig(tmp_path, ranks={0: 10, 1: 10}, world_size=2, agents=2)
    _trainer_part(rig.out, 10, 0, zero=True)
    _report(rig, 10, 0)
    _trainer_part(rig.out, 10, 1, zero=False)
    assert rig.pusher.started == []
    rig.run_for(12.0)
    assert [h.args["step"] for h in rig.pusher.started] == [10]


def test_a_rank_that_trains_on_without_reporting_the_first_save_had_no_part_in_it(tmp_path: Path) -> None:
    # a DDP loop whose rank 0 alone saves and calls guard.checkpoint_saved: rank 1 never reports; once it trained
    # past the save's step it is known to have no part in it, and later saves wait for rank 0 alone
    rig = Rig(tmp_path, ranks={0: 10, 1: 10})
    rig.saved(10, rank=0)
    rig.run_for(1.0)
    assert rig.pusher.started == []
    rig.link.ranks = {0: 12, 1: 12}
    rig.run_for(1.0)
    assert [h.args["step"] for h in rig.pusher.started] == [10]
    rig.run_for(5.0)
    rig.saved(20, rank=0)
    assert newest_step(rig) == 20


def test_the_final_model_of_a_working_folder_is_what_the_job_wrote_at_its_top(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # --save model.pt (word_language_model) or a Trainer's --output_dir .: the output folder is the working folder
    import os

    monkeypatch.chdir(tmp_path)
    rig = Rig(tmp_path)
    for name in ("main.py", "notes.json", "vocab.txt"):  # the job's sources and data, there before it started
        (tmp_path / name).write_text("x")
        os.utime(tmp_path / name, (time.time() - 100, time.time() - 100))
    rig.securing.folder.output_dir = "."
    rig.securing.before_start()
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "cache.json").write_text("{}")  # below the top: never
    (tmp_path / "train.log").write_text("a log")
    for name in ("model.safetensors", "config.json"):  # a Trainer's save_model
        (tmp_path / name).write_bytes(b"0" * 10)
    (tmp_path / "model.pt").write_bytes(b"0" * 10)
    rig.securing.on_file_saved(rig.link, {"t": "file_saved", "path": str(tmp_path / "model.pt"), "step": 4,
                                          "rank": 0, "save_s": 0.1})
    disk, since_s = rig.securing.disk, rig.securing.folder.started_s
    assert disk.final_files(".", since_s) == ("config.json", "model.pt", "model.safetensors")
    assert disk.final_files(str(rig.out), since_s) is None  # a folder of the job's own: the whole folder


def accelerate_state(folder: Path) -> Path:
    """What ``Accelerator.save_state(folder)`` writes (random_states_0.pkl last)."""
    import torch

    folder.mkdir(parents=True)
    for name in ("optimizer.bin", "scheduler.bin", "random_states_0.pkl"):
        torch.save({"x": 1}, folder / name)
    return folder


def test_an_accelerate_folder_goes_by_the_agents_step_and_the_last_save_before_exit_0_needs_no_settling(
        tmp_path: Path) -> None:
    # complete_nlp_example resumed from step_230 mid-epoch names its next saves step_110, step_120 ... (its count
    # restarts within the epoch); the agent's steps go on from 230. The job's last save comes just before it exits.
    rig = Rig(tmp_path, destination="/tmp/unused-dest")
    resumed = accelerate_state(rig.out / "step_230")
    rig.securing.folder.resumed_paths = {str(resumed)}
    for name, step in (("step_110", 235), ("step_120", 245)):
        folder = accelerate_state(rig.out / name)
        for file in ("optimizer.bin", "scheduler.bin", "random_states_0.pkl"):
            rig.securing.on_file_saved(rig.link, {"t": "file_saved", "path": str(folder / file), "step": step,
                                                  "rank": 0, "save_s": 0.01})
    import os

    rig.clock.advance(30.0)
    now = rig.securing.wall()
    for folder in (resumed, rig.out / "step_110", rig.out / "step_120"):
        for file in folder.iterdir():
            age = 0.5 if folder.name == "step_120" else 20.0
            os.utime(file, (now - age, now - age))
    rig.link.exit(0)
    rig.securing.on_job_exit(rig.link, rig.clock.now)  # step_120 was written 0.5 s ago
    pushed = [h.args for h in rig.pusher.started if h.op == "push_checkpoint"]
    assert pushed and pushed[-1]["local_dir"] == str(rig.out / "step_120") and pushed[-1]["step"] == 245, pushed
