"""The stages of one guard run, in order; each returns data for the next.

``run_job`` is ``python -m guard SCRIPT.py`` after the command line is parsed: the time budget is resolved,
preflight runs (the job is not started on a ``fail``), a secured checkpoint is fetched when resuming, the
supervisor runs the job, and its ``RunResult`` comes back. ``preflight_only`` is ``python -m guard preflight``.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from guard.secure import budget
from guard.run.config import Config, env_name
from guard.run.masking import Masker
from guard.run.platform import PlatformInfo, detect
from guard.contract import EXIT_PREFLIGHT, RunResult, signal_name

__all__ = ["preflight_only", "resolve_budget", "run_job"]

log = logging.getLogger("guard.stages")


class EarlySignals:
    """Flags for termination signals that arrive before the job starts (preflight, resume)."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._old: dict[int, Any] = {}

    def __enter__(self) -> EarlySignals:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
            try:
                self._old[signum] = signal.signal(signum, lambda s, f: self.received.append(s))
            except ValueError:
                break
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._old.items():
            signal.signal(signum, handler)


def resolve_budget(config: Config, platform: PlatformInfo) -> budget.Deadline:
    """The job's deadline from ``--timeout``/``--started-at``, Slurm or HF Jobs (see ``budget.resolve_deadline``).

    Raises:
        UsageError: a malformed ``--started-at``.
        BudgetError: malformed scheduler variables.
    """
    started_at_s = None
    started_source = "--started-at"
    if config.started_at is not None:
        option = "--started-at" if config.sources["started_at"] == "flag" else env_name("started_at")
        started_at_s = budget.parse_started_at(config.started_at, option=option)
        started_source = option
    timeout_source = "--timeout" if config.sources["timeout"] == "flag" else env_name("timeout")
    return budget.resolve_deadline(timeout_s=config.timeout_s, timeout_source=timeout_source,
                                   started_at_s=started_at_s, started_at_source=started_source,
                                   environ=config.environ, platform=platform, now_s=time.time())


def _preflight_options(config: Config, deadline: budget.Deadline, platform: PlatformInfo) -> Any:
    from guard.preflight import PreflightOptions

    return PreflightOptions(
        script=config.script, script_args=config.script_args, require_env=config.require_env,
        require_models=config.require_model, require_datasets=config.require_dataset,
        require_gpus=config.require_gpus, gpu_type=config.gpu_type, min_free_disk_bytes=config.min_free_disk,
        expected_duration_s=config.expected_duration, timeout_s=deadline.timeout_s,
        timeout_source=deadline.source if deadline.timeout_s is not None else None,
        output_dir=Path(config.output_dir) if config.output_dir else None, push_to=config.push_to,
        skip_checks=dict(config.skip_check), platform=platform.name,
    )


def _run_preflight(config: Config, deadline: budget.Deadline, platform: PlatformInfo) -> Any:
    """Run the checks, log the table; returns the report (None with ``--no-preflight``)."""
    if config.no_preflight:
        log.warning("preflight skipped (--no-preflight): no check ran")
        return None
    from guard.preflight import render_table, run_preflight

    options = _preflight_options(config, deadline, platform)
    log.info("preflight: running the checks (each network call at most %.0fs, side by side)",
             options.network_timeout_s)
    report = run_preflight(options, environ=config.environ)
    if config.requeue:
        report = _with_requeue_row(report, platform)
    log.info("preflight (%.1fs):\n%s", report.elapsed_s,
             "\n".join("[guard]   " + line for line in render_table(report).splitlines()))
    return report


def _with_requeue_row(report: Any, platform: PlatformInfo) -> Any:
    """Add the ``--requeue`` row: ``scontrol`` must exist in the container, and the job must run under Slurm."""
    import dataclasses
    import shutil

    from guard.preflight import CheckResult

    if platform.name != "slurm":
        row = CheckResult("budget", "warn", "--requeue given, but this is not a Slurm job (no SLURM_JOB_ID)",
                          "drop --requeue, or run the guard inside the Slurm job")
    elif shutil.which("scontrol") is None:
        row = CheckResult("budget", "warn", "--requeue given, but scontrol is not on PATH inside the container",
                          "install the Slurm client in the image or bind-mount scontrol; else requeue from sbatch")
    else:
        row = CheckResult("budget", "pass", f"--requeue: scontrol found at {shutil.which('scontrol')}")
    return dataclasses.replace(report, results=(*report.results, row))


