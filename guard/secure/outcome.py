"""The VERDICT's checkpoint fields from the plan's snapshot: one pure function, :func:`checkpoint_fields`, and
:func:`fill`, which writes them into the run's result.

``checkpoint=`` (the secured checkpoint), ``pushed=`` (``DEST@REVISION``), ``secured=`` (``yes``/``no``), the exit
code of a deadline or signal (75 when secured, ``CONTRACT.md`` "Secured checkpoints") and the hint's "resumes from
step N" are computed from a ``plan.PlanReport`` and the result as the run left it; nothing here reads a plan, a
process or the disk.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from guard.contract import (
    EXIT_NON_FINITE,
    EXIT_PUSH_FAILED,
    EXIT_SECURED,
    EXIT_TIMEOUT_UNSECURED,
    RunResult,
    signal_name,
)
from guard.secure.checkpoints import CheckpointInfo
from guard.secure.layout import nothing_found_hint
from guard.secure.report import PlanReport, PushView
from guard.secure.restoring import held_said

__all__ = ["Fields", "Verdict", "checkpoint_fields", "fill", "leader_missing", "missing_said", "resume_step_text"]


@dataclass(frozen=True)
class Verdict:
    """The result's fields that securing may change: ``status``, ``reason``, ``exit_code``, ``hint``, and
    ``signal`` (the VERDICT key, or None)."""

    status: str
    reason: str
    exit_code: int
    hint: str | None = None
    signal: str | None = None


@dataclass(frozen=True)
class Fields:
    """What :func:`checkpoint_fields` decided: the new ``verdict``, the VERDICT keys to set (``extra``:
    ``checkpoint``, ``pushed``, ``secured``) and the JSON details (``details``)."""

    verdict: Verdict
    extra: dict[str, Any] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)


def _view(push: PushView) -> dict[str, Any]:
    return {"kind": push.kind, "step": push.step, "ok": push.ok, "error": push.error}


def resume_step_text(info: CheckpointInfo | None, step: int | None) -> str:
    """``"step N"`` for the hints: the step the checkpoint records itself when it records one
    (``CheckpointInfo.recorded``: nanoGPT's 0-based ``iter_num`` in ``ckpt.pt``), with the guard's own count beside it
    when they differ (``"step 99 (its iter_num; step 100 of the guard's count)"``); else the guard's ``step``
    (``global_step`` of ``trainer_state.json`` for a Trainer); ``"step ?"`` when neither is known."""
    recorded = info.recorded if info is not None else None
    if recorded is None:
        return f"step {step if step is not None else '?'}"
    key, value = recorded
    if key == "step":  # the checkpoint's own field named "step": "(its step)" would say nothing
        return f"step {value}" if step is None or step == value else f"step {value} (step {step} of the guard's count)"
    if step is None or step == value:
        return f"step {value} (its {key})"
    return f"step {value} (its {key}; step {step} of the guard's count)"


def checkpoint_fields(report: PlanReport, verdict: Verdict, *, step: int | None, nothing_found_hint: str,
                      follower: bool = False) -> Fields:
    """The VERDICT's checkpoint fields for ``report`` (pure).

    Args:
        report: ``Plan.report()`` at the end of the run.
        verdict: the result as the run left it (the outcome the guard decided, or the job's exit).
        step: the job's last training step (the steps lost after the secured checkpoint), or None.
        nothing_found_hint: the hint when no checkpoint was found at all (``layout.nothing_found_hint``).
        follower: this guard follows node 0's (it secures nothing itself).

    Returns:
        :class:`Fields`: a ``PASS`` for a training that completed even after the deadline's request; exit 75 for a
        deadline or signal with a secured checkpoint; ``secured=`` never names a suspect save; a non-finite loss
        heard after the outcome was decided is said in the hint; a ``PASS`` whose saved weights a push found not
        finite (the loss stayed finite) is ``FAIL non_finite_loss`` (exit 4), its hint naming the file and tensor.
    """
    extra: dict[str, Any] = {}
    details: dict[str, Any] = {"pushes": [_view(p) for p in report.history]}
    status, reason, code, hint, sig = verdict.status, verdict.reason, verdict.exit_code, verdict.hint, verdict.signal
    secured = report.secured
    newest = report.newest
    if secured is not None:
        extra["checkpoint"] = secured.path
        extra["pushed"] = secured.pushed
        details["push"] = {"files": secured.files, "size_bytes": secured.size_bytes,
                           "elapsed_s": round(secured.elapsed_s, 3), "attempts": secured.attempts,
                           "step": secured.step}
    elif newest is not None and not report.has_pusher:
        extra["checkpoint"] = str(newest.path)  # no destination: the newest complete local one is what there is
    if newest is not None:
        details["newest_checkpoint"] = str(newest.path)
    if report.suspects:
        details["suspect_checkpoint"] = str(report.suspects[-1].path)
        details["suspect_checkpoints"] = [str(s.path) for s in report.suspects]
    bad = report.non_finite_from_step
    if bad is not None:
        details["non_finite_from_step"] = bad
    held = report.suspect_held
    held_clause = held_said(held.step, held.path) if held is not None else None
    if held is not None:  # the destination's record names a suspect save: never said to be secured
        details["suspect_at_destination"] = {"step": held.step, "path": held.path, "pushed": held.pushed}
    if report.training_complete and status in ("TIMEOUT", "PASS"):
        status, reason, code = "PASS", "ok", 0
        if report.superseded_trigger == "deadline":
            details["finished_before_deadline"] = True
            if hint and "margin" in hint:
                hint = None
    trigger = report.trigger
    refused = next((p for p in reversed(report.history) if p.not_finite), None)
    if bad is not None and status == "PASS":
        # the loss stayed finite but a push read non-finite saved weights (guard.secure.weights): a failure as at a
        # non-finite loss, with what was secured before it
        status, reason, code, trigger = "FAIL", "non_finite_loss", EXIT_NON_FINITE, "failure"
        hint = f"the saved weights went non-finite while the loss stayed finite: {refused.error}" \
            if refused is not None and refused.error else \
            f"the saved weights went non-finite at step {bad} while the loss was finite"
    elif report.failure_reason == "non_finite_loss" and status == "PASS" and refused is not None:
        status, reason, code = "FAIL", "non_finite_loss", EXIT_NON_FINITE  # the final model's weights
        hint = f"the saved weights went non-finite while the loss stayed finite: {refused.error}" \
            if refused.error else None

    def done(hint_text: str | None) -> Fields:
        if bad is not None and reason != "non_finite_loss":
            said = f"the loss went non-finite at step {bad}: saves from then on were not secured"
            hint_text = f"{said}; {hint_text}" if hint_text else said
        if held_clause is not None:
            hint_text = f"{hint_text}; {held_clause}" if hint_text else held_clause
        return Fields(Verdict(status, reason, code, hint_text, sig), extra, details)

    final = report.final
    if final is not None and not (final.not_finite and reason == "non_finite_loss"):
        if final.ok:
            extra["pushed"] = final.pushed
            details["final_push"] = {"files": final.files, "size_bytes": final.size_bytes,
                                     "elapsed_s": round(final.elapsed_s, 3)}
            return done(hint)
        if status != "PASS":
            return done(hint)
        if report.signum is not None and (final.running or final.killed):
            status, reason, code = "INTERRUPTED", "signal", 128 + report.signum
            sig = signal_name(report.signum)
            extra["secured"] = "no"
            return done("the job finished but a signal ended the final model's push within --grace: push it again")
        status, reason, code = "FAIL", "push_failed", EXIT_PUSH_FAILED
        extra["secured"] = "no"
        return done(final.hint or "the final model could not be secured; it is still in the output folder")
    if report.final_wanted and status == "PASS":  # the running push took the time the final model needed
        status, reason, code = "FAIL", "push_failed", EXIT_PUSH_FAILED
        extra["secured"] = "no"
        return done("the job finished, but no time was left to push its final model (it is still in the output "
                    "folder): push it again")
    if trigger == "ended":  # ended well without final model files: its newest checkpoint was secured
        if secured is None and newest is not None and status == "PASS":
            failed = next((p for p in reversed(report.history) if not p.running), None)
            status, reason, code = "FAIL", "push_failed", EXIT_PUSH_FAILED
            extra["secured"] = "no"
            return done(failed.hint if failed is not None and failed.hint else
                        "the job's newest checkpoint could not be secured; it is still in the output folder")
        return done(hint)
    if trigger is None or (not report.has_pusher and trigger == "failure"):
        if trigger == "failure" and extra.get("checkpoint"):
            extra["secured"] = "no"
        return done(hint)
    extra["secured"] = "yes" if secured is not None else "no"
    if secured is not None and secured.step is not None:
        extra["secured_step"] = secured.step
    unwhole = next((p for p in reversed(report.history) if not p.running and p.kind != "final"), None)
    if unwhole is not None and unwhole.missing and (secured is None or (secured.step or -1) < (unwhole.step or -1)):
        extra["missing"] = unwhole.missing  # the newest checkpoint is not whole at the destination (many nodes)
        details["missing"] = {"step": unwhole.step, "what": unwhole.missing, "error": unwhole.error}
        said = missing_said(unwhole.step, unwhole.missing)
        hint = f"{said}; {hint}" if hint else said
    steps_lost = 0
    lost = ""
    if secured is not None and secured.step is not None and step is not None and step > secured.step:
        steps_lost = step - secured.step
        lost = f"; the {steps_lost} steps after step {secured.step} are lost"
    if trigger == "failure":
        if steps_lost:
            details["steps_lost"] = steps_lost
        if report.suspect is not None:
            later = f" (step {report.suspect.step})" if report.suspect.step is not None else ""
            suspect = report.suspect
            recorded = any(p.pushed and p.kind != "restore" and p.step == suspect.step and p.path == str(suspect.path)
                           for p in report.history)
            fate = ("was pushed before that loss was read" + ("" if held is not None else
                                                              "; the destination's record was moved back")
                    if recorded else "was not pushed")
            hint = (hint or "") + (f" (the save of {suspect.path}{later}, saved at or after the step before the "
                                   f"first non-finite loss, {fate})")
        if secured is not None:
            step_text = resume_step_text(secured.info, secured.step) if secured.step is not None else "it"
            hint = (hint or "") + (f"; secured before the failure: {step_text}, resume with --resume on --push-to "
                                   f"{secured.destination}")
        if held_clause is not None:
            hint = f"{hint}; {held_clause}" if hint else held_clause
        return Fields(Verdict(status, reason, code, hint, sig), extra, details)
    if trigger == "deadline":
        code = EXIT_SECURED if secured is not None else EXIT_TIMEOUT_UNSECURED
        if secured is None:
            hint = (nothing_found_hint if not report.has_pusher or newest is None else
                    "the checkpoint was not secured before the deadline: raise --margin, or check the destination's "
                    "upload speed")
    else:
        signum = report.signum or signal.SIGTERM
        code = EXIT_SECURED if secured is not None else 128 + signum
        if secured is None:
            hint = (nothing_found_hint if newest is None and report.has_pusher else
                    "no checkpoint was secured within --grace: save more often or raise --grace")
    if secured is not None:
        hint = (f"the next run resumes from {resume_step_text(secured.info, secured.step)}{lost}: "
                f"jobguard --resume on --push-to {secured.destination} ...")
    elif follower:
        hint = "the guard of node 0 secures the checkpoint of every rank: see its VERDICT"
    if "missing" in extra and said not in (hint or ""):
        hint = f"{said}; {hint}" if hint else said
    return done(hint)


def missing_said(step: int | None, missing: str) -> str:
    """The hint's clause on a many-node checkpoint not whole at the destination (``missing``: the VERDICT's
    ``missing=`` value)."""
    return f"checkpoint step {step} is not whole at the destination, missing {missing}: see that node's VERDICT"


def leader_missing(extra: dict[str, Any], details: dict[str, Any], hint: str | None, *, step: int | None,
                   leader: int = 0) -> str | None:
    """Many nodes, a node other than ``leader`` (node 0) whose job failed (:func:`fill`: a lost peer, maybe
    node 0 lost): it holds its part of ``step`` (the newest it saved) and ``leader`` never put its own part of it,
    so that step is not whole at the destination. Sets
    ``missing=node<leader>`` (``details["missing"]`` with ``seen: "held"`` and the clause, ``said``) unless the
    VERDICT says no checkpoint fields, says a missing node already, or secured that step or a later one; returns
    the hint with the clause on it first (``hint`` unchanged when nothing is set). The clause says why: node 0
    leads the steps (``follow``), and a node lost whole, its guard too, leaves no VERDICT of its own."""
    secured_step = extra.get("secured_step")
    if step is None or "secured" not in extra or "missing" in extra \
            or (isinstance(secured_step, int) and step <= secured_step):
        return hint
    what = f"node{leader}"
    said = (f"checkpoint step {step} is not whole at the destination, missing {what}: node {leader} put no part of "
            f"it (this node's part is on its disk), and node {leader} leads the steps: if it was lost (every process "
            "of it gone, its guard too), no VERDICT of its says why")
    extra["missing"] = what
    details["missing"] = {"step": step, "what": what, "seen": "held", "said": said}
    return f"{said}; {hint}" if hint else said


def fill(result: RunResult, report: PlanReport, *, step: int | None, output_dir: str | None,
         destination_given: bool, holds_files: bool | None, follower: bool,
         unled_step: Callable[[], int | None] | None = None) -> None:
    """Fill ``result``'s checkpoint fields, and its exit code for TIMEOUT/INTERRUPTED (75 when secured), from the
    plan's ``report`` (:func:`checkpoint_fields`); ``result`` is changed in place.

    Args:
        step: the job's last training step (the steps lost after the secured checkpoint), or None.
        output_dir: the run's output folder, or None. destination_given: a destination was known (or a signal
            ended the run). holds_files: the exit's scan found files in the output folder (None: it did not answer).
        follower: node 0's guard asked for the checkpoint (``Fields``' hint names it).
        unled_step: many nodes, a node other than 0 that followed node 0's steps: ``() -> step``, the newest step
            this node holds a part of that node 0 never put (:func:`leader_missing`); None otherwise.
    """
    # the exit's scan said whether the output folder holds any file; not looked at here (a hung mount): when it
    # did not answer, the hint names what the guard recognises
    nothing = nothing_found_hint(output_dir=output_dir, destination_given=destination_given,
                                 holds_files=holds_files is not False, step=step)
    fields = checkpoint_fields(report, Verdict(result.status, result.reason, result.exit_code, result.hint,
                                               result.extra.get("signal")),
                               step=step, nothing_found_hint=nothing, follower=follower)
    verdict = fields.verdict
    result.status, result.reason, result.exit_code, result.hint = (verdict.status, verdict.reason,
                                                                   verdict.exit_code, verdict.hint)
    if verdict.signal is not None:
        result.extra["signal"] = verdict.signal
    elif verdict.status == "PASS":
        result.extra.pop("signal", None)
    result.extra.update(fields.extra)
    result.details.update(fields.details)
    # node 0's part of this node's newest never came, and the job failed (a lost node 0 fails the others' ranks
    # on their peer): at a deadline or a signal node 0 is there and chose the step (its record and the end's
    # listing say which), and a newer part held here is no news (before, a plain DCP loop on two nodes at the
    # deadline: node 0 secured_step=1400, node 1 the same with missing=node0 of step 1500)
    if unled_step is not None and result.status == "FAIL":
        result.hint = leader_missing(result.extra, result.details, result.hint, step=unled_step())
