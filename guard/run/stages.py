"""The stages of one guard run, in order; each returns data for the next.

``run_job`` is ``python -m guard SCRIPT.py`` after the command line is parsed: the time budget is resolved,
preflight runs (the job is not started on a ``fail``), a secured checkpoint is fetched when resuming, the
supervisor runs the job, and its ``RunResult`` comes back. ``preflight_only`` is ``python -m guard preflight``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import signal
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeVar

from guard.contract import EXIT_PREFLIGHT, EXIT_SECURED, RunResult, signal_name
from guard.core.masking import Masker
from guard.run.config import Config, env_name, guard_options_in
from guard.run.platform import PlatformInfo, detect
from guard.run.process import default_signals
from guard.run.start import JobStart
from guard.secure import budget

if TYPE_CHECKING:
    from guard.observe.telemetry import Heartbeat
    from guard.preflight import CheckResult, PreflightOptions, PreflightReport
    from guard.run.slurm import SlurmRefresher
    from guard.run.supervisor import Supervisor
    from guard.run.uvenv import UvEnvironment, UvPlan
    from guard.secure.resume import ResumeFrom
    from guard.secure.securer import Securer
    from guard.secure.securing import Securing
    from guard.secure.sharing import SharingProbe

T = TypeVar("T")

__all__ = ["preflight_only", "resolve_budget", "run_job"]

log = logging.getLogger("guard.stages")


#: Set when work was left running in a thread after a signal (preflight): the CLI then ends the process right
#: after the VERDICT instead of waiting for that work's threads at interpreter exit.
abandoned_work = False


class EarlySignals:
    """Flags for termination signals that arrive before the job starts (preflight, resume)."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._old: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}

    def __enter__(self) -> EarlySignals:
        for signum in default_signals():
            try:
                self._old[signum] = signal.signal(signum, lambda s, f: self.received.append(s))
            except ValueError:
                break
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._old.items():
            signal.signal(signum, handler)


def _unless_signalled(work: Callable[[], T], early: EarlySignals) -> tuple[bool, T | None]:
    """Run ``work()`` in a daemon thread while the main thread waits for it or for a signal; returns
    ``(True, value)``, or ``(False, None)`` once a signal arrived (the work is left behind: nothing it finds matters
    any more, and the VERDICT must come within --grace). Re-raises what ``work`` raised."""
    import threading

    global abandoned_work
    value: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            value.append(work())
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            error.append(exc)

    thread = threading.Thread(target=target, name="guard-preflight-stage", daemon=True)
    thread.start()
    while thread.is_alive():
        if any(s != signal.SIGHUP for s in early.received):
            abandoned_work = True
            log.warning("%s received during preflight: stopping here", signal_name(early.received[0]))
            return False, None
        thread.join(0.1)
    if error:
        raise error[0]
    return True, value[0] if value else None


def resolve_budget(config: Config, platform: PlatformInfo) -> budget.Deadline:
    """The job's deadline from ``--timeout``/``--started-at``, Slurm or HF Jobs (see ``budget.resolve_deadline``).

    Without ``--timeout``/``GUARD_TIMEOUT``, the script's own ``[tool.hf-jobs] timeout`` is the timeout (the one
    ``hf jobs uv run`` submits); on HF Jobs it counts from the container's start like any explicit timeout.

    Raises:
        UsageError: a malformed ``--started-at``.
        BudgetError: malformed scheduler variables.
    """
    settings = config.settings.secure
    started_at_s = None
    started_source = "--started-at"
    if settings.started_at is not None:
        started_at_s = budget.parse_started_at(settings.started_at, option=settings.started_at_option)
        started_source = settings.started_at_option
    timeout_s = settings.timeout_s
    timeout_source = settings.timeout_option
    if timeout_s is None and _mentions_hf_jobs(config.script):
        from guard.preflight.hfjobs import TABLE, read_hf_jobs_file  # imports all of guard.preflight

        table = read_hf_jobs_file(config.script)
        if table is not None and table.timeout_s is not None:
            timeout_s = table.timeout_s
            timeout_source = f"[{TABLE}] timeout in {table.path.name}"
    deadline = budget.resolve_deadline(timeout_s=timeout_s, timeout_source=timeout_source,
                                       started_at_s=started_at_s, started_at_source=started_source,
                                       environ=config.environ, platform=platform, now_s=time.time())
    return _slurm_deadline(deadline, config, platform)


