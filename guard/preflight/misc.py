"""Budget, distributed and tracking checks.

Sources: HF Jobs' default timeout is 30 minutes ("Jobs have a default timeout (30 minutes)", hub-docs
``jobs-configuration.md``); torchrun sets ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``RANK``, ``MASTER_ADDR`` and
``MASTER_PORT`` (torch.distributed.elastic); Slurm sets ``SLURM_NTASKS``, ``SLURM_NTASKS_PER_NODE``,
``SLURM_JOB_NUM_NODES`` (sbatch(1) OUTPUT ENVIRONMENT VARIABLES); a trackio Space is public unless
``private=True`` (``trackio.init(private=None)``; ``TrainingArguments.hub_private_repo`` docs).
"""

from __future__ import annotations

import importlib.util
import logging
import re
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from importlib import metadata

from guard.core.durations import format_duration_s
from guard.preflight._common import (
    NoAnswer,
    call_bounded,
    hf_offline,
    hf_token,
)
from guard.preflight._job import JobView
from guard.preflight._models import CheckResult, PreflightOptions
from guard.preflight.gpu import GpuInfo

__all__ = ["EXPECTED_FACTOR", "check_budget", "check_distributed", "check_optional_imports", "check_tracking"]

#: ``--expected-duration D`` fails when the timeout is under ``EXPECTED_FACTOR`` x D.
EXPECTED_FACTOR = 1.3
log = logging.getLogger("guard.preflight")

_PLATFORM_DEFAULT = {
    "hf_jobs": "HF Jobs stops a job after its default timeout of 30 minutes unless hf jobs run got --timeout",
    "slurm": "Slurm applies the partition's time limit (SLURM_JOB_END_TIME is not set: Slurm older than 23.02?)",
    "kubernetes": "Kubernetes applies activeDeadlineSeconds if the Job sets one",
    "torchrun": "no platform limit is known",
    "local": "no platform limit is known",
}
_PLATFORM_HINT = {
    "hf_jobs": "pass the same --timeout to the guard as to hf jobs run (e.g. --timeout 2h)",
    "slurm": "pass --timeout with the job's --time",
}


def check_budget(opts: PreflightOptions) -> CheckResult:
    """The job's time budget: unknown is a warning naming the platform default; too short for the job fails."""
    name = "budget"
    expected = opts.expected_duration_s
    if opts.timeout_s is None:
        default = _PLATFORM_DEFAULT.get(opts.platform, _PLATFORM_DEFAULT["local"])
        extra = ""
        if expected is not None and opts.platform == "hf_jobs" and expected * EXPECTED_FACTOR > 1800:
            extra = f"; expected {format_duration_s(expected)} would not fit in 30 minutes"
        return CheckResult(name, "warn", f"no timeout known: {default}{extra}",
                           _PLATFORM_HINT.get(opts.platform, "pass --timeout so the guard can secure a checkpoint "
                                              "before the deadline"))
    source = f" (from {opts.timeout_source})" if opts.timeout_source else ""
    seen = f"timeout {format_duration_s(opts.timeout_s)}{source}"
    if expected is not None:
        need = expected * EXPECTED_FACTOR
        if opts.timeout_s < need:
            return CheckResult(name, "fail", f"{seen} is under {EXPECTED_FACTOR} x the expected "
                               f"{format_duration_s(expected)} ({format_duration_s(need)})",
                               f"raise the timeout to at least {format_duration_s(need)}, or shorten the run "
                               "(max_steps)")
        seen += f", expected {format_duration_s(expected)} (x{opts.timeout_s / expected:.1f})"
    return CheckResult(name, "pass", seen)


def _int(environ: Mapping[str, str], key: str) -> int | None:
    text = (environ.get(key) or "").strip()
    m = re.match(r"^(\d+)", text)  # SLURM_NTASKS_PER_NODE may read "4(x2)"
    return int(m.group(1)) if m else None


