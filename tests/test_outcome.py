"""The VERDICT's checkpoint fields from a plan report (``guard.secure.outcome.checkpoint_fields``): a table."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest
from fakes import ckpt

from guard.secure.dest.base import pushed_text
from guard.secure.outcome import Verdict, checkpoint_fields, resume_step_text
from guard.secure.plan import PlanReport, PushView, State


def push(step: int | None, *, kind: str = "securing", ok: bool = True, killed: bool = False) -> PushView:
    info = ckpt(step) if step is not None else None
    return PushView(kind=kind, path=str(info.path) if info else None, step=step, info=info, running=False, ok=ok,
                    killed=killed, pushed="hf://alice/run@abc" if ok else None, destination="hf://alice/run",
                    files=2, size_bytes=1000, elapsed_s=1.0, attempts=1, error=None if ok else "push failed",
                    hint=None)


def report(**kw: Any) -> PlanReport:
    base = PlanReport(state=State.DONE, trigger=None, failure_reason=None, signum=None, secure_by=math.inf,
                      deadline_at=None, secured=None, newest=None, suspect=None, suspects=(),
                      non_finite_from_step=None, final=None, error=None, history=(), has_pusher=True,
                      training_complete=False, superseded_trigger=None, final_wanted=False, ignored=())
    return replace(base, **kw)


TIMEOUT = Verdict("TIMEOUT", "deadline", 0)
SIGNAL = Verdict("INTERRUPTED", "signal", 0, signal="SIGTERM")
CRASH = Verdict("FAIL", "crash", 1, hint="fix it")

ROWS = [
    # (name, report, verdict, step) -> (status, exit, secured, checkpoint, hint fragment)
    ("deadline, secured", report(trigger="deadline", secured=push(40), newest=ckpt(40)), TIMEOUT, 45,
     ("TIMEOUT", 75, "yes", "/out/checkpoint-40", "resumes from step 40; the 5 steps")),
    ("deadline, nothing secured", report(trigger="deadline", newest=ckpt(40)), TIMEOUT, 45,
     ("TIMEOUT", 124, "no", None, "raise --margin")),
    ("signal, secured", report(trigger="signal", signum=15, secured=push(7), newest=ckpt(7)), SIGNAL, 7,
     ("INTERRUPTED", 75, "yes", "/out/checkpoint-7", "resumes from step 7")),
    ("signal, nothing secured", report(trigger="signal", signum=15, newest=ckpt(7)), SIGNAL, 7,
     ("INTERRUPTED", 143, "no", None, "within --grace")),
    ("NaN after the request: older one secured, the verdict says non-finite",
     report(trigger="deadline", secured=push(50), newest=ckpt(50), suspect=ckpt(1032), suspects=(ckpt(1032),),
            non_finite_from_step=1030), TIMEOUT, 1032,
     ("TIMEOUT", 75, "yes", "/out/checkpoint-50", "the loss went non-finite at step 1030")),
    ("NaN after the request, nothing good secured",
     report(trigger="deadline", suspect=ckpt(1032), suspects=(ckpt(1032),), non_finite_from_step=1030), TIMEOUT,
     1032, ("TIMEOUT", 124, "no", None, "non-finite at step 1030")),
    ("finished inside the margin: PASS with the final push",
     report(trigger=None, superseded_trigger="deadline", training_complete=True, final_wanted=True,
            final=push(None, kind="final"), secured=push(200), newest=ckpt(200)), TIMEOUT, 280,
     ("PASS", 0, None, "/out/checkpoint-200", None)),
    ("finished, the final push failed", report(training_complete=True, final=push(None, kind="final", ok=False)),
     Verdict("PASS", "ok", 0), 10, ("FAIL", 6, "no", None, None)),
    ("finished, no time left to start the final push", report(training_complete=True, final_wanted=True,
                                                             superseded_trigger="deadline"), TIMEOUT, 10,
     ("FAIL", 6, "no", None, "no time was left to push its final model")),
    ("crash, secured before it", report(trigger="failure", failure_reason="crash", secured=push(30),
                                        newest=ckpt(30)), CRASH, 35,
     ("FAIL", 1, "yes", "/out/checkpoint-30", "secured before the failure: step 30")),
    ("no destination: the newest local one is named", report(trigger="failure", has_pusher=False,
                                                             newest=ckpt(3)), CRASH, 5,
     ("FAIL", 1, "no", "/out/checkpoint-3", "fix it")),
]


@pytest.mark.parametrize(("name", "plan_report", "verdict", "step", "expected"), ROWS, ids=[r[0] for r in ROWS])
def test_checkpoint_fields(name: str, plan_report: PlanReport, verdict: Verdict, step: int,
                           expected: tuple[str, int, str | None, str | None, str | None]) -> None:
    status, code, secured, checkpoint, hint = expected
    fields = checkpoint_fields(plan_report, verdict, step=step, nothing_found_hint="nothing found")
    assert (fields.verdict.status, fields.verdict.exit_code) == (status, code)
    assert fields.extra.get("secured") == secured
    assert fields.extra.get("checkpoint") == checkpoint
    # secured_step= (contract: the step of the checkpoint secured) is there exactly when secured=yes
    secured_push = plan_report.secured
    expected_step = secured_push.step if secured == "yes" and secured_push is not None else None
    assert fields.extra.get("secured_step") == expected_step
    if hint is not None:
        assert hint in (fields.verdict.hint or "")


def test_secured_never_names_a_suspect_save() -> None:
    # a report never carries a suspect as secured; the function names what the report says, and only that
    fields = checkpoint_fields(report(trigger="deadline", suspect=ckpt(9), suspects=(ckpt(9),),
                                      non_finite_from_step=9, newest=ckpt(8)), TIMEOUT, step=9,
                               nothing_found_hint="")
    assert fields.extra.get("checkpoint") is None and fields.extra["secured"] == "no"
    assert fields.details["suspect_checkpoint"] == "/out/checkpoint-9"


def test_the_hint_speaks_of_the_step_the_checkpoint_records() -> None:
    # nanoGPT's ckpt.pt records a 0-based iter_num; the guard counts steps from 1 (issue 21)
    info = replace(ckpt(100), recorded=("iter_num", 99))
    secured = replace(push(100), info=info)
    fields = checkpoint_fields(report(trigger="deadline", secured=secured, newest=info), TIMEOUT, step=100,
                               nothing_found_hint="nothing found")
    assert "resumes from step 99 (its iter_num; step 100 of the guard's count)" in (fields.verdict.hint or "")
    crash = checkpoint_fields(report(trigger="failure", failure_reason="crash", secured=secured, newest=info), CRASH,
                              step=103, nothing_found_hint="nothing found")
    assert "secured before the failure: step 99 (its iter_num" in (crash.verdict.hint or "")


def test_a_recorded_field_named_step_is_not_named_twice() -> None:
    # a loop's own {"step": N} in its ckpt.pt: "step 250 (its step)" said nothing to a new user
    own = replace(ckpt(250), recorded=("step", 250))
    assert resume_step_text(own, 250) == "step 250"
    assert resume_step_text(own, None) == "step 250"
    behind = replace(ckpt(250), recorded=("step", 249))
    assert resume_step_text(behind, 250) == "step 249 (step 250 of the guard's count)"


def test_a_torch_save_dict_tells_its_own_step(tmp_path) -> None:
    import torch

    from guard.secure.checkpoints import describe
    from guard.secure.formats import recorded_step

    path = tmp_path / "ckpt.pt"
    torch.save({"model": torch.nn.Linear(2, 1).state_dict(), "iter_num": 99, "best_val_loss": 1.5}, path)
    assert recorded_step(path) == ("iter_num", 99)
    assert describe(path, step=100).recorded == ("iter_num", 99)
    torch.save({"model": {}}, path)
    assert recorded_step(path) is None
    (tmp_path / "raw.pt").write_bytes(b"PK\x03\x04 not a zip")
    assert recorded_step(tmp_path / "raw.pt") is None


@pytest.mark.parametrize(("destination", "revision", "pushed"), [
    ("/data/dest", "/data/dest/last-checkpoint", "/data/dest/last-checkpoint"),  # a folder: the folder written
    ("/data/dest", "/data/dest", "/data/dest"),  # a folder's final model: DEST itself
    ("hf://acme/run", "3f2a9c1e", "hf://acme/run@3f2a9c1e"),
    ("s3://bucket/run", "0123abcd", "s3://bucket/run@0123abcd"),
])
def test_pushed_names_the_folder_written_or_dest_at_revision(destination: str, revision: str, pushed: str) -> None:
    """``pushed=`` as the contract says it: DEST@REVISION for the Hub and S3, the folder written for a folder, in
    the VERDICT and in the guard's own lines alike (they said ``DEST@DEST/last-checkpoint`` before)."""
    assert pushed_text(destination, revision) == pushed