def _mentions_hf_jobs(script: Path | None) -> bool:
    """The script's text names ``hf-jobs`` (a ``[tool.hf-jobs]`` table can only be there): else reading the table
    and importing the preflight package for it is not needed (``--no-preflight``)."""
    try:
        return script is not None and b"hf-jobs" in script.read_bytes()
    except OSError:
        return script is not None


#: Options by which a script loads a checkpoint itself (``--resume_from_checkpoint PATH``): accelerate's examples,
#: transformers' ``run_*_no_trainer.py``.
_RESUME_FLAGS = ("--resume_from_checkpoint", "--resume-from-checkpoint")


#: nanoGPT's train.py (and its forks) load ``out_dir/ckpt.pt`` only with ``--init_from=resume`` (its configurator).
_INIT_FROM_RESUME = (b"init_from == 'resume'", b'init_from == "resume"')


def _script_and_args(config: Config) -> tuple[bytes, list[str]]:
    """The job script's text (the script form's, or the first ``*.py`` of the command: ``torchrun train.py``; empty
    when unreadable) and the job's arguments."""
    args = list(config.script_args if config.script else config.command)
    script = config.script or next((Path(a) for a in config.command if a.endswith(".py")), None)
    try:
        return (script.read_bytes() if script is not None else b""), args
    except OSError:
        return b"", args


def _resume_flag(config: Config) -> str | None:
    """The script's own option to load a checkpoint (``_RESUME_FLAGS``) when its text declares one (a quoted
    ``"--resume_from_checkpoint"``, as ``argparse`` takes it) and the job's arguments do not pass it; else None."""
    text, args = _script_and_args(config)
    for flag in _RESUME_FLAGS:
        declared = f'"{flag}"'.encode() in text or f"'{flag}'".encode() in text
        if declared and not any(a == flag or a.startswith(f"{flag}=") for a in args):
            return flag
    return None


def script_resume_args(config: Config, checkpoint: str) -> str | None:
    """The arguments the job script needs to load ``checkpoint`` itself, when it loads one only when told and this
    run's arguments do not tell it: ``--resume_from_checkpoint out/step_100`` (accelerate's examples, transformers'
    ``run_*_no_trainer.py``) or ``--init_from=resume`` (nanoGPT); else None. ``checkpoint`` is written relative to
    the working folder when inside it (where ``--resume`` puts it back)."""
    flag = _resume_flag(config)
    if flag is not None:
        where = Path(checkpoint)
        with contextlib.suppress(ValueError):
            where = where.relative_to(Path.cwd())
        return f"{flag} {where}"
    text, args = _script_and_args(config)
    if any(marker in text for marker in _INIT_FROM_RESUME) and not any(
            a.startswith(("--init_from=", "--init-from=")) for a in args):
        return "--init_from=resume"
    return None


def _slurm_deadline(deadline: budget.Deadline, config: Config, platform: PlatformInfo) -> budget.Deadline:
    """Under Slurm without ``SLURM_JOB_END_TIME`` (older than 23.02): the end time from one bounded ``scontrol show
    job`` call before preflight, so the budget row, the margin's caps and the deadline all see it from the start
    (the refresher re-reads it later). ``--timeout`` still wins when earlier (``Deadline.refreshed``)."""
    if platform.name != "slurm" or config.environ.get("SLURM_JOB_END_TIME", "").strip():
        return deadline
    from guard.run.slurm import SlurmRefresher

    refresher = SlurmRefresher.from_environ(config.environ)
    if refresher is None:
        return deadline
    end_s = refresher.maybe_refresh()
    times = refresher.last_times
    if end_s is None or times is None:
        return deadline
    if deadline.timeout_s is None and times.start_time_s is not None and times.start_time_s <= end_s:
        deadline = dataclasses.replace(deadline, started_at_s=times.start_time_s)  # the budget counts from StartTime
    elif (times.start_time_s is not None and deadline.explicit_deadline_s is not None
          and config.settings.secure.started_at is None and deadline.source.endswith("from guard start")):
        # --timeout counts from the job's start (the contract): Slurm's StartTime, the same on every node of the
        # job, rather than each node's guard start (they differ by the time each node took to get here)
        start_s, timeout_s = min(times.start_time_s, deadline.started_at_s), float(config.settings.secure.timeout_s
                                                                                   or deadline.timeout_s or 0.0)
        explicit_s = start_s + timeout_s
        deadline = dataclasses.replace(
            deadline, started_at_s=start_s, timeout_s=timeout_s, deadline_s=explicit_s, explicit_deadline_s=explicit_s,
            source=deadline.source.replace("from guard start", "from scontrol StartTime"), exact=True)
    return deadline.refreshed(end_s, refresher.last_source)