def check_distributed(
    opts: PreflightOptions,
    *,
    environ: Mapping[str, str],
    gpus: Sequence[GpuInfo] | None,
    resolve: Callable[..., object] = socket.getaddrinfo,
) -> list[CheckResult]:
    """Under torchrun or Slurm: world sizes against the visible GPUs, ``MASTER_ADDR`` resolves.

    Args:
        opts: the options (``network_timeout_s`` bounds the name lookup).
        environ: the job's environment.
        gpus: the GPUs the job sees, None when unknown.
        resolve: ``socket.getaddrinfo`` or a stand-in.
    """
    name = "distributed"
    torchrun = "WORLD_SIZE" in environ or "LOCAL_WORLD_SIZE" in environ
    slurm = "SLURM_JOB_ID" in environ and ("SLURM_NTASKS" in environ or "SLURM_PROCID" in environ)
    if not torchrun and not slurm and opts.platform not in ("torchrun", "slurm"):
        return [CheckResult(name, "n/a", "not a distributed run (no WORLD_SIZE, not under Slurm)")]
    ntasks = _int(environ, "SLURM_NTASKS")
    if slurm and not torchrun and (ntasks or 1) == 1 and not (environ.get("MASTER_ADDR") or "").strip():
        # sbatch without -n/--ntasks sets no SLURM_NTASKS: one task, the batch step's (sbatch(1) OUTPUT ENVIRONMENT)
        return [CheckResult(name, "n/a", "one process: one Slurm task "
                            f"({'SLURM_NTASKS=1' if ntasks else 'no SLURM_NTASKS'}), no WORLD_SIZE")]
    rows: list[CheckResult] = []
    facts: list[str] = []
    for key in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK"):
        if key in environ and not (environ[key] or "").strip().isdigit():
            rows.append(CheckResult(name, "fail", f"{key}={environ[key]!r} is not a whole number",
                                    "let torchrun set it, or fix the launcher"))
    world = _int(environ, "WORLD_SIZE") or _int(environ, "SLURM_NTASKS")
    local = _int(environ, "LOCAL_WORLD_SIZE")
    local_source = "LOCAL_WORLD_SIZE"
    if local is None and _int(environ, "SLURM_NTASKS_PER_NODE") is not None and "WORLD_SIZE" not in environ:
        local, local_source = _int(environ, "SLURM_NTASKS_PER_NODE"), "SLURM_NTASKS_PER_NODE"
    if world is not None:
        facts.append(f"world size {world}")
    rank = _int(environ, "RANK")
    if world is not None and rank is not None and rank >= world:
        rows.append(CheckResult(name, "fail", f"RANK={rank} but WORLD_SIZE={world}", "fix the launcher's ranks"))
    if local is not None:
        facts.append(f"{local} per node ({local_source})")
        if world is not None and local > world:
            rows.append(CheckResult(name, "fail", f"{local_source}={local} > world size {world}",
                                    "fix --nproc-per-node / --nnodes"))
        rows += gpu_fit_rows(name, local, f"{local_source}={local} processes on this node", gpus)
    addr = (environ.get("MASTER_ADDR") or "").strip()
    if addr:
        port = (environ.get("MASTER_PORT") or "").strip()
        master_rows(rows, facts, name, addr, port, timeout_s=opts.network_timeout_s, resolve=resolve,
                    addr_label="MASTER_ADDR", port_label="MASTER_PORT=",
                    addr_hint="set MASTER_ADDR to the first node's host name or IP "
                              "(Slurm: scontrol show hostnames $SLURM_JOB_NODELIST | head -n1)")
    elif world is not None and world > 1 and torchrun:
        rows.append(CheckResult(name, "fail", f"WORLD_SIZE={world} but MASTER_ADDR is not set",
                                "launch with torchrun, or export MASTER_ADDR and MASTER_PORT"))
    if not any(row.status == "fail" for row in rows):
        rows.insert(0, CheckResult(name, "pass", "; ".join(facts) or
                                   ("under torchrun" if torchrun or opts.platform == "torchrun" else "under Slurm"
                                    + (f" ({ntasks} tasks)" if ntasks else ""))))
    return rows


