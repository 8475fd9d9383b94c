"""The command line: ``python -m guard [OPTIONS] SCRIPT.py [ARGS]``, ``-- COMMAND``, ``preflight``, ``watch``.

``main()`` is the one error boundary: every ``GuardError`` becomes one ``[guard]`` line with its hint, a VERDICT
(``usage`` 2, ``preflight`` 3, ``push_failed`` 6, ``guard_error`` 70) and its exit code; any other exception is
a ``guard_error`` (70), with the traceback only when ``GUARD_DEBUG=1``. Whatever happens, exactly one VERDICT
line is printed, last on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from guard.contract import EXIT_GUARD_ERROR, RunResult, render_line, settle_exit_code, signal_name, write_report
from guard.core.durations import DURATION_FORMS
from guard.core.masking import Masker, MaskingFilter, command_line_secrets, secret_values
from guard.core.version import __version__
from guard.errors import GuardError, PreflightError, UsageError
from guard.run.config import OPTIONS, Config, debug_enabled, env_name, log_level, resolve, webhook_secrets
from guard.run.output import LINES
from guard.run.platform import detect
from guard.run.process import AFTER_VERDICT
from guard.run.writer import LogSink

__all__ = ["build_config", "main"]

log = logging.getLogger("guard.cli")

USAGE = """\
jobguard [OPTIONS] SCRIPT.py [SCRIPT_ARGS...]   run a Python script, supervised
jobguard [OPTIONS] -- COMMAND [ARGS...]         run any command (torchrun, accelerate launch, bash ...)
jobguard preflight [OPTIONS] [SCRIPT.py]        run the checks only
jobguard watch [FILE]                           read a job log; exit by its VERDICT"""


EPILOG = """\
DURATION: 7200, 45s, 90m, 1.5h, 1d, 1h30m, HH:MM:SS or D-HH:MM:SS.

Exit codes (the last line on stdout is the VERDICT, with the same code in exit=):
  0    PASS: ok, or dry_run
  2    usage: a malformed option or no job
  3    preflight: a check failed before the job started (check= names it)
  4    non_finite_loss          5    stalled
  6    push_failed: the job succeeded, its model could not be secured
  7    incomplete: the job exited 0, but it did not finish its training
  70   guard_error: a fault inside the guard
  75   TIMEOUT/INTERRUPTED with the newest checkpoint secured (pushed= says where): resume from it
  124  TIMEOUT with nothing secured
  128+N  the job died of signal N (killed), or the guard got it and secured nothing (INTERRUPTED)
  other  the job's own exit code (crash, oom); 1 when that code is one of the above (2-7, 70, 75, 124),
         the job's own then in job_exit="""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message}", hint="run `jobguard --help` for the options and their forms")


def _parser(prog: str = "python -m guard") -> argparse.ArgumentParser:
    parser = _Parser(prog=prog, usage=USAGE, add_help=True, allow_abbrev=False,
                     description="Run a training job under jobguard. Every option falls back to GUARD_<OPTION>.",
                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"jobguard {__version__}")
    for opt in OPTIONS:
        help_text = f"{opt.help} (env {env_name(opt.name)}; default: {opt.default_text()})"
        if opt.bare is not None:
            parser.add_argument(opt.flag, dest=opt.name, metavar=opt.metavar, nargs="?", const=opt.bare,
                                help=help_text)
        elif opt.flag_only_bool:
            parser.add_argument(opt.flag, dest=opt.name, action="store_const", const=True, default=None, help=help_text)
        elif opt.repeat:
            parser.add_argument(opt.flag, dest=opt.name, action="append", metavar=opt.metavar, help=help_text)
        else:
            parser.add_argument(opt.flag, dest=opt.name, metavar=opt.metavar, help=help_text)
    return parser


