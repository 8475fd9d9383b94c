"""From what the supervisor saw to a ``RunResult``: which verdict, which exit code, which hint.

Rules (the contract's table): an outcome the guard decided wins (non-finite loss, stall, dry run, preflight,
deadline, signal). Otherwise the job's own exit decides: 0 is ``PASS ok``; a non-zero exit is ``crash`` with
the job's exit code, or ``oom`` when the job printed a CUDA out-of-memory error or the cgroup's ``oom_kill`` counter
rose during the run (the kernel killed one of its processes, e.g. one torchrun worker, and the launcher exited
non-zero); a death by signal is ``killed`` (128 + n), or ``oom`` when the counter rose, or when it was a SIGKILL and
the job's memory was near the cgroup's limit.
"""

from __future__ import annotations

import logging
import signal
from typing import Any

from guard.run.process import cgroup_memory
from guard.contract import EXIT_GUARD_ERROR, RunResult, signal_name

__all__ = ["job_result"]

log = logging.getLogger("guard.supervisor")

OOM_NEAR_LIMIT = 0.9

NO_LOSS_HINT = (
    "no training loss was seen, so the sanity pass did not run: a transformers Trainer is seen automatically, "
    "a plain PyTorch loop when it calls loss.backward() in the script's process; otherwise call "
    "guard.report(step=..., loss=...) or print lines such as 'loss=2.31'"
)


def _host_oom(sup: Any, *, near_limit: bool = True) -> tuple[bool, str]:
    """Whether the job ran out of host memory: the cgroup's ``oom_kill`` counter rose since the start, or (with
    ``near_limit``) the job's memory was within 10% of the cgroup's limit."""
    start, end = sup.cgroup_start, cgroup_memory()
    if start is not None and end is not None and end.oom_kills > start.oom_kills:
        return True, f"the kernel's OOM killer ran in the job's cgroup ({end.oom_kills - start.oom_kills} kill(s))"
    if not near_limit:
        return False, ""
    limit = end.limit_bytes if end is not None else None
    rss = sup.job.last_rss_bytes if sup.job is not None else 0
    if limit and rss >= OOM_NEAR_LIMIT * limit:
        return True, f"the job used {rss / 1e9:.1f} GB of the container's {limit / 1e9:.1f} GB limit"
    return False, ""


def job_result(sup: Any) -> RunResult:
    """Build the run's result from the supervisor's state (``guard.run.supervisor.Supervisor``)."""
    elapsed_s = sup.clock() - sup.started
    code = sup.job.returncode if sup.job is not None else None
    details: dict[str, Any] = {
        "job_exit_code": code,
        "job_signal": signal_name(-code) if code is not None and code < 0 else None,
        "last_exception": sup.last_exception,
        "loss_source": sup.loss_source,
        "agents_seen": sup.agents_seen,
        "peak_rss_bytes": sup.job.peak_rss_bytes if sup.job is not None else None,
        "checkpoints_reported": [c.get("path") for c in sup.checkpoints][-5:],
    }
    if sup.events.job_verdicts:
        details["job_verdict"] = sup.events.job_verdicts[-1]
    if sup.trainer_config is not None:
        details["trainer_config"] = sup.trainer_config
    if sup.trainer_push is not None:
        details["trainer_push"] = sup.trainer_push
    if not sup.sanity:
        details["sanity_status"] = "no_loss_seen"
    elif sup.sanity_done:
        details["sanity_status"] = "passed"
    else:
        details["sanity_status"] = f"incomplete ({len(sup.sanity)} of {sup.config.sanity_steps} steps)"
    if sup.last_exception and sup.outcome is None:  # after the guard stopped the job, exceptions are its echo
        log.error("the job's last exception: %s", sup.last_exception)

    outcome = sup.outcome
    if outcome is not None:
        result = RunResult(outcome.status, outcome.reason, int(outcome.exit_code or 0), elapsed_s,
                           hint=outcome.hint, extra=dict(outcome.extra))
    elif sup.job is not None and sup.job.status_lost:
        result = RunResult("FAIL", "guard_error", EXIT_GUARD_ERROR, elapsed_s, extra={"job_exit": "unknown"}, hint=(
            "the job's exit status was lost (another process reaped it), so whether it succeeded is unknown: "
            "check its output above"))
    elif code == 0:
        result = RunResult("PASS", "ok", 0, elapsed_s)
    elif code is not None and code > 0:
        host_oom, why = (False, "") if sup.cuda_oom else _host_oom(sup, near_limit=False)
        if sup.cuda_oom:
            result = RunResult("FAIL", "oom", code, elapsed_s, hint=(
                "CUDA out of memory: lower the per-device batch size (keep the effective batch with gradient "
                "accumulation), enable gradient checkpointing, use bf16, or pick a GPU with more memory"))
        elif host_oom:
            result = RunResult("FAIL", "oom", code, elapsed_s, hint=(
                f"out of host memory ({why}): lower DataLoader num_workers or prefetch_factor, stream or shard "
                "the dataset, or ask the platform for more memory"))
        else:
            what = f" after {sup.last_exception}" if sup.last_exception else ""
            result = RunResult("FAIL", "crash", code, elapsed_s, hint=(
                f"the job exited with code {code}{what}: fix the error its traceback shows in the log and rerun"))
    else:
        signum = -(code if code is not None else -signal.SIGKILL)
        oom, why = _host_oom(sup, near_limit=signum == signal.SIGKILL)
        if oom:
            result = RunResult("FAIL", "oom", 128 + signum, elapsed_s, hint=(
                f"out of host memory ({why}): lower DataLoader num_workers or prefetch_factor, stream or shard "
                "the dataset, or ask the platform for more memory"))
        else:
            result = RunResult("FAIL", "killed", 128 + signum, elapsed_s, extra={"signal": signal_name(signum)},
                               hint=(f"the job died of {signal_name(signum)}, not sent by the guard: check the "
                                     "platform's events (OOM killer, eviction, a user's kill)"))
    result.step, result.loss, result.sanity = sup.step, sup.loss, list(sup.sanity)
    if sup.node_rank is not None:
        result.extra.setdefault("node", sup.node_rank)
    if sup.job is not None and sup.job.survivors_left:  # outlived SIGKILL and the bounded wait
        result.extra["survivors"] = ",".join(map(str, sup.job.survivors_left))
        details["survivors"] = [vars(survivor) for survivor in sup.job.survivors_left]
    if sup.job is not None and sup.job.reaped:
        details["orphans_reaped"] = sup.job.reaped
    result.details.update(details)
    if sup.securer is not None:
        sup.securer.finish(sup, result)
    if not sup.sanity and result.status == "PASS":
        log.warning("%s", NO_LOSS_HINT)
    return result