def _uv_environment(config: Config) -> tuple[UvPlan, UvEnvironment | None]:
    """``--uv``: decide whether the job runs in the script's uv environment, and build it then (``guard.run.uvenv``).

    Returns:
        ``(plan, environment)``; ``environment`` is None when the job runs with this interpreter.
    """
    from guard.run import uvenv

    plan = uvenv.plan_uv(config.settings.job.uv, config.script, config.environ)
    log.info("uv: %s", plan.why)
    if not plan.use or config.script is None:
        return plan, None
    log.info("uv: building %s's environment (%s sync --script)", config.script.name, plan.uv or "uv")
    env = uvenv.sync_script(plan.uv, config.script, config.environ)
    if env.error:
        log.error("uv: %s", env.error)
    else:
        log.info("uv: the job's Python: %s (environment %s, ready in %.1fs)", env.python, env.prefix, env.seconds)
    return plan, env


def _preflight_options(config: Config, deadline: budget.Deadline, platform: PlatformInfo,
                       uv_env: UvEnvironment | None = None) -> PreflightOptions:
    from guard.preflight import PreflightOptions

    checks, secure = config.settings.preflight, config.settings.secure
    return PreflightOptions(
        script=config.script, script_args=config.script_args, require_env=checks.require_env,
        require_models=checks.require_model, require_datasets=checks.require_dataset,
        require_gpus=checks.require_gpus, gpu_type=checks.gpu_type, min_free_disk_bytes=checks.min_free_disk_bytes,
        expected_duration_s=checks.expected_duration_s, timeout_s=deadline.timeout_s,
        timeout_source=deadline.source if deadline.timeout_s is not None else None,
        output_dir=Path(secure.output_dir) if secure.output_dir else None, push_to=secure.push_to,
        skip_checks=dict(checks.skip_check), platform=platform.name,
        python_executable=uv_env.python if uv_env is not None else None,
        uv_environment=uv_env.prefix if uv_env is not None else None,
        uv_error=uv_env.error if uv_env is not None else None,
        command=() if config.script else tuple(config.command), require_shards=checks.require_shards,
        launch_smoke=checks.launch_smoke, launch_smoke_timeout_s=checks.launch_smoke_timeout_s,
    )


def _run_preflight(config: Config, deadline: budget.Deadline, platform: PlatformInfo,
                   uv_env: UvEnvironment | None = None) -> PreflightReport | None:
    """Run the checks, log the table; returns the report (None with ``--no-preflight``)."""
    if config.settings.preflight.no_preflight:
        log.warning("preflight skipped (--no-preflight): no check ran")
        return None
    from guard.preflight import render_table, run_preflight

    options = _preflight_options(config, deadline, platform, uv_env)
    log.info("preflight: running the checks (each network call at most %.0fs, side by side)",
             options.network_timeout_s)
    report = run_preflight(options, environ=config.environ)
    if config.settings.secure.requeue:
        report = _with_requeue_row(report, platform)
    log.info("preflight (%.1fs):\n%s", report.elapsed_s,
             "\n".join("[guard]   " + line for line in render_table(report).splitlines()))
    if deadline.timeout_s and report.elapsed_s > deadline.timeout_s / 10:
        left = deadline.remaining_s(time.time())
        log.warning("preflight took %.0fs, %.0f%% of the %.0fs budget%s (a loaded machine makes its import checks "
                    "slow): --skip-check python=REASON skips them", report.elapsed_s,
                    100 * report.elapsed_s / deadline.timeout_s, deadline.timeout_s,
                    f"; {left:.0f}s are left" if left is not None else "")
    return report