def _split(argv: Sequence[str]) -> tuple[list[str], list[str], bool]:
    """Split ``argv`` into (guard options, job part, command form?) at ``--`` or at the first non-option."""
    takes_value = {o.flag for o in OPTIONS if not o.flag_only_bool and o.bare is None}
    optional = {o.flag: o.choices for o in OPTIONS if o.bare is not None}
    switches = {o.flag for o in OPTIONS if o.flag_only_bool}
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return list(argv[:i]), list(argv[i + 1 :]), True
        if not token.startswith("-") or token == "-":
            _no_spaced_unit(argv, i)
            return list(argv[:i]), list(argv[i:]), False
        if token in takes_value:
            i += 1  # the option's value
        elif token in optional and i + 1 < len(argv) and argv[i + 1].strip().lower() in optional[token]:
            i += 1  # ``--resume on train.py``; ``--resume train.py`` leaves the script alone
        elif token in switches and i + 1 < len(argv) and _misplaced_value(argv[i + 1]):
            raise UsageError(f"{token} takes no value, and {argv[i + 1]!r} is no script here", option=token,
                             hint=f"give {token} alone (it means on), before the script")
        elif token in optional and i + 1 < len(argv) and _misplaced_value(argv[i + 1]):
            option = next(o for o in OPTIONS if o.flag == token)
            assert option.parse is not None
            option.parse(argv[i + 1], option=token)  # raises that option's usage error (the accepted values)
        i += 1
    return list(argv), [], False


#: Words that, after a DURATION option's number, say the user wrote the unit apart (``--timeout 10 minutes``).
_UNIT_WORDS = frozenset({"s", "sec", "secs", "second", "seconds", "m", "min", "mins", "minute", "minutes", "h", "hr",
                         "hrs", "hour", "hours", "d", "day", "days"})


def _no_spaced_unit(argv: Sequence[str], at: int) -> None:
    """``argv[at]``, taken as the script, is a unit word after a DURATION option's number (``--timeout 10
    minutes``), and names no file here.

    Raises:
        UsageError: naming the option and the accepted forms (rather than "script not found: minutes").
    """
    word = argv[at]
    if at < 2 or word.lower() not in _UNIT_WORDS or Path(word).exists():
        return
    flag, number = argv[at - 2], argv[at - 1]
    option = next((o for o in OPTIONS if o.flag == flag and (o.metavar or "").startswith("DURATION")), None)
    if option is None:
        return
    unit = word.lower()[0]
    raise UsageError(f"{flag} {number} {word}: a DURATION is one word, with no space before its unit; accepted: "
                     f"{DURATION_FORMS}", option=flag, hint=f"write {flag} {number}{unit}")


def _misplaced_value(token: str) -> bool:
    """After an option whose value may be left out (``--resume``), whether ``token`` reads as a value meant for it
    rather than the job's script: a bare word (no path separator, no file extension) that names no file here, such
    as ``maybe`` in ``--resume maybe train.py``."""
    return (bool(token) and not token.startswith("-") and "/" not in token and "." not in token
            and not Path(token).exists())


def _check_script(path_text: str) -> Path:
    path = Path(path_text)
    if not path.exists():
        raise UsageError(f"script not found: {path_text}", option="SCRIPT",
                         hint="give the path of a Python file, or `-- COMMAND ...` to run another program")
    if path.is_dir():
        raise UsageError(f"{path_text} is a folder, not a script", option="SCRIPT",
                         hint="give the training script inside it, e.g. `jobguard {}/train.py`".format(
                             path_text.rstrip("/")))
    try:
        source = path.read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read {path_text}: {exc.strerror}", option="SCRIPT") from exc
    try:
        compile(source, str(path), "exec", dont_inherit=True)
    except SyntaxError as exc:
        from guard.preflight.script import syntax_error_text

        shown = syntax_error_text(exc).replace("\n", "\n[guard] ")
        raise PreflightError(f"{path_text} does not parse: {shown}", check="script",
                             hint=f"fix the syntax error at {path.name} line {exc.lineno} "
                             f"(python -m py_compile {path_text} shows it)") from exc
    except ValueError as exc:  # null bytes
        raise UsageError(f"{path_text} is not Python source: {exc}", option="SCRIPT") from exc
    return path


