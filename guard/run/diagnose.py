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
import math
import os
import shutil
import signal
from typing import Any

from guard.run.config import guard_options_in
from guard.run.process import cgroup_memory
from guard.contract import EXIT_GUARD_ERROR, EXIT_INCOMPLETE, RunResult, signal_name

__all__ = ["cause_hint", "job_result"]

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


_SHM = ("shared memory", "(shm)", "/dev/shm", "shm_open")
_DISK_FULL = ("No space left on device", "ENOSPC", "Errno 28", "unexpected pos", "file write failed",
              "Disk quota exceeded")


def _free_text(folder: str) -> str:
    try:
        usage = shutil.disk_usage(folder)
    except OSError:
        return f"{folder} (free space unknown)"
    return f"{_size(usage.free)} free of {_size(usage.total)} in {folder}"


def _size(size_bytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size_bytes >= scale:
            return f"{size_bytes / scale:.1f} {unit}"
    return f"{int(size_bytes)} bytes"


def _output_folder(sup: Any) -> str:
    """The job's output folder (the guard's ``--output-dir``, the Trainer's ``output_dir``), else its working
    directory."""
    securer = getattr(sup, "securer", None)
    for folder in (getattr(securer, "output_dir", None), (sup.trainer_config or {}).get("output_dir"),
                   sup.config.values.get("output_dir")):
        if folder:
            return str(folder)
    return os.getcwd()


def cause_hint(sup: Any, code: int) -> str:
    """The crash hint, naming the root cause: a DataLoader worker out of shared memory, a full disk (with the
    output folder's free space), else the innermost error of the chain."""
    last, root = sup.last_exception, getattr(sup, "root_exception", None)
    seen = " | ".join(text for text in (root, last) if text)

    def which(markers: tuple[str, ...]) -> str:
        return next((t for t in (root, last) if t and any(m in t for m in markers)), seen)

    if any(marker in seen for marker in _SHM):
        shm = _free_text("/dev/shm") if os.path.isdir("/dev/shm") else "no /dev/shm"
        return (f"the DataLoader workers ran out of shared memory ({which(_SHM)}; {shm}): give the container more "
                "(docker run --shm-size=8g; Kubernetes: an emptyDir with medium Memory on /dev/shm) or lower "
                "num_workers (0 loads in the main process)")
    if any(marker in seen for marker in _DISK_FULL):
        return (f"the disk is full ({which(_DISK_FULL)}; {_free_text(_output_folder(sup))}): free space, write the "
                "output elsewhere, or keep fewer checkpoints (save_total_limit)")
    if root and last and root != last:
        return (f"the job exited with code {code} after {root} (the root cause, behind {last}): fix it and rerun")
    what = f" after {last}" if last else ""
    return f"the job exited with code {code}{what}: fix the error its traceback shows in the log and rerun"


def incomplete_reason(sup: Any) -> str | None:
    """Why an exit 0 is not a finished run (the hint), or None: ``Trainer.train()`` raised and the script went on,
    or training ended before ``max_steps`` with no stop asked for (a callback's ``should_training_stop``, the
    guard's own request)."""
    error, end = getattr(sup, "train_error", None), getattr(sup, "train_end", None)
    if error is not None:
        what = error.get("root") or f"{error.get('exc_type')}: {error.get('message')}"
        where = f" at step {error.get('step')} of {error.get('max_steps')}" if error.get("step") is not None else ""
        return (f"Trainer.train() raised {what}{where}, and the script caught it and exited 0: fix that error "
                "(or let it propagate, so that the run fails visibly)")
    if end is not None and not end.get("stopped"):
        step, max_steps = end.get("step"), end.get("max_steps")
        if isinstance(step, int) and isinstance(max_steps, int) and 0 < max_steps and step < max_steps:
            return (f"training ended at step {step} of {max_steps} with no stop asked for (no callback set "
                    "should_training_stop): check that the dataset yields enough batches for max_steps")
    return None


def job_result(sup: Any) -> RunResult:
    """Build the run's result from the supervisor's state (``guard.run.supervisor.Supervisor``)."""
    elapsed_s = sup.clock() - sup.started
    code = sup.job.returncode if sup.job is not None else None
    details: dict[str, Any] = {
        "job_exit_code": code,
        "job_signal": signal_name(-code) if code is not None and code < 0 else None,
        "last_exception": sup.last_exception,
        "root_exception": getattr(sup, "root_exception", None),
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
    # After the guard stopped the job, exceptions are its echo; on an exit 0 the job caught it itself (it is the
    # job's error only when it cut training short: ``incomplete`` says so in its hint).
    if sup.last_exception and sup.outcome is None:
        log.log(logging.ERROR if code != 0 else logging.DEBUG, "the job's last exception: %s", sup.last_exception)

    outcome = sup.outcome
    if outcome is not None:
        result = RunResult(outcome.status, outcome.reason, int(outcome.exit_code or 0), elapsed_s,
                           hint=outcome.hint, extra=dict(outcome.extra))
    elif sup.job is not None and sup.job.status_lost:
        result = RunResult("FAIL", "guard_error", EXIT_GUARD_ERROR, elapsed_s, extra={"job_exit": "unknown"}, hint=(
            "the job's exit status was lost (another process reaped it), so whether it succeeded is unknown: "
            "check its output above"))
    elif code == 0 and (why := incomplete_reason(sup)) is not None:
        log.error("the job exited 0, but its run is incomplete: %s", why)
        result = RunResult("FAIL", "incomplete", EXIT_INCOMPLETE, elapsed_s, hint=why)
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
        elif code == 2 and not sup.last_exception and (misplaced := guard_options_in(sup.config.script_args)):
            # argparse's exit status for a usage error: the job refused an option meant for the guard
            result = RunResult("FAIL", "crash", code, elapsed_s, hint=(
                f"the job exited with code 2 (a usage error) and its arguments hold {', '.join(misplaced)}, a guard "
                f"option: guard options go before the script (python -m guard {misplaced[0]} ... train.py ...)"))
        else:
            result = RunResult("FAIL", "crash", code, elapsed_s, hint=cause_hint(sup, code))
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
    exploded = getattr(sup, "exploded", None)
    if exploded is not None and result.reason not in ("usage", "preflight"):
        said = (f"the loss exploded to {exploded['loss']:.6g} at step {exploded['step']} from about "
                f"{exploded['early']:.4g} in the first steps (lower the learning rate, add warmup or clip gradients)")
        result.hint = f"{said}; then: {result.hint}" if result.hint else said
    result.step, result.loss, result.sanity = sup.step, sup.loss, list(sup.sanity)
    if result.reason == "non_finite_loss" and result.loss is not None and math.isfinite(result.loss):
        result.loss = None  # a finite loss never stands on a non_finite_loss verdict (a later step's echo)
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