def _installed(module: str) -> str | None:
    if importlib.util.find_spec(module) is None:
        return None
    try:
        return metadata.version(module)
    except metadata.PackageNotFoundError:
        return "installed"


def check_tracking(
    job: JobView,
    *,
    environ: Mapping[str, str],
    space_private: Callable[[str], bool | None] | None = None,
) -> list[CheckResult]:
    """The trackers the job reports to are installed and set up; a trackio Space that would be public warns.

    Credentials in environment variables (``WANDB_API_KEY``, ``MLFLOW_TRACKING_URI``) are the env check's rows.

    Args:
        job: the job (trackers, trackio Space and privacy).
        environ: the job's environment.
        space_private: asks the Hub whether an existing Space is private (None: unknown or missing).
    """
    name = "tracking"
    maybe = [m for m in job.mentions if m.kind == "tracker" and m.what not in job.trackers]
    if not job.trackers and not job.trackio_space_id and not maybe:
        return [CheckResult(name, "n/a", "no tracker (no report_to wandb/mlflow/trackio, none used in the script)")]
    rows: list[CheckResult] = []
    imported = {m.what for m in job.mentions if m.kind == "import"}  # the python row already warns for these
    for mention in {m.what: m for m in reversed(maybe)}.values():
        if mention.what not in imported and _installed(mention.what) is None:  # on a path not taken: nothing to do
            log.debug("tracking: %s not installed: %s (only if you turn it on: pip install %s)", mention.what,
                      mention.describe(job.script_name), mention.what)
    wandb_mode = (environ.get("WANDB_MODE") or "").strip().lower()
    for tracker in sorted(job.trackers | ({"trackio"} if job.trackio_space_id else set())):
        version = _installed(tracker)
        if version is None and tracker == "wandb" and wandb_mode == "disabled":
            rows.append(CheckResult(name, "warn", "reports to wandb, wandb not installed (WANDB_MODE=disabled: "
                                    "nothing would be logged)", "pip install wandb, or remove wandb from report_to "
                                    "(transformers' WandbCallback and `import wandb` still need the package)"))
            continue
        if version is None:
            rows.append(CheckResult(name, "fail", f"reports to {tracker}, but {tracker} is not installed",
                                    f"pip install {tracker}, or remove it from report_to"))
            continue
        if tracker == "wandb" and wandb_mode in ("offline", "disabled", "dryrun"):
            where = "runs stay in ./wandb (wandb sync later)" if wandb_mode != "disabled" else "nothing is logged"
            rows.append(CheckResult(name, "pass", f"wandb {version} installed, WANDB_MODE={wandb_mode}: {where}"))
            continue
        if tracker != "trackio":
            rows.append(CheckResult(name, "pass", f"{tracker} {version} installed (credentials: env rows)"))
            continue
        space = job.trackio_space_id
        if not space:
            rows.append(CheckResult(name, "pass", f"trackio {version}: logs locally (no Space)"))
            continue
        if offline := hf_offline(environ):
            rows.append(CheckResult(name, "warn", f"trackio Space {space} with {offline}: metrics stay local",
                                    "unset HF_HUB_OFFLINE to sync to the Space, or drop space_id"))
            continue
        token, _where = hf_token(environ)
        if not token:
            rows.append(CheckResult(name, "fail",
                                    f"trackio Space {space} needs an HF token with write access; none found",
                                    "pass HF_TOKEN as a secret, or drop space_id to log locally"))
            continue
        existing = space_private(space) if (space_private and job.trackio_private is not True) else None
        if job.trackio_private is True or existing is True:
            why = "private=True" if job.trackio_private is True else "the Space exists and is private"
            rows.append(CheckResult(name, "pass", f"trackio {version}: Space {space} private ({why})"))
        else:
            state = "is public" if existing is False else "would be created public (private not set)"
            rows.append(CheckResult(name, "warn", f"trackio Space {space} {state}: metrics and config visible to all",
                                    "pass private=True to trackio.init (Trainer: hub_private_repo=True)"))
    if not rows:
        only = ", ".join(sorted({m.what for m in maybe}))
        rows.append(CheckResult(name, "n/a", f"no tracker in use ({only} only on a path not taken)"))
    return rows