def requeue(config: Config, result: RunResult, *, runner: Any = None) -> None:
    """``--requeue``: after a secured stop (exit 75) under Slurm, ``scontrol requeue $SLURM_JOB_ID`` (bounded).

    ``scontrol requeue`` puts the job back in the queue with the same id; Slurm then ends this instance with
    SIGTERM/KillWait/SIGKILL (``scontrol.1``), so the VERDICT is printed first by the caller's flow.
    """
    import subprocess

    job_id = config.environ.get("SLURM_JOB_ID")
    if not config.requeue or result.exit_code != 75 or not job_id:
        return
    run = runner or subprocess.run
    try:
        done = run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.SubprocessError) as exc:
        log.error("scontrol requeue %s failed: %s; requeue the job by hand (sbatch --requeue)", job_id, exc)
        result.details["requeue"] = f"failed: {exc}"
        return
    if done.returncode == 0:
        log.info("requeued Slurm job %s: the next run resumes from %s", job_id, result.extra.get("pushed"))
        result.details["requeue"] = "requeued"
    else:
        log.error("scontrol requeue %s exited %d: %s", job_id, done.returncode, (done.stderr or "").strip()[:300])
        result.details["requeue"] = f"failed: exit {done.returncode}"


def _preflight_failed(report: Any, started: float) -> RunResult:
    row = report.failed
    log.error("preflight failed: %s: %s", row.name, row.seen)
    return RunResult("FAIL", "preflight", EXIT_PREFLIGHT, time.monotonic() - started, hint=row.hint,
                     extra={"check": row.name}, details={"preflight": report.to_json()})


def _securer_factory(environ: Mapping[str, str]) -> Any:
    def make(text: str) -> Any:
        from guard.secure import hub
        hub.install_request_bounds()
        return hub.Securer(text, token=environ.get("HF_TOKEN") or None)

    return make


def _resume_folder(config: Config, report: Any) -> str:
    """Where a fetched checkpoint goes: ``--output-dir``, else the script's literal ``output_dir=`` (read by
    preflight, never by running the script), else ``./guard-resume``. A Trainer resumes from any folder."""
    if config.output_dir:
        return str(config.output_dir)
    facts = getattr(report, "facts", None)
    literal = (getattr(facts, "trainer_config", None) or {}).get("output_dir") if facts is not None else None
    if isinstance(literal, str) and literal:
        return literal
    return "guard-resume"


def _resume(config: Config, securer: Any, report: Any, platform: PlatformInfo) -> tuple[str | None, Any]:
    """Fetch ``DEST/last-checkpoint`` when resuming; returns (folder or None, fetched info or None).

    Raises:
        PreflightError: a corrupt or partial download (``check=resume``), unless ``--resume if-valid``.
    """
    from guard.errors import GuardError, PreflightError

    mode = config.resume
    if mode == "auto":
        restarts = config.environ.get("SLURM_RESTART_COUNT", "0")
        mode = "on" if platform.name == "slurm" and restarts.isdigit() and int(restarts) > 0 else "off"
        if mode == "on":
            log.info("Slurm requeued this job (SLURM_RESTART_COUNT=%s): resuming", restarts)
    if mode == "off":
        return None, None
    if securer is None:
        raise PreflightError("--resume needs a destination to fetch from", check="resume",
                             hint="pass --push-to DEST (the same as the run that secured the checkpoint)")
    folder = _resume_folder(config, report)
    try:
        fetched = securer.fetch_last_checkpoint(folder, deadline=time.monotonic() + 900)
    except GuardError as exc:
        if mode == "if-valid":
            log.warning("the secured checkpoint is not usable (%s): starting fresh (--resume if-valid)", exc.message)
            return None, None
        raise PreflightError(f"cannot resume: {exc.message}", check="resume",
                             hint="the checkpoint at the destination is damaged; --resume if-valid starts fresh") from exc
    if fetched is None:
        log.info("nothing secured at %s yet: starting fresh", securer.destination)
        return None, None
    log.info("resuming from %s (step %s, revision %s)", fetched.path, fetched.step, fetched.revision)
    return str(fetched.path), fetched


