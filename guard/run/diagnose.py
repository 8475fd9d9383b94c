"""From what the supervisor saw to a ``RunResult``: which verdict, which exit code, which hint.

Rules (the contract's table): an outcome the guard decided wins (non-finite loss, stall, dry run, preflight,
deadline, signal). Otherwise the job's own exit decides: 0 is ``PASS ok``; a non-zero exit is ``crash`` with
the job's exit code, or ``oom`` when the job printed a CUDA out-of-memory error or the cgroup's ``oom_kill`` counter
rose during the run (the kernel killed one of its processes, e.g. one torchrun worker, and the launcher exited
non-zero); a death by signal is ``killed`` (128 + n), or ``oom`` when the counter rose, or when it was a SIGKILL and
the job's memory was near the cgroup's limit.

This runs after the loop, on the way to the VERDICT: its few file system calls (the final model's listing, the
ranks' error files, the free space of the output folder) are bounded (``core.helpers.call_bounded``,
``FS_BOUND_S`` each), so that a hung mount delays the VERDICT, never withholds it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from guard.contract import EXIT_GUARD_ERROR, EXIT_INCOMPLETE, RunResult, signal_name
from guard.core.helpers import call_bounded
from guard.core.state import JobFacts, RunState, died_after_training, incomplete_reason
from guard.run.causes import is_peer_lost, is_timeout, late_ranks, peer_hint, signal_hint, signalled_rank, timeout_hint
from guard.run.config import RunSettings, guard_options_in
from guard.run.output import add_worker_deaths
from guard.run.process import CgroupMemory, JobProcess, Survivor, cgroup_memory
from guard.run.watchdog import flat_loss_text

if TYPE_CHECKING:
    from guard.secure.securing import Securing

__all__ = ["JobExit", "cause_hint", "died_after_training", "incomplete_reason", "job_result", "rank_failure"]

log = logging.getLogger("guard.supervisor")

OOM_NEAR_LIMIT = 0.9
FS_BOUND_S = 5.0  # how long one file system call on the way to the VERDICT may take (a hung mount: skipped)

NO_LOSS_HINT = (
    "no training loss was seen, so the sanity pass did not run: a transformers Trainer is seen automatically, "
    "a plain PyTorch loop when it calls loss.backward() in the script's process; otherwise call "
    "guard.report(step=..., loss=...) or print lines such as 'loss=2.31'"
)


@dataclass(frozen=True)
class JobExit:
    """How the job's processes ended, as the loop saw them (``guard.run.process.JobProcess``).

    Attributes:
        returncode: the job's exit code (negative: the signal that killed it), or None if it never ended.
        status_lost: its exit status could not be read (another process reaped it).
        peak_rss_bytes, last_rss_bytes: the job tree's resident memory, highest and last sampled.
        survivors: processes still there after SIGKILL and the bounded wait.
        orphans_reaped: orphaned processes of the job the guard reaped.
        cgroup_start: the cgroup's memory figures at the start (its ``oom_kill`` counter), or None.
        elapsed_s: seconds from the start to the end.
        node_rank: this machine's node rank, or None.
        peak_rss_by_pid: each process's highest sampled resident memory (bytes), by pid.
    """

    returncode: int | None
    status_lost: bool = False
    peak_rss_bytes: int | None = None
    last_rss_bytes: int = 0
    survivors: list[Survivor] = field(default_factory=list)
    orphans_reaped: int = 0
    cgroup_start: CgroupMemory | None = None
    elapsed_s: float = 0.0
    node_rank: int | None = None
    peak_rss_by_pid: dict[int, int] = field(default_factory=dict)

    @classmethod
    def of(cls, job: JobProcess, *, cgroup_start: CgroupMemory | None, elapsed_s: float,
           node_rank: int | None) -> JobExit:
        """What ``job`` (the loop's process tree, ended or abandoned) shows at the end of the run."""
        return cls(returncode=job.returncode, status_lost=job.status_lost, peak_rss_bytes=job.peak_rss_bytes,
                   last_rss_bytes=job.last_rss_bytes, survivors=list(job.survivors_left),
                   peak_rss_by_pid=dict(job.peak_rss_by_pid), orphans_reaped=job.reaped,
                   cgroup_start=cgroup_start, elapsed_s=elapsed_s, node_rank=node_rank)


def _host_oom(ended: JobExit, *, near_limit: bool = True) -> tuple[bool, str]:
    """Whether the job ran out of host memory: the cgroup's ``oom_kill`` counter rose since the start, or (with
    ``near_limit``) the job's memory was within 10% of the cgroup's limit."""
    start, end = ended.cgroup_start, cgroup_memory()
    if start is not None and end is not None and end.oom_kills > start.oom_kills:
        return True, f"the kernel's OOM killer ran in the job's cgroup ({end.oom_kills - start.oom_kills} kill(s))"
    if not near_limit:
        return False, ""
    limit = end.limit_bytes if end is not None else None
    rss = ended.last_rss_bytes
    if limit and rss >= OOM_NEAR_LIMIT * limit:
        return True, f"the job used {rss / 1e9:.1f} GB of the container's {limit / 1e9:.1f} GB limit"
    return False, ""


#: A DataLoader worker SIGKILLed while holding at least this much (or while the largest process of the job) was the
#: kernel OOM killer's pick: it kills the process with the highest ``oom_score``, which follows its resident memory
#: (Linux, Documentation/filesystems/proc.rst, "oom_score").
WORKER_HIGH_RSS_BYTES = 1 << 30


def _worker_death(facts: JobFacts, ended: JobExit) -> tuple[str, str] | None:
    """A DataLoader worker that torch said died, as ``(reason, hint)``: ``oom`` when it was SIGKILLed and the
    evidence says memory (the cgroup's OOM kill counter rose; it held ``WORKER_HIGH_RSS_BYTES`` or more, or the
    most of any process of the job), else ``crash`` naming the worker's signal (not the socket error its death left
    in the main process). None when no worker died, or it died of SIGBUS (shared memory: ``cause_hint`` says so)."""
    deaths = dict(facts.worker_deaths)
    for text in (facts.last_exception, facts.root_exception):
        if text:
            add_worker_deaths(deaths, text)
    if not deaths:
        return None
    pid, how = next(((p, h) for p, h in deaths.items() if h == "Killed"), next(iter(deaths.items())))
    if how is not None and ("Bus error" in how or how.startswith("Bus")):
        return None
    by_pid = ended.peak_rss_by_pid
    rss = by_pid.get(pid)
    peak = f"; the job's peak {_size(ended.peak_rss_bytes)}" if ended.peak_rss_bytes else ""
    held = f" holding {_size(rss)} resident{peak}" if rss else ""
    sent = "SIGKILL" if how == "Killed" else how or "an unknown cause"
    what = f"a DataLoader worker (pid {pid}) was killed by {sent}"
    if how == "Killed":
        counter, why = _host_oom(ended, near_limit=False)
        largest = rss is not None and rss >= max(by_pid.values(), default=0)
        if counter or (rss is not None and (rss >= WORKER_HIGH_RSS_BYTES or largest)):
            evidence = why if counter else ("the largest process of the job: the kernel OOM killer's pick"
                                            if largest else "more than a worker needs")
            return "oom", (f"out of host memory: {what}{held} ({evidence}): lower DataLoader num_workers (each "
                           "worker holds its own copy of what it touches) and prefetch_factor or the batch size, keep "
                           "the dataset in numpy arrays or tensors rather than Python lists and dicts (read-only "
                           "access copies their pages in every worker), or ask the platform for more memory")
    return "crash", (f"{what}{held}, and the main process failed on its death ({facts.last_exception}): see what "
                     "the worker was doing (its dataset's __getitem__, a native library), or set num_workers=0 to "
                     "see its error in the main process")


def _error_file_message(path: str) -> tuple[str, int] | None:
    """The error a rank wrote to its ``TORCHELASTIC_ERROR_FILE`` (torch's ``@record``, see
    ``torch.distributed.elastic.multiprocessing.errors``: ``{"message": {"message": "Type: text", "extraInfo":
    {"py_callstack": ..., "timestamp": "SECONDS"}}}``, or ``{"message": "text"}``), with its timestamp (0 when it
    has none); None when the file is missing or unreadable."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return None
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, str) and message:
        return message[:500], 0
    if isinstance(message, dict) and isinstance(message.get("message"), str):
        stamp = str((message.get("extraInfo") or {}).get("timestamp", "0"))
        return message["message"][:500], int(stamp) if stamp.isdigit() else 0
    return None


def rank_failure(facts: JobFacts) -> tuple[int, str] | None:
    """The rank whose own exception failed the job, and that exception: the earliest of the ranks' error files
    (``TORCHELASTIC_ERROR_FILE``), else the first rank whose agent reported an uncaught exception, else the first
    ``[rankN]:`` traceback in the output. None when no rank said."""
    written = [(stamp, rank, text) for rank, path in facts.error_files.items()
               if (found := call_bounded(_error_file_message, path, timeout_s=FS_BOUND_S, default=None)) is not None
               for text, stamp in [found]]
    if written:
        _, rank, text = min(written)
        return rank, text
    if facts.rank_exceptions:
        rank = next(iter(facts.rank_exceptions))
        return rank, facts.rank_exceptions[rank]
    return None


_SHM = ("shared memory", "(shm)", "/dev/shm", "shm_open")
_DISK_FULL = ("No space left on device", "ENOSPC", "Errno 28", "unexpected pos", "file write failed",
              "Disk quota exceeded")


def _free_text(folder: str) -> str:
    usage = call_bounded(shutil.disk_usage, folder, timeout_s=FS_BOUND_S, default=None)
    if usage is None:
        return f"{folder} (free space unknown)"
    return f"{_size(usage.free)} free of {_size(usage.total)} in {folder}"


def _size(size_bytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size_bytes >= scale:
            return f"{size_bytes / scale:.1f} {unit}"
    return f"{int(size_bytes)} bytes"


def _holds_final_model(folder: str | None) -> bool:
    from guard.secure.dest.local import holds_final_model  # lazily: only when needed

    return call_bounded(holds_final_model, folder, timeout_s=FS_BOUND_S, default=False)


def _trainer_output(facts: JobFacts) -> str | None:
    folder = (facts.trainer_config or {}).get("output_dir")
    return str(folder) if folder else None


def _output_folder(facts: JobFacts, settings: RunSettings, securer: Securing | None) -> str:
    """The job's output folder (the guard's ``--output-dir``, the Trainer's ``output_dir``), else its working
    directory."""
    for folder in (securer.output_dir if securer is not None else None,
                   (facts.trainer_config or {}).get("output_dir"), settings.secure.output_dir):
        if folder:
            return str(folder)
    return os.getcwd()


def cause_hint(facts: JobFacts, code: int, *, output_folder: str | None = None) -> str:
    """The crash hint, naming the root cause: a DataLoader worker out of shared memory, a full disk (with the
    free space of ``output_folder``, default the working directory), else the innermost error of the chain."""
    last, root = facts.last_exception, facts.root_exception
    seen = " | ".join(text for text in (root, last) if text)

    def which(markers: tuple[str, ...]) -> str:
        return next((t for t in (root, last) if t and any(m in t for m in markers)), seen)

    if any(marker in seen for marker in _SHM):
        shm = _free_text("/dev/shm") if os.path.isdir("/dev/shm") else "no /dev/shm"
        return (f"the DataLoader workers ran out of shared memory ({which(_SHM)}; {shm}): give the container more "
                "(docker run --shm-size=8g; Kubernetes: an emptyDir with medium Memory on /dev/shm) or lower "
                "num_workers (0 loads in the main process)")
    if any(marker in seen for marker in _DISK_FULL):
        free = _free_text(output_folder or os.getcwd())
        return (f"the disk is full ({which(_DISK_FULL)}; {free}): free space, write the output elsewhere, or keep "
                "fewer checkpoints (save_total_limit)")
    if root and last and root != last:
        return (f"the job exited with code {code} after {root} (the root cause, behind {last}): fix it and rerun")
    if last:
        return f"the job exited with code {code} after {last}: fix the error its traceback shows in the log and rerun"
    return (f"the job exited with code {code} without a Python traceback (sys.exit, or a program that is not "
            "Python): its last output lines say why")


def _teardown_hang(facts: JobFacts, code: int | None) -> str | None:
    """A stall after training completed and its final model was saved (``died_after_training``'s rules; a hang in
    the last barrier or ``destroy_process_group``, pytorch #75097): the warning text, else None. Such a run is
    complete, not one to resume."""
    signalled = code if code is not None and code < 0 else -signal.SIGKILL  # stopped by the guard
    if died_after_training(facts, signalled, lambda: _holds_final_model(_trainer_output(facts))) is None:
        return None
    end = facts.train_end or {}
    where = f" in {facts.hang_where}" if facts.hang_where else ""
    return (f"the job hung at teardown{where} after training completed ({end.get('step')} of "
            f"{end.get('max_steps')} steps) and its final model was saved; the guard stopped it after --stall-timeout")


def _rank_killed(killed: tuple[int, int], code: int, ended: JobExit, elapsed_s: float) -> RunResult:
    """A rank that torchrun's failure summary says died of a signal nobody in the job sent: the cause (``killed``,
    or ``oom`` when the cgroup's OOM kill counter rose), whatever its peers raised after it."""
    rank, signum = killed
    oom, why = _host_oom(ended, near_limit=False)
    extra: dict[str, Any] = {"rank": rank, "signal": signal_name(signum), "job_exit": code}
    if oom and signum == signal.SIGKILL:
        log.error("rank %d was killed by the OOM killer (%s)", rank, why)
        return RunResult("FAIL", "oom", 128 + signum, elapsed_s, extra=extra, hint=(
            f"out of host memory: rank {rank} was killed ({why}): lower DataLoader num_workers or prefetch_factor, "
            "stream or shard the dataset, or ask the platform for more memory"))
    log.error("rank %d died of %s (the launcher's failure summary)", rank, signal_name(signum))
    return RunResult("FAIL", "killed", 128 + signum, elapsed_s, extra=extra,
                     hint=signal_hint(rank, signum, ended.node_rank))


def job_result(state: RunState, ended: JobExit, settings: RunSettings, *,
               securer: Securing | None = None) -> RunResult:
    """Build the run's result from what the loop saw.

    Args:
        state: the run's state (progress, the job's facts, the guard's outcome).
        ended: how the job's processes ended.
        settings: the run's typed settings (``Config.settings``): ``watch.sanity_steps``, ``job.script_args``,
            ``secure.output_dir`` and ``secure.push_to``.
        securer: the securing flow, which fills the checkpoint fields and the exit code of a deadline or signal.
    """
    progress, facts, code = state.progress, state.facts, ended.returncode
    elapsed_s = ended.elapsed_s
    details: dict[str, Any] = {
        "job_exit_code": code,
        "job_signal": signal_name(-code) if code is not None and code < 0 else None,
        "last_exception": facts.last_exception,
        "root_exception": facts.root_exception,
        "loss_source": progress.loss_source,
        "agents_seen": facts.agents_seen,
        "peak_rss_bytes": ended.peak_rss_bytes,
        "checkpoints_reported": [c.get("path") for c in facts.checkpoints][-5:],
    }
    if facts.job_verdict is not None:
        details["job_verdict"] = facts.job_verdict
    if facts.trainer_config is not None:
        details["trainer_config"] = facts.trainer_config
    if facts.trainer_push is not None:
        details["trainer_push"] = facts.trainer_push
    sanity_steps = settings.watch.sanity_steps
    if not progress.sanity:
        details["sanity_status"] = "no_loss_seen"
    elif progress.sanity_done:
        details["sanity_status"] = "passed"
    else:
        details["sanity_status"] = f"incomplete ({len(progress.sanity)} of {sanity_steps} steps)"
    # After the guard stopped the job, exceptions are its echo; on an exit 0 the job caught it itself (it is the
    # job's error only when it cut training short: ``incomplete`` says so in its hint).
    if facts.last_exception and state.outcome is None:
        log.log(logging.ERROR if code != 0 else logging.DEBUG, "the job's last exception: %s", facts.last_exception)

    outcome = state.outcome
    if outcome is not None and outcome.reason == "stalled" and (hung := _teardown_hang(facts, code)) is not None:
        log.warning("%s: the run counts as complete", hung)
        result = RunResult("PASS", "ok", 0, elapsed_s, extra={"warning": hung})
        details["teardown_hang"] = facts.hang_where or "unknown"
    elif outcome is not None:
        result = RunResult(outcome.status, outcome.reason, int(outcome.exit_code or 0), elapsed_s,
                           hint=outcome.hint, extra=dict(outcome.extra))
        stuck = outcome.extra.get("rank")
        if outcome.reason == "stalled" and stuck is not None and facts.hang_where is None:
            result.hint = (f"rank {stuck} gave no stack when asked (a stopped process, or one stuck outside Python "
                           f"code: py-spy dump --pid PID shows it); {result.hint}")
    elif ended.status_lost:
        result = RunResult("FAIL", "guard_error", EXIT_GUARD_ERROR, elapsed_s, extra={"job_exit": "unknown"}, hint=(
            "the job's exit status was lost (another process reaped it), so whether it succeeded is unknown: "
            "check its output above"))
    elif (died := died_after_training(facts, code, lambda: _holds_final_model(_trainer_output(facts)))) is not None:
        end = facts.train_end or {}
        said = f"; its last stderr line: {facts.last_stderr_line}" if facts.last_stderr_line else ""
        warning = (f"the job died of {died} at teardown, after training completed ({end.get('step')} of "
                   f"{end.get('max_steps')} steps) and its final model was saved{said}")
        log.warning("%s: the run counts as complete", warning)
        result = RunResult("PASS", "ok", 0, elapsed_s, extra={"warning": warning})
        details["teardown_signal"] = died
    elif code == 0 and (why := incomplete_reason(facts, progress)) is not None:
        log.error("the job exited 0, but its run is incomplete: %s", why)
        result = RunResult("FAIL", "incomplete", EXIT_INCOMPLETE, elapsed_s, hint=why)
    elif code == 0:
        result = RunResult("PASS", "ok", 0, elapsed_s)
    elif code is not None and code != 0 and not facts.cuda_oom and (worker := _worker_death(facts, ended)):
        exit_code = code if code > 0 else 128 - code
        if worker[0] == "oom":
            log.error("%s", worker[1])
        result = RunResult("FAIL", worker[0], exit_code, elapsed_s, hint=worker[1])
    elif code is not None and code > 0:
        host_oom, why = (False, "") if facts.cuda_oom else _host_oom(ended, near_limit=False)
        if not facts.cuda_oom and (killed := signalled_rank(facts)) is not None:
            result = _rank_killed(killed, code, ended, elapsed_s)
        elif facts.cuda_oom:
            result = RunResult("FAIL", "oom", code, elapsed_s, hint=(
                "CUDA out of memory: lower the per-device batch size (keep the effective batch with gradient "
                "accumulation), enable gradient checkpointing, use bf16, or pick a GPU with more memory"))
        elif host_oom:
            result = RunResult("FAIL", "oom", code, elapsed_s, hint=(
                f"out of host memory ({why}): lower DataLoader num_workers or prefetch_factor, stream or shard "
                "the dataset, or ask the platform for more memory"))
        elif code == 2 and not facts.last_exception and (misplaced := guard_options_in(settings.job.script_args)):
            # argparse's exit status for a usage error: the job refused an option meant for the guard
            result = RunResult("FAIL", "crash", code, elapsed_s, hint=(
                f"the job exited with code 2 (a usage error) and its arguments hold {', '.join(misplaced)}, a guard "
                f"option: guard options go before the script (jobguard {misplaced[0]} ... train.py ...)"))
        elif (failed := rank_failure(facts)) is not None and not any(
                marker in f"{facts.root_exception} {facts.last_exception}" for marker in _SHM + _DISK_FULL):
            rank, text = failed
            log.error("rank %d raised %s", rank, text)
            result = RunResult("FAIL", "crash", code, elapsed_s, extra={"rank": rank}, hint=(
                f"rank {rank} raised {text} (the launcher's error only says that a rank failed): fix it and "
                "rerun; its traceback is in the log, in the lines of that rank"))
            if is_timeout(text):
                late = late_ranks(facts)
                result.hint = timeout_hint(rank, text, late)
                if late:
                    result.extra.update(rank=late[0], waited=rank)
            elif is_peer_lost(text):
                result.hint = peer_hint(rank, text)
        else:
            result = RunResult("FAIL", "crash", code, elapsed_s, hint=cause_hint(
                facts, code, output_folder=_output_folder(facts, settings, securer)))
    else:
        signum = -(code if code is not None else -signal.SIGKILL)
        oom, why = _host_oom(ended, near_limit=signum == signal.SIGKILL)
        if oom:
            result = RunResult("FAIL", "oom", 128 + signum, elapsed_s, hint=(
                f"out of host memory ({why}): lower DataLoader num_workers or prefetch_factor, stream or shard "
                "the dataset, or ask the platform for more memory"))
        else:
            result = RunResult("FAIL", "killed", 128 + signum, elapsed_s, extra={"signal": signal_name(signum)},
                               hint=(f"the job died of {signal_name(signum)}, not sent by the guard: check the "
                                     "platform's events (OOM killer, eviction, a user's kill)"))
    exploded = progress.exploded
    if exploded is not None and result.reason not in ("usage", "preflight"):
        said = (f"the loss exploded to {exploded['loss']:.6g} at step {exploded['step']} from about "
                f"{exploded['early']:.4g} in the first steps (lower the learning rate, add warmup or clip gradients)")
        result.hint = f"{said}; then: {result.hint}" if result.hint else said
    rose = progress.rose
    if rose is not None and result.reason not in ("usage", "preflight"):
        back = (f"; the last checkpoint before it: {rose['checkpoint']} (step {rose['checkpoint_step']})"
                if rose.get("checkpoint") else "")
        said = (f"the loss rose above {rose['factor']:g}x its early level {rose['early']:.4g} at step {rose['since']} "
                f"and stayed there ({rose['loss']:.6g} at step {rose['step']}){back}: lower the learning rate, add "
                "warmup or clip gradients")
        details["loss_rise"] = rose
        if result.status == "PASS":
            result.extra["warning"] = f"{result.extra['warning']}; {said}" if result.extra.get("warning") else said
        elif exploded is None:
            result.hint = f"{said}; then: {result.hint}" if result.hint else said
    if progress.flat is not None and result.status == "PASS":
        said = flat_loss_text(progress.flat)
        details["loss_flat"] = progress.flat
        result.extra["warning"] = f"{result.extra['warning']}; {said}" if result.extra.get("warning") else said
    result.step, result.loss, result.sanity = progress.step, progress.loss, list(progress.sanity)
    if result.reason == "non_finite_loss" and result.loss is not None and math.isfinite(result.loss):
        result.loss = None  # a finite loss never stands on a non_finite_loss verdict (a later step's echo)
    if ended.node_rank is not None:
        result.extra.setdefault("node", ended.node_rank)
    if ended.survivors:  # outlived SIGKILL and the bounded wait
        result.extra["survivors"] = ",".join(map(str, ended.survivors))
        details["survivors"] = [vars(survivor) for survivor in ended.survivors]
    if ended.orphans_reaped:
        details["orphans_reaped"] = ended.orphans_reaped
    result.details.update(details)
    if securer is not None:
        securer.finish(result, step=progress.step)
        if result.status == "PASS" and not settings.secure.push_to and not result.extra.get("pushed"):
            result.extra.pop("checkpoint", None)  # nothing was secured anywhere: a PASS names no checkpoint
        if result.status == "PASS" and settings.secure.push_to and not result.extra.get("pushed") \
                and securer.peers.node_0_pushes_final and not securer.peers.node_0_secures:
            # another node's guard: what it holds of the last save stayed here (its log says why); the model went
            # with node 0's guard (before: "the job saved nothing recognisable" beside this node's checkpoint-6)
            result.extra.setdefault("hint", "the guard of node 0 pushes the final model: see its VERDICT")
        elif result.status == "PASS" and settings.secure.push_to and not result.extra.get("pushed") \
                and not securer.peers.node_0_secures:  # another node's guard: node 0's VERDICT says what was secured
            where = securer.output_dir or "no output folder known"
            hint = (f"nothing was secured to {settings.secure.push_to}: the job saved nothing recognisable "
                    f"as a checkpoint or final model ({where}); save checkpoint-N folders or *.pt/*.safetensors "
                    "files, call guard.checkpoint_saved(path) after a save, or pass --output-dir DIR")
            log.warning("%s", hint)
            result.extra.setdefault("hint", hint)  # PASS stays PASS: training went well, its result is not kept
    if result.status == "PASS" and result.reason == "ok" and progress.step is None and facts.agents_seen:
        result.extra.setdefault("steps", 0)  # the agent was there and saw no training step: say so
    ended_at = facts.train_end or {}
    if result.status == "PASS" and progress.step is None and "resume_loaded" in facts.api_used \
            and isinstance(ended_at.get("step"), int) and isinstance(ended_at.get("max_steps"), int) \
            and 0 < ended_at["max_steps"] <= ended_at["step"]:
        # TRL's sft.py resumed from checkpoint-4114 with max_steps 1500: the Trainer ends at once, no loss to see
        said = (f"the job resumed at step {ended_at['step']}, at or past its max_steps {ended_at['max_steps']}: it "
                "trained no step; raise max_steps to train further")
        log.warning("%s", said)
        result.extra["warning"] = f"{result.extra['warning']}; {said}" if result.extra.get("warning") else said
    elif not progress.sanity and result.status == "PASS":
        log.warning("%s", NO_LOSS_HINT)
    return result