def build_config(argv: Sequence[str], environ: Mapping[str, str], *, subcommand: str = "run") -> Config:
    """Parse the command line and the environment into a ``Config``.

    Raises:
        UsageError: a malformed option, a missing or broken script, no job given.
    """
    options, job, command_form = _split(argv)
    flags = vars(_parser().parse_args(options))
    values, sources = resolve(flags, environ)
    script: Path | None = None
    script_args: tuple[str, ...] = ()
    command: tuple[str, ...] = ()
    if command_form:
        if not job:
            raise UsageError("nothing after `--`: give the command to run", option="--",
                             hint="e.g. jobguard -- torchrun --nproc-per-node 2 train.py")
        if shutil.which(job[0]) is None and not Path(job[0]).exists():
            raise UsageError(f"command not found: {job[0]}", option="COMMAND",
                             hint="check the spelling and PATH inside the container")
        command = tuple(job)
    elif job:
        script = _check_script(job[0])
        script_args = tuple(job[1:])
        command = (sys.executable, str(script), *script_args)
    elif subcommand == "run":
        raise UsageError("no job given: name a script or `-- COMMAND`", option="SCRIPT",
                         hint="jobguard train.py, or jobguard -- torchrun ... train.py")
    if values["timeout"] is not None and values["timeout"] <= 0:
        raise UsageError("--timeout must be more than 0 seconds", option="--timeout")
    if values["grace"] <= 0:
        raise UsageError("--grace must be more than 0 seconds", option="--grace")
    if values["push_to"]:
        from guard.secure.dest import parse_destination

        parse_destination(values["push_to"])  # a malformed or ambiguous DEST is a usage error before anything runs
    return Config(values=values, sources=sources, command=command, script=script, script_args=script_args,
                  subcommand=subcommand, environ=dict(environ))


# ---------------------------------------------------------------------------------------------------------------
# Logging and output
# ---------------------------------------------------------------------------------------------------------------


class _MaskingFormatter(logging.Formatter):
    def __init__(self, masker: Masker, fmt: str = "[guard] %(message)s") -> None:
        super().__init__(fmt)
        self.masker = masker

    def format(self, record: logging.LogRecord) -> str:
        text = self.masker.mask_text(super().format(record))
        # The job's last line is unfinished (a progress bar): start a new line.
        return LINES.line_break(2).decode() + text


def _setup_logging(masker: Masker, environ: Mapping[str, str]) -> None:
    """The guard's logger, plus a handler on the root logger for every other logger (a library's warning) and for
    ``warnings`` (``logging.captureWarnings``): both masked by a ``MaskingFilter`` on the handler."""
    logger = logging.getLogger("guard")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    handler = LogSink(2, prefix=LINES.line_break)  # never blocks: a paused stderr drops (and counts) lines
    handler.setFormatter(_MaskingFormatter(masker))
    handler.addFilter(MaskingFilter(masker))
    logger.addHandler(handler)
    level = log_level(environ)
    logger.setLevel(level if isinstance(logging.getLevelName(level), int) else "INFO")
    logger.propagate = False
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "guard_masked", False)]:
        root.removeHandler(old)
    other = LogSink(2, prefix=LINES.line_break)
    other.guard_masked = True  # type: ignore[attr-defined]
    other.setFormatter(_MaskingFormatter(masker, "[guard] %(name)s: %(levelname)s: %(message)s"))
    other.addFilter(MaskingFilter(masker))
    root.addHandler(other)
    logging.captureWarnings(True)


def _version_of(dist: str) -> str:
    """The installed version of ``dist`` from its ``*.dist-info``/``*.egg-info`` folder on ``sys.path`` (the first
    one, as ``importlib.metadata.version`` finds it, without its 20-40 ms of imports at every start)."""
    wanted = dist.lower().replace("-", "_")
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for name in names:
            stem, dot, kind = name.rpartition(".")
            if kind not in ("dist-info", "egg-info") or not dot:
                continue
            project = stem.split("-", 1)[0].lower().replace("-", "_").replace(".", "_")
            if project != wanted:
                continue
            for meta in ("METADATA", "PKG-INFO"):
                try:
                    with open(os.path.join(entry or ".", name, meta), encoding="utf-8", errors="replace") as file:
                        for line in file:
                            if line.startswith("Version:"):
                                return line.split(":", 1)[1].strip()
                            if not line.strip():
                                break
                except OSError:
                    continue
    return "not installed"