def run_job(config: Config, masker: Masker, started: float) -> RunResult:
    """Budget, preflight, resume, the supervised job. Raises ``GuardError`` subclasses for the CLI's boundary."""
    from guard.secure.plan import Securing
    from guard.run.supervisor import Supervisor

    platform = detect(config.environ)
    with EarlySignals() as early:
        deadline = resolve_budget(config, platform)
        factory = _securer_factory(config.environ)
        securer = factory(config.push_to) if config.push_to else None
        report = _run_preflight(config, deadline, platform)
        if report is not None and report.failed is not None:
            return _preflight_failed(report, started)
        resume_path, fetched = _resume(config, securer, report, platform)
    if early.received:
        signum = early.received[0]
        log.warning("%s received before the job started: not starting it", signal_name(signum))
        return RunResult("INTERRUPTED", "signal", 128 + signum, time.monotonic() - started,
                         extra={"signal": signal_name(signum)})

    limits: dict[str, float] = {}
    if deadline.timeout_s is not None:  # a short budget: scale the floor and cap the automatic margin
        limits = {"floor_s": min(60.0, 0.25 * deadline.timeout_s), "max_margin_s": 0.5 * deadline.timeout_s}
    estimator = budget.MarginEstimator(fixed_margin_s=config.margin_s, log_changes=deadline.deadline_s is not None,
                                       **limits)
    if fetched is not None:  # a verified checkpoint: the size for the margin, and a fallback to secure
        from guard.secure.checkpoints import describe

        estimator.observe_size(fetched.size_bytes)
    securing = Securing(deadline=deadline, estimator=estimator, securer=securer, securer_factory=factory,
                        output_dir=config.output_dir, grace_s=config.grace_s,
                        refresher=_slurm_refresher(config, platform))
    if fetched is not None:
        securing.latest_reported = describe(fetched.path, step=fetched.step)
    gpus = report.gpus if report is not None else None

    def trainer_check(trainer_config: Mapping[str, Any]) -> list[Any]:
        from guard.preflight import check_trainer_config

        return check_trainer_config(trainer_config, gpus=gpus, timeout_known=deadline.deadline_s is not None,
                                    environ=config.environ)

    env_extra = {}
    if resume_path:
        from guard import protocol

        env_extra[protocol.ENV_RESUME_PATH] = resume_path
        env_extra[protocol.ENV_RESUME_STEP] = str(fetched.step or 0)
    supervisor = Supervisor(config, masker=masker, securer=securing, trainer_config_check=trainer_check,
                            env_extra=env_extra, heartbeat=_heartbeat(config, masker, securing))
    result = supervisor.run()
    if fetched is not None:
        result.extra["resumed_from"] = f"{fetched.path}@{fetched.revision}"
    if report is not None:
        result.details["preflight"] = report.to_json()
    requeue(config, result)
    return result


def _slurm_refresher(config: Config, platform: PlatformInfo) -> Any:
    """Under Slurm: the end time refreshed from ``scontrol show job`` (see ``guard.run.slurm``)."""
    if platform.name != "slurm":
        return None
    from guard.run.helpers import HELPERS
    from guard.run.slurm import SlurmRefresher

    return SlurmRefresher.from_environ(config.environ, helpers=HELPERS)  # scontrol off the loop


def _heartbeat(config: Config, masker: Masker, securing: Any) -> Any:
    """The heartbeat (``--heartbeat``), the projection against the deadline, and ``--trackio``."""
    from guard.observe.telemetry import GpuSampler, Heartbeat
    from guard.observe.tracking import TrackioSink
    from guard.run.helpers import HELPERS

    tracker = None
    if config.trackio:
        tracker = TrackioSink(config.trackio, run_name=f"jobguard-{time.strftime('%Y%m%d-%H%M%S')}",
                              mask=masker.mask_text)
    return Heartbeat(config.heartbeat, deadline_s=lambda: securing.deadline.deadline_s,
                     margin_s=securing.estimator.margin_s, gpus=GpuSampler(environ=config.environ), tracker=tracker,
                     helpers=HELPERS)


def preflight_only(config: Config, masker: Masker, started: float) -> RunResult:
    """``python -m guard preflight``: the checks, the table, a VERDICT (PASS ok, or FAIL preflight exit 3)."""
    platform = detect(config.environ)
    deadline = resolve_budget(config, platform)
    report = _run_preflight(config, deadline, platform)
    if report is None:
        return RunResult("PASS", "ok", 0, time.monotonic() - started)
    if report.failed is not None:
        return _preflight_failed(report, started)
    warnings = sum(row.status == "warn" for row in report.results)
    log.info("preflight passed (%d warning%s)", warnings, "" if warnings == 1 else "s")
    return RunResult("PASS", "ok", 0, time.monotonic() - started, details={"preflight": report.to_json()})

