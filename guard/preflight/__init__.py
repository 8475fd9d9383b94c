"""Preflight: every check a paid job needs, before the job starts, with no silent skips.

``run_preflight(opts)`` runs the check groups side by side (a thread pool; every network call bounded by
``opts.network_timeout_s``) and returns a ``PreflightReport``: one ``CheckResult`` row per finding, in the order
of ``CHECK_NAMES``. A check that does not apply is an ``n/a`` row with its reason; ``--skip-check NAME=REASON``
turns a whole group into one ``n/a`` row carrying the reason. Any ``fail`` row means the job must not start:
``VERDICT: FAIL reason=preflight check=<row name> exit=3``.

Modules: ``script`` (static analysis, PEP 723), ``env``, ``hub``, ``gpu``, ``storage``, ``data`` (shards, the
datasets cache), ``python_env``, ``trainer``, ``misc`` (budget, distributed, tracking), ``launch`` (the launcher's
command, the launch smoke). A launcher command (``-- torchrun ... train.py``) is read for the script it runs.
Nothing here imports ``huggingface_hub`` unless a Hub check runs, nor ``pynvml`` unless the GPU check runs, nor
ever ``torch``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from guard.errors import UsageError
from guard.preflight._common import NoAnswer, call_bounded, hf_offline, one_line
from guard.preflight._job import HubTarget, JobView, parse_push_to
from guard.preflight._models import (
    CHECK_NAMES,
    CheckResult,
    PreflightOptions,
    PreflightReport,
    Status,
)
from guard.preflight.cmdline import JobArgs, read_job_args
from guard.preflight.data import (
    ShardSet,
    check_data,
    check_datasets_cache,
    check_hub_splits,
    find_hub_splits,
    find_local_data,
    shard_bytes,
)
from guard.preflight.destination import check_destination, check_object_store
from guard.preflight.env import check_env
from guard.preflight.gpu import GpuInfo, check_gpus
from guard.preflight.hfjobs import (
    FLAVORS,
    HfJobsTable,
    expected_flavor,
    read_hf_jobs_file,
)
from guard.preflight.hub import HubProbe, RepoRef, check_hub_auth, check_hub_repos
from guard.preflight.launch import (
    LaunchCommand,
    check_launch,
    parse_launch,
    run_launch_smoke,
    smoke_wanted,
)
from guard.preflight.misc import (
    check_budget,
    check_distributed,
    check_optional_imports,
    check_tracking,
)
from guard.preflight.python_env import UV_HINT, check_imports, check_pep723
from guard.preflight.script import ScriptFacts, analyze_script
from guard.preflight.storage import (
    check_cache,
    check_free_space,
    check_shm,
    check_writable,
)
from guard.preflight.trainer import check_compile_mentions, check_trainer_config

__all__ = [
    "CHECK_NAMES",
    "CheckResult",
    "GpuInfo",
    "HubTarget",
    "PreflightOptions",
    "PreflightReport",
    "ScriptFacts",
    "Status",
    "check_trainer_config",
    "parse_push_to",
    "render_table",
    "run_preflight",
]

log = logging.getLogger("guard.preflight")

#: NVML normally answers in well under a second; a lost GPU can hang a query, so the whole group is bounded.
GPU_TIMEOUT_S = 10.0
#: The storage checks (a temporary file created in each folder, ``statvfs``) answer at once on a working disk; on a
#: hung NFS/Lustre hard mount they never return, so the group is bounded and says so instead of hanging the guard.
STORAGE_TIMEOUT_S = 10.0


def _skipped(name: str, reason: str) -> list[CheckResult]:
    return [CheckResult(name, "n/a", f"skipped by --skip-check: {reason}")]


def _crashed(name: str, exc: BaseException) -> list[CheckResult]:
    log.debug("preflight check %s raised", name, exc_info=exc)
    return [CheckResult(name, "warn", f"the check itself failed: {type(exc).__name__}: {one_line(exc, 200)}",
                        f"a guard bug: report it (GUARD_DEBUG=1 shows the traceback); --skip-check {name}=REASON "
                        "silences it")]


def run_preflight(
    opts: PreflightOptions,
    *,
    environ: Mapping[str, str] = os.environ,
    nvml: Any = None,
    hf_api: Any = None,
    runner: Callable[..., Any] = subprocess.run,
    clock: Callable[[], float] = time.monotonic,
) -> PreflightReport:
    """Run every check group and return the rows.

    Args:
        opts: what the job asks for (see ``PreflightOptions``).
        environ: the job's environment (read only; values are never printed).
        nvml: the ``pynvml`` module or a stand-in; None imports ``pynvml`` when the GPU check runs.
        hf_api: a ``huggingface_hub.HfApi``; None creates one (``HF_ENDPOINT``) when a Hub check runs.
        runner: ``subprocess.run`` or a stand-in, for the import check's child process.
        clock: monotonic seconds, for ``elapsed_s``.

    Returns:
        The report; ``report.failed`` is the first ``fail`` row.

    Raises:
        UsageError: ``opts.skip_checks`` names a check that does not exist.
    """
    start = clock()
    unknown = sorted(set(opts.skip_checks) - set(CHECK_NAMES))
    if unknown:
        raise UsageError(f"--skip-check: no check named {unknown[0]!r}; the checks are: {', '.join(CHECK_NAMES)}",
                         option="--skip-check")
    launch = parse_launch(opts.command) if opts.command else None
    if opts.script is None and launch is not None and launch.script is not None:
        opts = dataclasses.replace(opts, script=launch.script, script_args=launch.script_args)
    facts: ScriptFacts | None = None
    script_error: CheckResult | None = None
    job_args = read_job_args(opts.script_args) if opts.script is not None else JobArgs()
    if opts.script is not None:
        try:
            facts = analyze_script(opts.script, overrides=job_args.values)
        except OSError as exc:
            script_error = CheckResult("python", "fail", f"cannot read {opts.script}: {exc.strerror or exc}",
                                       "check the script's path")
    hf_jobs = read_hf_jobs_file(opts.script) if script_error is None else None
    opts = with_flavor_gpus(opts, hf_jobs, environ)
    job = JobView.build(opts, facts, environ, job_args)
    probe = HubProbe(environ, hf_api, opts.network_timeout_s)
    skip = opts.skip_checks
    rows: dict[str, list[CheckResult]] = {}

    def guarded(name: str, fn: Callable[[], list[CheckResult]]) -> list[CheckResult]:
        if name in skip:
            return _skipped(name, skip[name])
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - a bug in one check must not hide the others
            return _crashed(name, exc)

    def gpu_task() -> tuple[list[CheckResult], list[GpuInfo] | None]:
        if "gpu" in skip:
            return _skipped("gpu", skip["gpu"]), None
        try:
            return call_bounded(check_gpus, GPU_TIMEOUT_S, opts, environ=environ, nvml=nvml)
        except NoAnswer:
            status: Status = "fail" if opts.require_gpus else "warn"
            return [CheckResult("gpu", status, f"NVML gave no answer in {GPU_TIMEOUT_S:g} s",
                                "a GPU may be lost: run nvidia-smi; drain the node if it hangs too")], None
        except Exception as exc:  # noqa: BLE001
            return _crashed("gpu", exc), None

    def repos_task() -> tuple[list[CheckResult], int | None]:
        if "hub-repos" in skip:
            return _skipped("hub-repos", skip["hub-repos"]), None
        try:
            return check_hub_repos(_repo_refs(opts, facts), environ=environ, probe=probe)
        except Exception as exc:  # noqa: BLE001
            return _crashed("hub-repos", exc), None

    with ThreadPoolExecutor(max_workers=8, thread_name_prefix="guard-preflight") as pool:
        f_gpu: Future[tuple[list[CheckResult], list[GpuInfo] | None]] = pool.submit(gpu_task)
        f_repos: Future[tuple[list[CheckResult], int | None]] = pool.submit(repos_task)
        f_auth = pool.submit(guarded, "hub-auth", lambda: check_hub_auth(job.hub_target, environ=environ, probe=probe))
        f_python = pool.submit(guarded, "python", lambda: _python_rows(facts, script_error, environ, runner, opts,
                                                                           hf_jobs)
                               + check_optional_imports(job))
        f_tracking = pool.submit(guarded, "tracking", lambda: check_tracking(
            job, environ=environ, space_private=None if _offline_or_skipped(environ, skip) else probe.space_private))
        f_dist = pool.submit(guarded, "distributed", lambda: _distributed_rows(
            opts, launch, environ=environ, gpus=f_gpu.result()[1]))
        f_data = pool.submit(guarded, "data", lambda: _data_rows(opts, facts, environ, probe))
        f_store = pool.submit(check_object_store, job.object_target, timeout_s=opts.network_timeout_s) \
            if job.object_target and "destination" not in skip else None
        rows["env"] = guarded("env", lambda: check_env(opts, job, environ=environ, hf_jobs=hf_jobs))
        rows["budget"] = guarded("budget", lambda: [check_budget(opts)])
        rows["storage"] = guarded("storage", lambda: _bounded_storage_rows(opts, job, environ, f_repos))
        rows["destination"] = guarded("destination", lambda: check_destination(opts, job, facts)
                                      + (f_store.result() if f_store is not None else []))
        gpu_rows, gpus = f_gpu.result()
        rows["gpu"] = gpu_rows
        rows["trainer-config"] = guarded("trainer-config", lambda: check_trainer_config(
            job.config, gpus=gpus, timeout_known=opts.timeout_s is not None, environ=environ)
            + check_compile_mentions(job, gpus) if facts else [
            CheckResult("trainer-config", "n/a", "no script given: checked when the Trainer is built")])
        rows["hub-repos"] = f_repos.result()[0]
        rows["hub-auth"] = f_auth.result()
        rows["python"] = f_python.result()
        rows["tracking"] = f_tracking.result()
        rows["data"] = f_data.result()
        rows["distributed"] = f_dist.result()
    results = tuple(row for name in CHECK_NAMES for row in rows.get(name, []))
    return PreflightReport(results=results, elapsed_s=clock() - start, facts=facts,
                           gpus=tuple(gpus) if gpus is not None else None)


def _offline_or_skipped(environ: Mapping[str, str], skip: Mapping[str, str]) -> bool:
    return bool(hf_offline(environ)) or "hub-auth" in skip


def _repo_refs(opts: PreflightOptions, facts: ScriptFacts | None) -> list[RepoRef]:
    refs = [RepoRef("model", rid, "--require-model") for rid in opts.require_models]
    refs += [RepoRef("dataset", rid, "--require-dataset") for rid in opts.require_datasets]
    if facts is not None:
        refs += [RepoRef("model", rid, f"named in {facts.path.name}") for rid in facts.models]
        refs += [RepoRef("dataset", rid, f"named in {facts.path.name}") for rid in facts.datasets]
    unique: dict[tuple[str, str], RepoRef] = {}
    for ref in refs:
        unique.setdefault((ref.repo_type, ref.repo_id), ref)
    return list(unique.values())


def with_flavor_gpus(opts: PreflightOptions, hf_jobs: HfJobsTable | None,
                     environ: Mapping[str, str]) -> PreflightOptions:
    """On HF Jobs, the GPUs the flavor gives (``ACCELERATOR``, else the script's ``[tool.hf-jobs] flavor``) become
    the GPU check's expectation, unless ``--require-gpus``/``--gpu-type`` say otherwise (see ``hfjobs.FLAVORS``).
    A CPU flavor or an unknown name expects nothing."""
    if opts.platform != "hf_jobs" or opts.require_gpus or opts.gpu_type:
        return opts
    flavor = expected_flavor(hf_jobs, environ)
    if flavor is None or flavor[0] not in FLAVORS or not FLAVORS[flavor[0]].count:
        return opts
    name, source = flavor
    gpus = FLAVORS[name]
    import dataclasses

    return dataclasses.replace(opts, require_gpus=gpus.count, gpu_type=gpus.gpu_type,
                               gpu_source=f"flavor {name} ({source}): {gpus.count}x {gpus.gpu_type}")


def _python_rows(facts: ScriptFacts | None, script_error: CheckResult | None, environ: Mapping[str, str],
                 runner: Callable[..., Any], opts: PreflightOptions | None = None,
                 hf_jobs: HfJobsTable | None = None) -> list[CheckResult]:
    if script_error is not None:
        return [script_error]
    header: list[CheckResult] = []
    if hf_jobs is not None and hf_jobs.error is not None:
        header.append(CheckResult("python", "fail", hf_jobs.error,
                                  "fix the table: hf jobs uv run refuses it too (keys and types: huggingface_hub's "
                                  "cli/_uv_script_header.py)"))
    if facts is not None and facts.syntax_error:
        return [*header, CheckResult("python", "fail", f"{facts.path.name} does not parse: {facts.syntax_error}",
                                     f"fix the syntax error (python -m py_compile {facts.path.name})"),
                *check_pep723(facts)]
    if facts is None:
        return [*header, CheckResult("python", "n/a", "no script given: no PEP 723 block or imports to check")]
    uv_environment = opts.uv_environment if opts is not None else None
    uv_error = opts.uv_error if opts is not None else None
    if uv_error is not None:
        return header + check_pep723(facts, uv_environment=uv_environment, uv_error=uv_error)
    # The import check's children first (the slowest check of a preflight): the PEP 723 rows meanwhile.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="guard-imports-check") as pool:
        pending = pool.submit(check_imports, facts, environ=environ, runner=runner,
                              python=opts.python_executable if opts is not None else None)
        pep723 = check_pep723(facts, uv_environment=uv_environment, uv_error=uv_error)
        imports = pending.result()
    missing = any(row.status == "warn" and "not installed" in row.seen for row in pep723)
    if missing and imports.status == "fail" and " failed: ModuleNotFoundError" in imports.seen:
        imports = dataclasses.replace(imports, hint=UV_HINT)  # the PEP 723 dependencies are not installed here
    return header + pep723 + [imports]


def _data_rows(opts: PreflightOptions, facts: ScriptFacts | None, environ: Mapping[str, str],
               probe: HubProbe) -> list[CheckResult]:
    required = [ShardSet(pattern, count) for pattern, count in opts.require_shards]
    found = [s for s in find_local_data(opts.script, opts.script_args)
             if s.pattern not in {r.pattern for r in required}]
    rows = check_data([*required, *found])
    uses_datasets = bool(opts.require_datasets) or (facts is not None and (
        "datasets" in facts.imports or bool(facts.datasets)))
    size = shard_bytes([*required, *found]) if uses_datasets else None
    cache = check_datasets_cache(environ, data_bytes=size, uses_datasets=uses_datasets)
    if cache is not None:
        rows.append(cache)
    wants = find_hub_splits(opts.script) if "hub-repos" not in opts.skip_checks and not hf_offline(environ) else []
    if wants:
        rows = [row for row in rows if row.status != "n/a"]
        rows += check_hub_splits(wants, info_of=lambda repo_id: probe.call("dataset_info", repo_id),
                                 required=opts.require_datasets) or [
            CheckResult("data", "n/a", "no shards named; the Hub datasets' splits could not be listed")]
    return rows


def _distributed_rows(opts: PreflightOptions, launch: LaunchCommand | None, *, environ: Mapping[str, str],
                      gpus: list[GpuInfo] | None) -> list[CheckResult]:
    """The environment's world (``check_distributed``), the launcher's command, then the launch smoke."""
    rows = check_distributed(opts, environ=environ, gpus=gpus)
    if launch is not None:
        launch_rows = check_launch(launch, gpus=gpus, timeout_s=opts.network_timeout_s, resolve=socket.getaddrinfo)
        rows = [row for row in rows if row.status != "n/a"] + launch_rows
    want, why = smoke_wanted(opts.launch_smoke, launch, gpus)
    if want and any(row.status == "fail" for row in rows):
        want, why = False, "not run: the world's arguments failed above"
    if not want or launch is None:
        return [*rows, CheckResult("distributed", "n/a", f"launch smoke: {why}")]
    log.info("preflight: launch smoke under %s (at most %.0fs)", launch.launcher, opts.launch_smoke_timeout_s)
    return [*rows, run_launch_smoke(launch, timeout_s=opts.launch_smoke_timeout_s, environ=environ)]


def _bounded_storage_rows(opts: PreflightOptions, job: JobView, environ: Mapping[str, str],
                          f_repos: Future[tuple[list[CheckResult], int | None]]) -> list[CheckResult]:
    """``_storage_rows`` within ``STORAGE_TIMEOUT_S``; one ``warn`` row naming the folders when they did not answer
    (the checks go on in a daemon thread: a call on a hung mount never returns). The model's size for the free-space
    row comes from the Hub check first, outside the bound: its network calls are bounded on their own."""
    size = f_repos.result()[1] if opts.min_free_disk_bytes is None else None
    try:
        return call_bounded(_storage_rows, STORAGE_TIMEOUT_S, opts, job, environ, size)
    except NoAnswer:
        folders = ", ".join(str(p) for p in (job.output_dir, job.folder_target) if p is not None) or str(Path.cwd())
        return [CheckResult("storage", "warn", f"no answer in {STORAGE_TIMEOUT_S:g} s from the file system of "
                            f"{folders}", "a hung network mount (NFS, Lustre)? check it with `stat` and `df`; the "
                            "job's saves will hang there too")]


def _storage_rows(opts: PreflightOptions, job: JobView, environ: Mapping[str, str],
                  size: int | None) -> list[CheckResult]:
    rows: list[CheckResult] = []
    if job.output_dir is not None:
        rows.append(check_writable("output folder", job.output_dir,
                                   hint="choose a writable --output-dir (and output_dir=) on a persistent disk"))
    else:
        rows.append(CheckResult("storage", "n/a", "output folder not known before the job saves (no --output-dir, no "
                                "output_dir= literal): the free space below is the working folder's"))
    if job.folder_target is not None:
        rows.append(check_writable("--push-to folder", job.folder_target, hint="--push-to a folder you can write to"))
    rows.append(check_cache(environ))
    rows.append(check_shm())
    rows.insert(1, check_free_space(job.output_dir or Path.cwd(), min_free_bytes=opts.min_free_disk_bytes,
                                    model_size_bytes=size))
    return rows


_STATUS_WIDTH = 6
_SEEN_MAX = 72


def render_table(report_or_results: PreflightReport | Iterable[CheckResult]) -> str:
    """The rows as a plain-text table with the columns check, status, seen, hint.

    A ``seen`` longer than the column puts its hint on the next line, under the seen column, as
    ``hint: ...``. Example row::

        gpu             n/a    no NVIDIA driver: libnvidia-ml not found

    Returns:
        The table, lines joined with ``\\n`` (no trailing newline).
    """
    results = list(report_or_results.results if isinstance(report_or_results, PreflightReport) else report_or_results)
    name_width = max([len("check")] + [len(r.name) for r in results]) + 2
    seen_width = min(_SEEN_MAX, max([len("seen")] + [len(r.seen) for r in results])) + 2
    lines = ["check".ljust(name_width) + "status".ljust(_STATUS_WIDTH + 1) + "seen".ljust(seen_width) + "hint"]
    for row in results:
        seen = " ".join(row.seen.split())
        head = row.name.ljust(name_width) + row.status.ljust(_STATUS_WIDTH + 1)
        if not row.hint:
            lines.append((head + seen).rstrip())
        elif len(seen) <= seen_width - 2:
            lines.append(head + seen.ljust(seen_width) + row.hint)
        else:
            lines.append(head + seen)
            lines.append(" " * (name_width + _STATUS_WIDTH + 1) + "hint: " + row.hint)
    return "\n".join(lines)