def _log_config(config: Config) -> None:
    platform = detect(config.environ)
    log.info("jobguard %s, Python %s (%s), torch %s, transformers %s (from package metadata)", __version__,
             sys.version.split()[0], sys.executable, _version_of("torch"), _version_of("transformers"))
    log.info("platform: %s", platform.describe())
    if config.command:
        form = "script" if config.script else "command"
        log.info("job (%s form): %s", form, " ".join(config.command[1:] if config.script else config.command))
    _log_node(config)
    rows = config.describe()
    width = max(len(flag) for flag, _, _ in rows)
    shown = [row for row in rows if row[2] != "default"]
    if not log.isEnabledFor(logging.DEBUG):  # every option at DEBUG (and in the report); those set at INFO
        log.info("options set (value, source): %s", ", ".join(f"{flag} {value} ({source})"
                                                            for flag, value, source in shown) or "none, all defaults")
    log.debug("options (value, source):\n%s", "\n".join(
        f"[guard]   {flag:<{width}}  {value}  ({source})" for flag, value, source in rows))


def _log_node(config: Config) -> None:
    """This node's identity and where each part came from (``guard.run.nodes``); what disagreed, and a run id
    that the other nodes cannot share."""
    node = config.settings.secure.node
    log.info("node: %s", node.describe())
    for conflict in node.conflicts:
        log.warning("node identity: %s", conflict)
    if node.many and node.run_id_source == "default" and node.node_rank == 0:
        log.info("%d nodes and no run id from the launcher or the scheduler: this node's run id %s goes to the other "
                 "nodes through the job's store once its ranks set up torch.distributed", node.nodes, node.run_id)
    elif node.many and node.run_id_source == "default":
        log.info("%d nodes and no run id from the launcher or the scheduler: this node takes node 0's guard's run id "
                 "from the job's store once its ranks set up torch.distributed (until then: its own, %s)",
                 node.nodes, node.run_id)


#: Before the VERDICT, how long the guard waits for a paused stderr to take its buffered log lines (seconds).
LOG_DRAIN_S = 1.0


def _log_lines_dropped() -> int:
    """Drain the guard's log sinks (up to ``LOG_DRAIN_S``); how many log lines never got out."""
    sinks = [h for h in (*logging.getLogger("guard").handlers, *logging.getLogger().handlers) if isinstance(h, LogSink)]
    if sinks:
        sinks[0].drain(LOG_DRAIN_S)
    return sum(sink.dropped for sink in sinks)


def _emit_verdict(result: RunResult, masker: Masker, report: str | None) -> int:
    settle_exit_code(result)  # a job's own exit code never reads as one of the guard's (75: secured, resume)
    dropped = _log_lines_dropped()
    if dropped:
        result.extra.setdefault("log_lines_dropped", dropped)
    if report:
        try:
            write_report(report, result, masker)
        except OSError as exc:
            log.error("cannot write the report %s: %s", report, exc.strerror or exc)
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    line = render_line(result, masker) + "\n"
    try:  # the VERDICT starts a line, also after a job's unfinished last line (stdout, or a merged log)
        os.write(1, LINES.line_break(1) + line.encode())
    except OSError:
        pass
    return result.exit_code


# ---------------------------------------------------------------------------------------------------------------
# Stages
# ---------------------------------------------------------------------------------------------------------------


def _run(config: Config, masker: Masker, started: float) -> RunResult:
    from guard.run.stages import run_job

    return run_job(config, masker, started)


def _preflight_only(config: Config, masker: Masker, started: float) -> RunResult:
    from guard.run.stages import preflight_only

    return preflight_only(config, masker, started)


