"""From what the loop saw (``RunState`` + ``JobExit``) to the verdict: pure data in, a ``RunResult`` out."""

from __future__ import annotations

import math
import os
import signal
from pathlib import Path

import pytest

from guard.core.state import JobFacts, Outcome, RunState
from guard.run import diagnose
from guard.run.cli import build_config
from guard.run.config import RunSettings
from guard.run.diagnose import JobExit, cause_hint, incomplete_reason, job_result
from guard.run.process import CgroupMemory, Survivor


def config(*args: str) -> RunSettings:
    return build_config(["--no-preflight", "--sanity-steps", "3", "--", "true", *args], dict(os.environ)).settings


def trained(steps: int = 5, loss: float = 1.5) -> RunState:
    state = RunState()
    state.progress.step, state.progress.loss = steps, loss
    state.progress.sanity, state.progress.sanity_done = [2.0, 1.9, 1.8], True
    state.progress.loss_source = "agent"
    return state


@pytest.fixture(autouse=True)
def no_cgroup(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(diagnose, "cgroup_memory", lambda: None)  # the test machine's cgroup does not count


def test_a_clean_exit_passes_with_its_progress() -> None:
    result = job_result(trained(), JobExit(0, elapsed_s=12.5, peak_rss_bytes=10), config())
    assert (result.status, result.reason, result.exit_code) == ("PASS", "ok", 0)
    assert (result.step, result.loss, result.sanity, result.elapsed_s) == (5, 1.5, [2.0, 1.9, 1.8], 12.5)
    assert result.details["sanity_status"] == "passed" and result.details["peak_rss_bytes"] == 10


def test_the_guards_outcome_wins_over_the_jobs_exit() -> None:
    state = trained()
    state.outcome = Outcome("FAIL", "stalled", 5, hint="look at the stacks", extra={"rank": 1})
    result = job_result(state, JobExit(-signal.SIGTERM), config())
    assert (result.status, result.reason, result.exit_code, result.extra["rank"]) == ("FAIL", "stalled", 5, 1)
    assert result.details["job_signal"] == "SIGTERM"


def test_a_finite_loss_never_stands_on_a_non_finite_verdict() -> None:
    state = trained(loss=0.7)
    state.outcome = Outcome("FAIL", "non_finite_loss", 4)
    assert job_result(state, JobExit(-signal.SIGTERM), config()).loss is None
    state.progress.loss = math.nan
    loss = job_result(state, JobExit(-signal.SIGTERM), config()).loss
    assert loss is not None and math.isnan(loss)


def test_a_lost_exit_status_is_unknown_not_a_pass() -> None:
    result = job_result(trained(), JobExit(70, status_lost=True), config())
    assert (result.status, result.reason, result.extra["job_exit"]) == ("FAIL", "guard_error", "unknown")


def test_cuda_oom_and_host_oom() -> None:
    state = trained()
    state.facts.cuda_oom = True
    assert job_result(state, JobExit(1), config()).reason == "oom"
    start = CgroupMemory(current_bytes=1, limit_bytes=None, oom_kills=0)
    end = CgroupMemory(current_bytes=1, limit_bytes=None, oom_kills=1)
    diagnose.cgroup_memory = lambda: end  # type: ignore[assignment]  # the fixture puts it back
    result = job_result(trained(), JobExit(1, cgroup_start=start), config())
    assert result.reason == "oom" and "OOM killer ran in the job's cgroup (1 kill(s))" in (result.hint or "")


def test_a_sigkill_near_the_memory_limit_is_oom() -> None:
    limit = CgroupMemory(current_bytes=95, limit_bytes=100, oom_kills=0)
    diagnose.cgroup_memory = lambda: limit  # type: ignore[assignment]
    result = job_result(trained(), JobExit(-signal.SIGKILL, last_rss_bytes=95, cgroup_start=limit), config())
    assert (result.reason, result.exit_code) == ("oom", 137)
    other = job_result(trained(), JobExit(-signal.SIGTERM), config())
    assert (other.reason, other.exit_code, other.extra["signal"]) == ("killed", 143, "SIGTERM")


def test_a_usage_error_on_a_guard_option_after_the_script(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    in_script_form = build_config(["--no-preflight", str(script), "--grace", "5s"], dict(os.environ))
    result = job_result(RunState(), JobExit(2), in_script_form.settings)
    assert result.reason == "crash" and "guard options go before the script" in (result.hint or "")


def test_crash_hints_name_the_root_cause() -> None:
    facts = JobFacts(last_exception="RuntimeError: DataLoader worker (pid 7) is killed by signal: Bus error.",
                     root_exception="RuntimeError: unable to write to file </torch_1>: No space left on device (28)")
    hint = cause_hint(facts, 1, output_folder="/")
    assert hint.startswith("the disk is full (RuntimeError: unable to write") and "free of" in hint
    shm = cause_hint(JobFacts(last_exception="ERROR: Unexpected bus error (shm)"), 1)
    assert shm.startswith("the DataLoader workers ran out of shared memory")
    chained = cause_hint(JobFacts(last_exception="RuntimeError: outer", root_exception="KeyError: 'x'"), 3)
    assert chained.startswith("the job exited with code 3 after KeyError: 'x' (the root cause")


def test_an_exit_0_that_did_not_finish_training_is_incomplete() -> None:
    state = trained()
    state.facts.train_end = {"step": 40, "max_steps": 100, "stopped": False}
    result = job_result(state, JobExit(0), config())
    assert (result.status, result.reason, result.exit_code) == ("FAIL", "incomplete", 7)
    state.facts.train_end["stopped"] = True  # a callback asked for it
    assert incomplete_reason(state.facts) is None


def test_no_loss_seen_and_an_incomplete_sanity_pass() -> None:
    assert job_result(RunState(), JobExit(0), config()).details["sanity_status"] == "no_loss_seen"
    state = RunState()
    state.progress.sanity = [1.0]
    assert job_result(state, JobExit(0), config()).details["sanity_status"] == "incomplete (1 of 3 steps)"


def test_an_exploded_loss_leads_the_hint() -> None:
    state = trained()
    state.progress.exploded = {"step": 9, "loss": 512.0, "early": 2.0}
    state.outcome = Outcome("FAIL", "non_finite_loss", 4, hint="lower the learning rate")
    hint = job_result(state, JobExit(-signal.SIGTERM), config()).hint or ""
    assert hint.startswith("the loss exploded to 512 at step 9 from about 2") and hint.endswith(
        "then: lower the learning rate")


def test_survivors_node_and_the_jobs_own_verdict() -> None:
    state = trained()
    state.facts.job_verdict = "PASS ok"
    ended = JobExit(-signal.SIGKILL, survivors=[Survivor(41, "python", "disk-sleep")], node_rank=1, orphans_reaped=2)
    result = job_result(state, ended, config())
    assert result.extra["survivors"] == "41:disk-sleep:python" and result.extra["node"] == 1
    assert result.details["job_verdict"] == "PASS ok" and result.details["orphans_reaped"] == 2


def test_a_crash_without_a_traceback_does_not_point_at_one() -> None:
    hint = cause_hint(JobFacts(), 3)
    assert "without a Python traceback" in hint and "traceback shows" not in hint


def test_a_final_model_listing_that_never_returns_delays_the_verdict_never_withholds_it(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """After the loop, on the way to the VERDICT: the output folder's listing stuck (a hung mount) is waited for
    ``FS_BOUND_S`` at most, then taken as no final model."""
    import threading

    from guard.secure.dest import local

    gate = threading.Event()
    asked: list[str] = []

    def stuck(folder: str | None) -> bool:
        asked.append(str(folder))
        gate.wait()
        return True

    monkeypatch.setattr(local, "holds_final_model", stuck)
    monkeypatch.setattr(diagnose, "FS_BOUND_S", 0.05)
    state = trained(steps=100)
    state.facts.train_end = {"step": 100, "max_steps": 100, "stopped": True}  # trained to its end, then SIGABRT
    state.facts.trainer_config = {"output_dir": str(tmp_path / "out")}
    try:
        result = job_result(state, JobExit(-signal.SIGABRT), config())
    finally:
        gate.set()
    assert asked == [str(tmp_path / "out")]
    assert (result.status, result.reason) == ("FAIL", "killed")  # not taken for a PASS with a final model
    monkeypatch.setattr(local, "holds_final_model", lambda folder: True)
    assert job_result(state, JobExit(-signal.SIGABRT), config()).status == "PASS"


# ---------------------------------------------------------------------------------------------------------------
# The cause across ranks and nodes (guard/run/causes.py)
# ---------------------------------------------------------------------------------------------------------------

#: torchrun's failure summary as it printed it for a rank SIGKILLed on node 1 (torch 2.13, two nodes of one rank).
SUMMARY = b"""torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
======================================================
../job.py FAILED
------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-03_16:59:33
  host      : localhost
  rank      : 1 (local_rank: 0)
  exitcode  : -9 (pid: 14479)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 14479
======================================================
"""
RESET = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:17821: "
         "Connection reset by peer.")


def summary_facts(text: bytes, *, chunk: int = 17) -> JobFacts:
    from guard.core.masking import Masker
    from guard.run.output import StreamFilter

    stream = StreamFilter(Masker([]))
    for i in range(0, len(text), chunk):  # the summary in pieces, as a pipe may hand it over
        stream.feed(text[i:i + chunk])
    stream.close()
    return JobFacts(rank_exits=dict(stream.events.rank_exits))


def test_a_rank_killed_by_a_signal_is_the_cause_not_its_peers_connection_reset() -> None:
    state = trained()
    state.facts = summary_facts(b"[rank0]: Traceback (most recent call last):\n[rank0]: " + RESET.encode() + b"\n"
                                + SUMMARY)
    assert state.facts.rank_exits == {1: -9}
    state.facts.rank_exceptions = {0: RESET}
    result = job_result(state, JobExit(1, node_rank=1), config())
    assert (result.status, result.reason, result.exit_code) == ("FAIL", "killed", 137)
    assert (result.extra["rank"], result.extra["signal"], result.extra["node"]) == (1, "SIGKILL", 1)
    assert "rank 1 on node 1 died of SIGKILL" in (result.hint or "") and "Connection reset" not in (result.hint or "")


def test_a_hard_signal_is_named_before_the_launchers_sigterm_of_the_others() -> None:
    text = SUMMARY.replace(b"Failures:\n  <NO_OTHER_FAILURES>", b"Failures:\n[1]:\n  rank      : 0 (local_rank: 0)\n"
                           b"  exitcode  : -15 (pid: 1)\n  error_file: <N/A>")
    facts = summary_facts(text, chunk=5)
    assert facts.rank_exits == {0: -15, 1: -9}
    result = job_result(RunState(facts=facts), JobExit(1), config())
    assert (result.reason, result.extra["rank"], result.extra["signal"]) == ("killed", 1, "SIGKILL")


def test_a_lost_peer_is_a_consequence_and_says_where_to_look() -> None:
    state = trained()
    state.facts.rank_exceptions = {0: RESET}
    result = job_result(state, JobExit(1, node_rank=0), config())
    assert (result.reason, result.exit_code, result.extra["rank"]) == ("crash", 1, 0)
    assert "a consequence, not the cause" in (result.hint or "") and "that node's VERDICT" in (result.hint or "")


def test_a_collective_timeout_names_the_late_rank() -> None:
    state = trained()
    state.facts.ranks_seen = {0, 1, 2}
    waited = "RuntimeError: [gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms for recv operation"
    state.facts.rank_exceptions = {0: waited, 2: waited}
    result = job_result(state, JobExit(1), config())
    assert (result.reason, result.extra["rank"], result.extra["waited"]) == ("crash", 1, 0)
    assert "waiting for rank 1, which never reached it" in (result.hint or "")
    state.facts.rank_exceptions[1] = waited  # every rank here waited: the late one is elsewhere
    result = job_result(state, JobExit(1), config())
    assert result.extra["rank"] == 0 and "on another node" in (result.hint or "")


def test_a_hang_at_teardown_after_the_final_save_is_complete_not_one_to_resume() -> None:
    state = trained(steps=20)
    state.facts.train_end = {"step": 20, "max_steps": 20, "stopped": True}
    state.facts.checkpoints = [{"path": "out/checkpoint-20", "step": 20}]
    state.facts.hang_where = "barrier (distributed_c10d.py:4812)"
    state.outcome = Outcome("FAIL", "stalled", 5, hint="resume")
    result = job_result(state, JobExit(-signal.SIGKILL), config())
    assert (result.status, result.exit_code) == ("PASS", 0)
    assert "hung at teardown in barrier" in result.extra["warning"]
    state.facts.checkpoints = []  # the final model not saved: a stall it stays
    assert job_result(state, JobExit(-signal.SIGKILL), config()).reason == "stalled"


def test_the_launchers_sigterm_of_the_other_ranks_is_never_the_cause() -> None:
    # torch 2.13, --standalone --nproc-per-node 2: rank 0 raised, torchrun sent SIGTERM to rank 1 and lists it too
    text = b"""Failures:
[1]:
  time      : 2026-12-03_17:51:07
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -15 (pid: 13339)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 13339
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-03_17:51:07
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 13338)
  error_file: <N/A>
"""
    facts = summary_facts(text)
    assert facts.rank_exits == {1: -15, 0: 1}
    facts.rank_exceptions = {0: "ValueError: boom"}
    result = job_result(RunState(facts=facts), JobExit(1), config())
    assert (result.reason, result.exit_code, result.extra["rank"]) == ("crash", 1, 0)
    assert "rank 0 raised ValueError: boom" in (result.hint or "")
    alone = summary_facts(text.replace(b"exitcode  : 1 (pid", b"exitcode  : -15 (pid"))  # a SIGTERM from outside
    assert job_result(RunState(facts=alone), JobExit(1), config()).extra["signal"] == "SIGTERM"


def test_a_dcp_save_the_agent_saw_is_no_sign_the_job_answers_checkpoint_requests() -> None:
    """A plain loop's ``dcp.save`` is reported by the agent's hook (``hook: dcp``), not by the job: asking it for a
    checkpoint only waits. Before, two such nodes at the deadline logged "2 ranks: each saves at step 1646" and
    "node 0's deadline: every rank saves at step 1646 and stops" for a loop that never read the request."""
    facts = JobFacts()
    facts.checkpoints.append({"t": "checkpoint_saved", "path": "/o/step_50", "requested": False, "hook": "dcp"})
    assert not facts.answers_checkpoints
    facts.checkpoints.append({"t": "checkpoint_saved", "path": "/o/step_100", "requested": False})  # the job's own
    assert facts.answers_checkpoints


def test_a_trainer_resumed_past_its_max_steps_passes_with_a_warning_not_the_no_loss_hint(
        caplog: pytest.LogCaptureFixture) -> None:
    # TRL's sft.py resumed from checkpoint-4114 with --max_steps 1500 (tried): PASS steps=0, and the log said 'no
    # training loss was seen ... a transformers Trainer is seen automatically', as if the guard had missed it.
    state = RunState()
    state.facts.agents_seen = 1
    state.facts.api_used.add("resume_loaded")
    state.facts.train_end = {"step": 4114, "max_steps": 1500, "stopped": False}
    with caplog.at_level("WARNING", logger="guard"):
        result = job_result(state, JobExit(0), config())
    assert (result.status, result.exit_code) == ("PASS", 0)
    assert "resumed at step 4114, at or past its max_steps 1500" in result.extra["warning"]
    assert "no training loss was seen" not in caplog.text