def _with_requeue_row(report: PreflightReport, platform: PlatformInfo) -> PreflightReport:
    """Add the ``--requeue`` row: ``scontrol`` must exist in the container, and the job must run under Slurm."""
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
    SIGTERM/KillWait/SIGKILL (``scontrol.1``). So the CLI calls this only after the VERDICT and the report are
    written, and SIGTERM is ignored from the call on (the guard exits right after it, with the VERDICT's code).
    """
    import subprocess

    job_id = config.environ.get("SLURM_JOB_ID")
    if not config.settings.secure.requeue or result.exit_code != 75 or not job_id:
        return
    secure = config.settings.secure
    if secure.nodes > 1:  # many nodes: node 0's guard requeues, once the others have said their VERDICT
        if secure.node_rank != 0:
            log.info("node %d: node 0's guard requeues the job", secure.node_rank)
            return
        output_dir, _ = output_folder(config)
        if output_dir:
            from guard.secure.sharing import await_others_done

            await_others_done(output_dir, secure.run_id, wait_s=min(10.0, secure.grace_s / 2))
    run = runner or subprocess.run
    try:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # Slurm's SIGTERM to this instance must not cut the call
    except ValueError:  # not the main thread
        pass
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


def _preflight_failed(report: PreflightReport, started: float) -> RunResult:
    row = report.failed
    assert row is not None
    log.error("preflight failed: %s: %s", row.name, row.seen)
    return RunResult("FAIL", "preflight", EXIT_PREFLIGHT, time.monotonic() - started, hint=row.hint,
                     extra={"check": row.name}, details={"preflight": report.to_json()})


def _securer_factory(environ: Mapping[str, str], run_id: str | None = None) -> Callable[[str], Securer]:
    def make(text: str) -> Securer:
        from guard.secure.hubhttp import install_request_bounds
        from guard.secure.securer import Securer

        install_request_bounds()
        return Securer(text, token=environ.get("HF_TOKEN") or None, run_id=run_id)

    return make


def _resume_folder(output_dir: str | None, report: PreflightReport | None) -> str:
    """Where a fetched checkpoint goes: the output folder (``--output-dir``, else the job's own argument), else the
    script's literal ``output_dir=`` (read by preflight, never by running the script), else ``./guard-resume``.
    A Trainer resumes from any folder."""
    if output_dir:
        return output_dir
    facts = getattr(report, "facts", None)
    literal = (getattr(facts, "trainer_config", None) or {}).get("output_dir") if facts is not None else None
    if isinstance(literal, str) and literal:
        return literal
    return "guard-resume"


#: Without a deadline, the resume fetch may take this long at most (seconds). A Xet download can stall for good
#: (xet-core #869, #898); with a deadline the bound is half of the time left.
FETCH_LIMIT_S = 900.0


def _fetch_deadline(deadline: budget.Deadline) -> float:
    """When the resume's peek and fetch must be over (monotonic seconds): half of what is left of the budget
    (the rest is for training and securing), else ``FETCH_LIMIT_S`` (logged: the bound a stalled fetch waits)."""
    if deadline.deadline_s is None:
        log.info("resume: no deadline (--timeout): fetching the secured checkpoint may take up to %.0fs", FETCH_LIMIT_S)
        return time.monotonic() + FETCH_LIMIT_S
    return time.monotonic() + max(1.0, 0.5 * (deadline.deadline_s - time.time()))


def _resume(config: Config, securer: Securer | None, report: PreflightReport | None, platform: PlatformInfo, *,
            output_dir: str | None, deadline: budget.Deadline, early: EarlySignals) -> ResumeFrom | None:
    """The checkpoint to resume from when resuming (``guard.secure.resume.choose``), or None.

    Raises:
        PreflightError: a corrupt or partial download (``check=resume``), unless ``--resume if-valid``.
    """
    mode = config.settings.secure.resume
    if mode == "auto":
        restarts = config.environ.get("SLURM_RESTART_COUNT", "0")
        mode = "on" if platform.name == "slurm" and restarts.isdigit() and int(restarts) > 0 else "off"
        if mode == "on":
            log.info("Slurm requeued this job (SLURM_RESTART_COUNT=%s): resuming", restarts)
    if mode == "off":
        return None
    from guard.errors import GuardError, PreflightError
    from guard.secure import resume

    if securer is None:
        raise PreflightError("--resume needs a destination to fetch from", check="resume",
                             hint="pass --push-to DEST (the same as the run that secured the checkpoint)")
    folder = _resume_folder(output_dir, report)
    fetch_by, abort = _fetch_deadline(deadline), lambda: bool(early.received)
    secure = config.settings.secure
    try:
        if secure.nodes > 1:  # many nodes: a shared output folder is fetched into once (guard.secure.sharing)
            from guard.secure.sharing import once_per_folder

            return once_per_folder(folder, secure.run_id, secure.node_rank, "fetch",
                                   lambda: resume.choose(folder, securer, deadline=fetch_by, abort=abort),
                                   deadline=fetch_by, abort=abort)
        return resume.choose(folder, securer, deadline=fetch_by, abort=abort)
    except resume.Interrupted:
        return None  # the caller sees early.received
    except GuardError as exc:
        if mode == "if-valid":
            log.warning("the secured checkpoint is not usable (%s): starting fresh (--resume if-valid)", exc.message)
            return None
        hint = (exc.hint if isinstance(exc, resume.FetchTimedOut) else
                "the checkpoint at the destination is damaged; --resume if-valid starts fresh")
        raise PreflightError(f"cannot resume: {exc.message}", check="resume", hint=hint) from exc


def output_folder(config: Config) -> tuple[str | None, str]:
    """The job's output folder and where it came from: ``--output-dir`` (or its environment variable), else the
    job's own ``--output_dir``/``--output-dir``/``--out_dir``/``--save`` argument (``layout.output_dir_from_args``),
    else None (a Trainer's ``output_dir`` or the folder of the job's ``torch.save`` calls fill it in later)."""
    from guard.secure.layout import output_dir_from_args

    secure = config.settings.secure
    if secure.output_dir:
        return secure.output_dir, ("--output-dir" if secure.output_dir_from_flag else env_name("output_dir"))
    args = config.script_args if config.script else config.command
    found = output_dir_from_args(args)
    if found is not None:
        return found[0], f"the job's {found[1]} argument"
    return None, "not known yet: a Trainer's output_dir, or the folder the job saves into, once seen"


def run_job(config: Config, masker: Masker, started: float) -> RunResult:
    """Budget, preflight, resume, the supervised job. Raises ``GuardError`` subclasses for the CLI's boundary.

    The job is started (``guard.run.start.JobStart``) before the loop's policies are imported and built: their
    imports run while the job's interpreter starts."""
    platform = detect(config.environ)
    if misplaced := guard_options_in(config.script_args):
        log.info("the job's arguments hold %s, also a guard option: after the script it goes to the job, not the "
                 "guard (guard options go before the script)", ", ".join(misplaced))
    output_dir, output_source = output_folder(config)
    log.info("output folder: %s (%s)", output_dir or "-", output_source)
    sharing = _probe_sharing(config, output_dir)
    try:
        result = _run_job(config, masker, started, platform, output_dir, sharing)
    finally:
        if sharing is not None:
            sharing.close()
    if sharing is not None:
        result.details["output_folder_shared"] = sharing.answer.shared
    return result


def _probe_sharing(config: Config, output_dir: str | None) -> SharingProbe | None:
    """Many nodes and a known output folder: find out whether the nodes share it (``guard.secure.sharing``, on a
    thread of its own); None otherwise."""
    secure = config.settings.secure
    if secure.nodes < 2:
        return None
    if not output_dir:
        log.info("output folder shared by the nodes or not: not probed (no output folder known before the job)")
        return None
    from guard.secure.sharing import SharingProbe

    return SharingProbe(output_dir, secure.run_id, secure.node_rank, secure.nodes).start()


def _run_job(config: Config, masker: Masker, started: float, platform: PlatformInfo,
             output_dir: str | None, sharing: SharingProbe | None) -> RunResult:
    _require_trackio(config)
    with EarlySignals() as early:
        deadline = resolve_budget(config, platform)
        factory = _securer_factory(config.environ, config.settings.secure.run_id or None)
        securer = factory(config.settings.secure.push_to) if config.settings.secure.push_to else None
        _, uv_env = _uv_environment(config)
        finished, report = _unless_signalled(lambda: _run_preflight(config, deadline, platform, uv_env), early)
        if finished and uv_env is not None and uv_env.error and report is None:  # --no-preflight: cannot run it
            from guard.errors import PreflightError
            from guard.preflight.python_env import uv_error_hint

            raise PreflightError(f"uv could not build the script's environment: {uv_env.error}", check="python",
                                 hint=uv_error_hint(uv_env.error))
        if finished and report is not None and report.failed is not None:
            return _verdict_alert(config, masker, _with_platform(_preflight_failed(report, started), platform))
        fetched = None if not finished else _resume(config, securer, report, platform, output_dir=output_dir,
                                                    deadline=deadline, early=early)
    if early.received:
        signum = early.received[0]
        log.warning("%s received before the job started: not starting it", signal_name(signum))
        return RunResult("INTERRUPTED", "signal", 128 + signum, time.monotonic() - started,
                         extra={"signal": signal_name(signum)})

    env_extra: dict[str, str] = {}
    if uv_env is not None and uv_env.python and config.script is not None:
        config = dataclasses.replace(config, command=(uv_env.python, str(config.script), *config.script_args))
        env_extra.update(uv_env.env_extra)
    if config.settings.secure.nodes > 1:  # node 0's reaches the other nodes through the job's store (_dist.py)
        from guard import protocol

        env_extra[protocol.ENV_RUN_ID] = config.settings.secure.run_id
    if fetched is not None:
        from guard import protocol

        env_extra[protocol.ENV_RESUME_PATH] = str(fetched.path)
        env_extra[protocol.ENV_RESUME_STEP] = str(fetched.step or 0)
    start = JobStart.of(config.command, {**config.environ, **env_extra}, config.settings.watch, masker=masker)
    start.begin()
    try:
        supervisor = _supervisor(config, masker, start, deadline=deadline, securer=securer, factory=factory,
                                 output_dir=output_dir, platform=platform, fetched=fetched, report=report,
                                 sharing=sharing)
    except BaseException:
        start.abort()  # the guard's own failure before the loop: no job is left behind
        raise
    result = supervisor.run()
    if securer is not None:
        from guard.run.process import AFTER_VERDICT
        from guard.secure import worker

        def tidy() -> None:  # what a push killed part way left at the destination, after the VERDICT
            worker.reap_killed()  # a killed push that died since: its staging is left over, its pid free
            securing = getattr(supervisor, "securer", None)  # many nodes: their parts' staging too
            nodes = config.settings.secure.nodes if securing is not None and securing.peers.parts_mode() else 1
            securer.tidy(until_s=deadline.deadline_s, nodes=nodes)
        AFTER_VERDICT.call(tidy)
    if sharing is not None:  # many nodes, one output folder: node 0's word on what it secured (guard/run/relay.py)
        from guard.run.relay import agree_with_node_0

        secure = config.settings.secure
        agree_with_node_0(result, shared=sharing.answer.shared, output_dir=output_dir, run_id=sharing.run_id,
                          node_rank=secure.node_rank, end_s=supervisor.word_by_wall(), grace_s=secure.grace_s)
    securing = getattr(supervisor, "securer", None)
    if securer is not None and securing is not None and securing.peers.parts_mode():
        _agree_on_missing(config, result, securer, supervisor.word_by_wall())
    checkpoint = result.extra.get("checkpoint")
    if result.exit_code == EXIT_SECURED and checkpoint and "the next run resumes from" in (result.hint or ""):
        told = script_resume_args(config, str(checkpoint))  # --resume on alone: the script would start fresh
        if told is not None:
            result.hint = f"{result.hint} {told} (the script loads a checkpoint only when told)"
    if fetched is not None:
        result.extra["resumed_from"] = f"{fetched.path}@{fetched.revision}"
        state = getattr(supervisor, "state", None)
        idle = state is not None and state.progress.step in (None, fetched.step)
        if result.reason == "incomplete" and idle:
            # not an empty dataset: the resumed checkpoint was at (or past) the run's last step
            result.hint = (f"the job resumed from {fetched.path} (step {fetched.step}) and trained no further step: "
                           "that checkpoint is at or past the run's last step (max_steps), so nothing was left to "
                           "train; raise max_steps to train further, or start a new run with --resume off")
        elif result.reason == "crash" and idle:
            # run_clm_no_trainer.py resumed past its num_train_epochs: its loop ran no step, then the code after it
            # read a variable only the loop sets (UnboundLocalError: perplexity)
            note = (f"the job resumed from {fetched.path} (step {fetched.step}) and crashed before training a further "
                    "step: if that checkpoint is at or past the run's last step (max_steps, num_train_epochs), "
                    "nothing was left to train; raise it to train further")
            result.hint = f"{result.hint}; {note}" if result.hint else note
        if state is not None and "resume_loaded" not in state.facts.api_used:  # the agent never saw it loaded
            result.details["resume_loaded"] = False
            told = script_resume_args(config, str(fetched.path))
            how = (f"pass the script's own {told}, or load it (guard.resume_path() names it)"
                   if told else "load it (guard.resume_path() names it)")
            note = (f"the job did not load the resumed checkpoint {fetched.path} (it started from scratch; steps "
                    f"counted from 0): {how}")
            result.hint = f"{result.hint}; {note}" if result.hint else note
    if report is not None:
        result.details["preflight"] = report.to_json()
    if uv_env is not None:
        result.details["uv"] = {"python": uv_env.python, "environment": uv_env.prefix}
    return _with_platform(result, platform)


def _agree_on_missing(config: Config, result: RunResult, securer: Securer, end_s: float | None) -> None:
    """Many nodes, each securing its own part: the VERDICT's ``missing=`` from the destination's listing
    (``guard.run.relay.agree_on_missing``). A stopped run (``TIMEOUT``, ``INTERRUPTED``) waits for it until shortly
    before the platform's kill (``end_s``, wall-clock seconds: the deadline, or the end of the grace after a signal),
    which is what bounds it; another end, with no kill near, ``MISSING_WAIT_S`` at most (a hung destination)."""
    from guard.run.relay import MISSING_WAIT_S, agree_on_missing, wait_before_end_s

    secure = config.settings.secure
    stopped = result.status in ("TIMEOUT", "INTERRUPTED") and end_s is not None
    wait_s = wait_before_end_s(end_s, secure.grace_s, unknown_s=MISSING_WAIT_S)
    wait_s = wait_s if stopped else min(wait_s, MISSING_WAIT_S)
    agree_on_missing(result, read=lambda until: securer.newest_parts(nodes=secure.nodes, deadline=until),
                     wait_s=wait_s)


def _supervisor(config: Config, masker: Masker, start: JobStart, *, deadline: budget.Deadline,
                securer: Securer | None, factory: Callable[[str], Securer], output_dir: str | None,
                platform: PlatformInfo, fetched: ResumeFrom | None, report: PreflightReport | None,
                sharing: SharingProbe | None = None) -> Supervisor:
    """The loop and its policies (securing, the watchdog, telemetry), built while the job starts."""
    from guard.run.supervisor import Supervisor
    from guard.secure.securing import Securing

    floor_s, max_margin_s = budget.margin_bounds(deadline)  # caps by the budget, whatever its source
    secure = config.settings.secure
    estimator = budget.MarginEstimator(fixed_margin_s=secure.margin_s, log_changes=deadline.deadline_s is not None,
                                       floor_s=floor_s, max_margin_s=max_margin_s)
    if fetched is not None:  # a verified checkpoint: the size for the margin, and a fallback to secure
        estimator.observe_size(fetched.size_bytes)
    # without --push-interval: from the destination (folder: every complete save; the Hub: its commit rate limit
    # and the measured push time, guard.secure.cadence), also for a destination the Trainer names later
    push_interval_s = None if config.sources.get("push_interval") == "default" else secure.push_interval_s
    securing = Securing(deadline=deadline, estimator=estimator, securer=securer, securer_factory=factory,
                        output_dir=output_dir, grace_s=secure.grace_s,
                        refresher=_slurm_refresher(config, platform), background=secure.background_push,
                        push_interval_s=push_interval_s, final_window_s=secure.final_push_window_s,
                        push_stall_s=secure.push_stall_s, run_id=secure.run_id or None, node_rank=secure.node_rank,
                        nodes=secure.nodes, own_run_id=secure.node.run_id_source == "default",
                        run_id_taken=sharing.adopt if sharing is not None else None,
                        shared=lambda: sharing.answer.shared if sharing is not None else None)
    if fetched is not None and fetched.info is not None:  # described by the resume stage, off this thread
        held_by = str(securer.destination) if fetched.source == "destination" and securer is not None else None
        securing.resumed_from(fetched.info, destination=held_by, revision=fetched.revision)
    gpus = report.gpus if report is not None else None

    def trainer_check(trainer_config: Mapping[str, Any]) -> list[CheckResult]:
        from guard.preflight.trainer import check_job_settings

        return check_job_settings(trainer_config, gpus=gpus, timeout_known=deadline.deadline_s is not None,
                                  environ=config.environ)

    return Supervisor(config, masker=masker, securer=securing, trainer_config_check=trainer_check,
                      heartbeat=_heartbeat(config, masker, securing), start=start)


def _with_platform(result: RunResult, platform: PlatformInfo) -> RunResult:
    """Where the job ran, in the report: ``details["platform"]`` (name and ids: HF Jobs job id and flavor, Slurm
    job id, pod name)."""
    result.details["platform"] = {"name": platform.name, **{k: v for k, v in platform.details.items() if v}}
    return result


def _slurm_refresher(config: Config, platform: PlatformInfo) -> SlurmRefresher | None:
    """Under Slurm: the end time refreshed from ``scontrol show job`` (see ``guard.run.slurm``)."""
    if platform.name != "slurm":
        return None
    from guard.core.helpers import HELPERS
    from guard.run.slurm import SlurmRefresher

    return SlurmRefresher.from_environ(config.environ, helpers=HELPERS)  # scontrol off the loop


def _heartbeat(config: Config, masker: Masker, securing: Securing) -> Heartbeat:
    """The heartbeat (``--heartbeat``), the projection against the deadline, ``--trackio`` and the alerts
    (``--alert-webhook``: without ``--trackio`` a local trackio run in the project ``jobguard``)."""
    from guard.core.helpers import HELPERS
    from guard.observe.alerts import Alerts, ThroughputWatch, WebhookWatch
    from guard.observe.telemetry import GpuSampler, Heartbeat
    from guard.observe.tracking import TrackioSink
    from guard.run.config import alert_webhook_url

    observe = config.settings.observe
    url, _source = alert_webhook_url(observe.alert_webhook, config.environ)
    project = observe.trackio or ("jobguard" if url else None)
    tracker = None
    if project:
        tracker = TrackioSink(project, run_name=f"jobguard-{time.strftime('%Y%m%d-%H%M%S')}",
                              mask=masker.mask_text, webhook_url=url, webhook_min_level=observe.alert_level)
    heartbeat = Heartbeat(observe.heartbeat_s, deadline_s=lambda: securing.deadline.deadline_s,
                          margin_s=securing.estimator.margin_s, gpus=GpuSampler(environ=config.environ),
                          tracker=tracker, helpers=HELPERS)
    heartbeat.alerts = Alerts(lambda: heartbeat.tracker,
                              throughput=ThroughputWatch(observe.alert_throughput_drop,
                                                         observe.alert_throughput_window_s),
                              webhook=WebhookWatch(url, masker.mask_text).install() if url else None)
    return heartbeat


def _verdict_alert(config: Config, masker: Masker, result: RunResult) -> RunResult:
    """A verdict reached before the job started (preflight failed): with a webhook, its alert all the same, in a
    trackio run of its own (at most 5 s for trackio, then ``alerts.WEBHOOK_WAIT_S`` for the POST)."""
    from guard.observe.alerts import WEBHOOK_WAIT_S, WebhookWatch, wait_for_webhooks
    from guard.observe.tracking import TrackioSink
    from guard.run.config import alert_webhook_url

    observe = config.settings.observe
    url, _source = alert_webhook_url(observe.alert_webhook, config.environ)
    if url:
        watch = WebhookWatch(url, masker.mask_text).install()
        sink = TrackioSink(observe.trackio or "jobguard", run_name=f"jobguard-{time.strftime('%Y%m%d-%H%M%S')}",
                           mask=masker.mask_text, webhook_url=url, webhook_min_level=observe.alert_level)
        sink.finish(result)
        sink.close(timeout_s=5.0)
        wait_for_webhooks(WEBHOOK_WAIT_S)
        watch.quiet = True
    return result


def _require_trackio(config: Config) -> None:
    """``--alert-webhook`` (or ``GUARD_ALERT_WEBHOOK``) without trackio: ``FAIL preflight`` naming the extra."""
    url = config.settings.observe.alert_webhook
    if url:
        from guard.observe.alerts import require_trackio

        given_as = "--alert-webhook" if config.sources.get("alert_webhook") == "flag" else "GUARD_ALERT_WEBHOOK"
        require_trackio(url, given_as)


def preflight_only(config: Config, masker: Masker, started: float) -> RunResult:
    """``python -m guard preflight``: the checks, the table, a VERDICT (PASS ok, or FAIL preflight exit 3)."""
    platform = detect(config.environ)
    _require_trackio(config)
    deadline = resolve_budget(config, platform)
    _, uv_env = _uv_environment(config)
    report = _run_preflight(config, deadline, platform, uv_env)
    if report is None:
        return _with_platform(RunResult("PASS", "ok", 0, time.monotonic() - started), platform)
    if report.failed is not None:
        return _with_platform(_preflight_failed(report, started), platform)
    warnings = sum(row.status == "warn" for row in report.results)
    log.info("preflight passed (%d warning%s)", warnings, "" if warnings == 1 else "s")
    return _with_platform(RunResult("PASS", "ok", 0, time.monotonic() - started,
                                    details={"preflight": report.to_json()}), platform)