def _end_children() -> None:
    """SIGKILL every process this one started (preflight's import children; the job never started on this
    path), so that none outlives the guard (CONTRACT.md, "Processes")."""
    try:
        import psutil

        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
    except ImportError:
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m guard`` and the ``jobguard`` console script. Returns the exit code."""
    started = time.monotonic()
    args = list(sys.argv[1:] if argv is None else argv)
    environ = dict(os.environ)
    # Secrets: the environment's, and the values of secret-named options on the command line (the job's own
    # `--wandb-key VALUE` included): masked in every line the guard writes and in the job's output.
    masker = Masker(secret_values(environ) + command_line_secrets(args) + webhook_secrets(args, environ))
    _setup_logging(masker, environ)
    if args[:1] == ["watch"]:
        from guard import watch

        return watch.main(args[1:])
    AFTER_VERDICT.defer()  # the job's leftovers are waited for after the VERDICT, never before it
    subcommand = "preflight" if args[:1] == ["preflight"] else "run"
    if subcommand == "preflight":
        args = args[1:]
    report: str | None = environ.get(env_name("report")) or None
    config: Config | None = None
    try:
        config = build_config(args, environ, subcommand=subcommand)
        report = config.settings.report
        _log_config(config)
        runner = _preflight_only if subcommand == "preflight" else _run
        result = runner(config, masker, started)
    except GuardError as exc:
        log.error("%s", exc.message)
        if exc.hint:
            log.error("hint: %s", exc.hint)
        if debug_enabled(environ) and exc.exit_code == EXIT_GUARD_ERROR:
            log.error("%s", traceback.format_exc())
        extra: dict[str, Any] = {}
        if isinstance(exc, PreflightError):
            extra["check"] = exc.check
        result = RunResult("FAIL", exc.reason, exc.exit_code, time.monotonic() - started, hint=exc.hint, extra=extra)
    except KeyboardInterrupt:
        result = RunResult("INTERRUPTED", "signal", 128 + signal.SIGINT, time.monotonic() - started,
                           extra={"signal": signal_name(signal.SIGINT)})
    except Exception as exc:  # noqa: BLE001 - the guard's own fault: still one VERDICT
        log.error("internal error: %r", exc)
        if debug_enabled(environ):
            log.error("%s", traceback.format_exc())
        hint = "set GUARD_DEBUG=1 for the traceback and report it as a bug"
        result = RunResult("FAIL", "guard_error", EXIT_GUARD_ERROR, time.monotonic() - started, hint=hint)
    result.elapsed_s = time.monotonic() - started
    if config is not None:  # every option in the report (the log shows only those set, at INFO)
        result.details.setdefault("options", {flag: {"value": value, "source": source}
                                              for flag, value, source in config.describe()})
    code = _emit_verdict(result, masker, report)
    AFTER_VERDICT.run()
    from guard.run import stages

    if config is not None and subcommand == "run":
        stages.requeue(config, result)  # after the VERDICT and the report: Slurm's SIGTERM may follow at once
    if "guard.observe.alerts" in sys.modules:  # alert POSTs still in flight (the verdict's): a bounded, silent wait
        from guard.observe.alerts import AFTER_VERDICT_WAIT_S, wait_for_webhooks

        wait_for_webhooks(AFTER_VERDICT_WAIT_S)
    if stages.abandoned_work:  # preflight left running after a signal: end its children, do not wait at exit
        _end_children()
        leave(code)
    return code


def leave(code: int) -> NoReturn:
    """End the guard process with ``code`` now: the log's handlers and the standard streams flushed, then
    ``os._exit``, without the interpreter's finalization (20 ms of tearing down some 200 modules, after the VERDICT,
    on every run). Only once ``main`` returned: its threads are daemons with nothing left to do, its thread pools
    joined, its temporary folders removed, and nothing of the guard registers an ``atexit`` handler. Under a
    profiler or a tracer (``python -m cProfile -m guard``, coverage: ``sys.getprofile()``/``sys.gettrace()`` set),
    which write their results when the interpreter ends, it is ``sys.exit(code)`` instead.

    Raises:
        SystemExit: under a profiler or a tracer, with ``code``."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()
    if sys.getprofile() is not None or sys.gettrace() is not None:
        sys.exit(code)
    os._exit(code)


def entry() -> NoReturn:
    """``python -m guard`` and the ``jobguard`` console script: ``main()``, then ``leave`` with its exit code."""
    leave(main())