def check_optional_imports(job: JobView, *, stdlib: frozenset[str] | None = None) -> list[CheckResult]:
    """Modules the script imports only under an ``if`` that may not be taken (an upstream script's optional
    integrations): not installed is logged at DEBUG, never a warning (there is nothing to do unless the user turns
    that path on, and then the import is taken and the python check's import row fails). Returns no rows.

    Found with ``importlib.util.find_spec`` (the module is not run).
    """

    skip = stdlib if stdlib is not None else frozenset(getattr(sys, "stdlib_module_names", ())) | frozenset(
        sys.builtin_module_names)
    rows: list[CheckResult] = []
    seen: set[str] = set()
    for mention in job.mentions:
        if mention.kind != "import" or mention.what in seen or mention.what in skip:
            continue
        seen.add(mention.what)
        try:
            missing = importlib.util.find_spec(mention.what) is None
        except (ImportError, ValueError):
            missing = True
        if missing:
            log.debug("python: %s not installed: %s (only if you turn it on: pip install %s)", mention.what,
                      mention.describe(job.script_name), mention.what)
    return rows


def gpu_fit_rows(name: str, procs: int, what: str, gpus: Sequence[GpuInfo] | None) -> list[CheckResult]:
    """Processes per node against the GPUs this node sees: more processes fail, fewer warn (idle GPUs).

    Args:
        name: the row's check name.
        procs: processes started on this node.
        what: how the row names them (``"4 processes per node"``).
        gpus: the visible GPUs; None or empty: nothing to compare.
    """
    if not gpus:
        return []
    if procs > len(gpus):
        return [CheckResult(name, "fail", f"{what}, {len(gpus)} GPU{'s' if len(gpus) != 1 else ''} visible: ranks "
                            "would share or miss a GPU", "set --nproc-per-node to the GPU count, or request more GPUs")]
    if len(gpus) > procs:
        idle = len(gpus) - procs
        return [CheckResult(name, "warn", f"{len(gpus)} GPUs visible, {what}: {idle} GPU{'s' if idle != 1 else ''} "
                            "idle", "set --nproc-per-node to the GPU count")]
    return []


def master_rows(rows: list[CheckResult], facts: list[str], name: str, addr: str, port: str | None, *,
                timeout_s: float, resolve: Callable[..., object], addr_label: str, port_label: str,
                addr_hint: str, resolved_label: str | None = None) -> None:
    """The rendezvous master: its port is a port, its address resolves within ``timeout_s`` (a missing answer is a
    warning, a failed lookup a failure). Appends to ``rows`` and ``facts``.

    Args:
        addr_label: how the address is named (``"MASTER_ADDR"``, ``"master"``).
        port_label: how the port is named, with its separator (``"MASTER_PORT="``, ``"master port "``).
        addr_hint: the hint when the address does not resolve.
        resolved_label: how the fact names a resolved address (default ``addr_label``).
    """
    if port and not (port.isdigit() and 0 < int(port) < 65536):
        rows.append(CheckResult(name, "fail", f"{port_label}{port!r} is not a port", "use a port 1-65535"))
    if not addr:
        return
    try:
        call_bounded(resolve, timeout_s, addr, None)
        facts.append(f"{resolved_label or addr_label} {addr} resolves")
    except NoAnswer:
        rows.append(CheckResult(name, "warn", f"{addr_label} {addr}: no DNS answer in {timeout_s:g} s",
                                "check the cluster's name service"))
    except OSError as exc:
        rows.append(CheckResult(name, "fail", f"{addr_label} {addr} does not resolve ({exc})", addr_hint))
