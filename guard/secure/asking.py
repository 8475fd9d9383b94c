"""What securing asks of the job and reads of its end, through the loop's :class:`~guard.secure.link.JobLink`.

Pure functions of what the loop knows (the agents' facts, the ranks' steps, the job's exit): whether the job can
answer a request to save (:func:`can_save`), the request itself (:func:`save_request`: one step for every rank, the
trigger and the signal named for the other nodes' guards), whether the job trained to its end
(:func:`training_complete`), and how it ended (:func:`job_end`). ``guard.secure.securing.Securing`` sends and feeds
what they say.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from guard.contract import signal_name
from guard.core.state import died_after_training, incomplete_reason
from guard.secure.link import JobLink
from guard.secure.report import PlanReport

__all__ = ["JobEnd", "can_save", "job_end", "save_request", "training_complete"]

log = logging.getLogger("guard.secure")


def can_save(sup: JobLink) -> bool:
    """The job can answer a checkpoint request: a Trainer, or a script that reported a save itself or called
    ``guard.should_checkpoint()`` (``JobFacts.answers_checkpoints``)."""
    if not sup.job_running() or not sup.agents_connected():
        return False
    step = sup.state.progress.step
    # Too early to tell: a Trainer reports itself at on_train_begin, a loop calls should_checkpoint() after its
    # first step's backward (which the agent reports first). Ask; the wait is bounded.
    return step is None or step < 3 or sup.state.facts.answers_checkpoints


def save_request(sup: JobLink, report: PlanReport) -> dict[str, Any]:
    """The ``checkpoint`` command (save, then stop) for every agent, from the plan's ``report`` (its trigger and
    signal): many ranks save at one step ahead of every rank's."""
    request: dict[str, Any] = {"t": "checkpoint", "stop": True}
    if report.trigger == "deadline":  # the other nodes' guards take it as their deadline (guard/run/relay.py)
        request["trigger"] = "deadline"
    ranks = sup.training_ranks()
    world_size = sup.world_size()
    if len(ranks) > 1 or world_size > 1:
        # Collective saves (DDP, FSDP, DeepSpeed) deadlock unless every rank saves at the same step: name a step
        # ahead of every rank (the supervisor hears of steps every --check-every steps at most). Before the first
        # step no rank has reported one: count from 0.
        every = sup.check_every
        ahead = (sup.newest_rank_step() or 0) + 2 * every + 2
        request["at_step"] = ahead
        log.info("%d ranks: each saves at step %d", max(len(ranks), world_size), ahead)
    if report.trigger == "signal" and report.signum is not None:
        # many nodes: the other nodes' agents adopt this request through the job's store; with the signal named
        # they tell their guards (``relayed``), which then say INTERRUPTED too, not PASS for a job that stopped
        request.update(origin=sup.node_rank, signal=signal_name(report.signum))
    return request


def training_complete(sup: JobLink, *, signalled: bool) -> bool:
    """The job trained to its end: a Trainer reached ``max_steps``/its epochs (or ended with no stop asked
    for), a loop ended with no stop delivered to it (no checkpoint request served, no SIGTERM, no signal:
    ``signalled``, a signal the guard forwarded)."""
    facts = sup.state.facts
    end = facts.train_end
    if end is not None:
        step, max_steps = end.get("step"), end.get("max_steps")
        reached = isinstance(step, int) and isinstance(max_steps, int) and 0 < max_steps <= step
        return reached or not end.get("stopped")
    if facts.trainer_config is not None:
        return False  # a Trainer that never said how training ended
    answered = any(message.get("requested") for message in facts.checkpoints)  # saved on the guard's request
    return not (answered or "stop_served" in facts.api_used or signalled or sup.job_stopped())


@dataclass(frozen=True)
class JobEnd:
    """How the job's main process ended, as securing reads it (:func:`job_end`).

    Attributes:
        failure: ``"crash"``, ``"killed"`` or ``"incomplete"``: a failure the plan is told of (watching, no outcome
            decided), else None.
        ok: the job ended well (exit 0, or it died after training), with no outcome but the deadline's decided.
        complete: it trained to its end as well (:func:`training_complete`): the final model is pushed.
    """

    failure: str | None
    ok: bool = False
    complete: bool = False


def job_end(sup: JobLink, *, watching: bool, final_model: bool, signalled: bool) -> JobEnd:
    """Read the job's end from the loop: ``watching``: the plan had not begun securing; ``final_model``: the exit's
    scan found final model files; ``signalled``: the guard forwarded a signal to the job."""
    code = sup.job_exit_code()
    outcome = sup.state.outcome
    completed = died_after_training(sup.state.facts, code, lambda: final_model) is not None
    if watching and outcome is None and code is not None and code != 0 and not completed:
        return JobEnd("crash" if code > 0 else "killed")
    # an exit 0 that is not a finished run: a failure, not a final push
    if watching and outcome is None and code == 0 \
            and incomplete_reason(sup.state.facts, sup.state.progress) is not None:
        return JobEnd("incomplete")
    ok = (code == 0 or completed) and (outcome is None or outcome.reason == "deadline")
    complete = ok and incomplete_reason(sup.state.facts, sup.state.progress) is None \
        and training_complete(sup, signalled=signalled)
    return JobEnd(None, ok, complete)
