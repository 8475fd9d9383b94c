"""Options, their parsing, and the one place where ``GUARD_*`` environment variables are read.

Every option resolves as: the command-line flag, else the environment variable ``GUARD_<OPTION>``, else the
default (see ``OPTIONS``). The resolved ``Config`` is frozen and remembers where each value came from
(``Config.sources``: ``"flag"``, ``"env"`` or ``"default"``), so the config log can say it.

The supervisor -> agent variables (``GUARD_AGENT_*``, named in ``guard.protocol``) are the one exception: the
in-job agent reads them itself (``guard.inside.settings``, stdlib only), so that code running inside the job never
imports this module; ``AgentSettings`` and ``agent_settings`` are re-exported here.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from guard.core.durations import format_duration_s, parse_duration, parse_size
from guard.errors import UsageError
from guard.inside.settings import AgentSettings, agent_settings
from guard.run.nodes import NodeIdentity, resolve_node
from guard.secure.cadence import PUSH_STALL_S

__all__ = [
    "FINAL_PUSH_WINDOW_S",
    "OPTIONS",
    "AgentSettings",
    "Config",
    "JobSettings",
    "ObserveSettings",
    "Option",
    "PreflightSettings",
    "RunSettings",
    "SecureSettings",
    "WatchSettings",
    "agent_settings",
    "alert_webhook_url",
    "debug_enabled",
    "env_name",
    "format_duration_s",
    "guard_options_in",
    "log_level",
    "parse_duration",
    "parse_size",
    "resolve",
    "run_settings",
    "webhook_secrets",
]

#: ``--final-push-window``'s default: with no deadline, the final push and its retries end within 3 minutes.
FINAL_PUSH_WINDOW_S = 180.0

TRUE_VALUES = frozenset({"1", "true", "yes", "on"})
FALSE_VALUES = frozenset({"0", "false", "no", "off", ""})







def _parse_count(text: str, *, option: str) -> int:
    try:
        value = int(str(text).strip())
    except ValueError:
        value = -1
    if value < 0:
        raise UsageError(f"{option}: {text!r} is not a whole number >= 0", option=option)
    return value


def _parse_nodes(text: str, *, option: str) -> int:
    value = _parse_count(text, option=option)
    if value < 1:
        raise UsageError(f"{option}: {text!r} is not a node count (a whole number >= 1)", option=option)
    return value


#: A run id goes into paths at the destination (``.guard/staging/<run_id>/``): letters, digits, ``.``, ``_``, ``-``.
RUN_ID_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"


def _parse_run_id(text: str, *, option: str) -> str:
    value = str(text).strip()
    if not re.fullmatch(RUN_ID_PATTERN, value):
        raise UsageError(f"{option}: {text!r} is not a run id: 1-128 letters, digits, '.', '_' or '-', starting with "
                         "a letter or digit", option=option, hint="e.g. --run-id $SLURM_JOB_ID")
    return value


def _parse_factor(text: str, *, option: str) -> float:
    try:
        value = float(str(text).strip())
    except ValueError:
        value = -1.0
    if not math.isfinite(value) or value < 0 or 0 < value <= 1:
        raise UsageError(f"{option}: {text!r} is not a factor above 1 (or 0: off)", option=option)
    return value


def _parse_bool(text: str, *, option: str) -> bool:
    low = str(text).strip().lower()
    if low in TRUE_VALUES:
        return True
    if low in FALSE_VALUES:
        return False
    raise UsageError(f"{option}: {text!r} is not a boolean; accepted: 1/0, true/false, yes/no, on/off", option=option)


def _parse_margin(text: str, *, option: str) -> float | None:
    if str(text).strip().lower() == "auto":
        return None
    return parse_duration(text, option=option)


def _parse_skip(text: str, *, option: str) -> tuple[str, str]:
    name, sep, reason = str(text).partition("=")
    if not sep or not name.strip() or not reason.strip():
        raise UsageError(f"{option}: {text!r} must be NAME=REASON (the reason is shown in the table)", option=option)
    return name.strip(), reason.strip()


def _parse_resume(text: str, *, option: str) -> str:
    low = str(text).strip().lower()
    if low in TRUE_VALUES:
        return "on"
    if low in FALSE_VALUES:
        return "off"
    if low in ("if-valid", "auto"):
        return low
    raise UsageError(f"{option}: {text!r}; accepted: on, off, if-valid, auto", option=option)


def _parse_shards(text: str, *, option: str) -> tuple[str, int | None]:
    """``GLOB[:MIN]`` -> ``(glob, min or None)``; a ``:`` followed by anything but digits belongs to the glob."""
    raw = str(text).strip()
    pattern, sep, count = raw.rpartition(":")
    if sep and count.strip().isdigit():
        if not pattern.strip() or int(count) < 1:
            raise UsageError(f"{option}: {text!r} must be GLOB or GLOB:MIN with MIN >= 1", option=option)
        return pattern.strip(), int(count)
    if not raw:
        raise UsageError(f"{option}: an empty value is not allowed", option=option)
    return raw, None


def _parse_smoke(text: str, *, option: str) -> str:
    low = str(text).strip().lower()
    if low in TRUE_VALUES - {""}:
        return "on"
    if low in FALSE_VALUES - {""}:
        return "off"
    if low == "auto":
        return "auto"
    raise UsageError(f"{option}: {text!r}; accepted: auto, on, off", option=option)


def _parse_uv(text: str, *, option: str) -> str:
    low = str(text).strip().lower()
    if low in TRUE_VALUES:
        return "on"
    if low in FALSE_VALUES:
        return "off"
    if low == "auto":
        return low
    raise UsageError(f"{option}: {text!r}; accepted: auto, on, off", option=option)


ALERT_LEVELS = ("info", "warn", "error")  # trackio.AlertLevel's values, lowest first


def _parse_alert_level(text: str, *, option: str) -> str:
    low = str(text).strip().lower()
    if low == "warning":
        low = "warn"
    if low not in ALERT_LEVELS:
        raise UsageError(f"{option}: {text!r}; accepted: {', '.join(ALERT_LEVELS)}", option=option)
    return low


def _parse_fraction(text: str, *, option: str) -> float:
    try:
        value = float(str(text).strip())
    except ValueError:
        value = math.nan
    if not 0.0 <= value < 1.0:
        raise UsageError(f"{option}: {text!r} is not a fraction from 0 (off) up to, not including, 1", option=option)
    return value


def _parse_text(text: str, *, option: str) -> str:
    value = str(text).strip()
    if not value:
        raise UsageError(f"{option}: an empty value is not allowed", option=option)
    return value


@dataclass(frozen=True)
class Option:
    """One option of ``python -m guard``: flag, env fallback, default and parser.

    ``repeat`` options take the flag several times; their environment form is a comma-separated list.
    """

    name: str
    help: str
    default: Any = None
    parse: Callable[..., Any] | None = _parse_text
    metavar: str | None = None
    repeat: bool = False
    flag_only_bool: bool = False  # a switch such as --dry-run
    bare: str | None = None  # the value of the flag given alone (``--resume`` means ``on``); None: a value is needed
    choices: tuple[str, ...] = ()  # with ``bare``: the words read as the flag's value (anything else is the job's)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def default_text(self) -> str:
        """The default as the README writes it: ``30m`` for 1800 s, ``auto`` for ``--margin``, ``off`` for a
        switch, ``none`` when there is none."""
        value = self.default
        if self.name == "margin":
            return "auto"
        if self.flag_only_bool:
            return "on" if value else "off"
        if value in (None, ()):
            return "none"
        if self.metavar and self.metavar.startswith("DURATION") and isinstance(value, (int, float)):
            return format_duration_s(value)
        return str(value)


def env_name(option_name: str) -> str:
    """``stall_timeout`` -> ``GUARD_STALL_TIMEOUT`` (the contract's rule)."""
    return "GUARD_" + option_name.upper()


OPTIONS: tuple[Option, ...] = (
    # --- the contract's options ---
    Option("timeout", "the job's wall-clock budget, counted from the job's start", None,
           lambda t, option: parse_duration(t, option=option), "DURATION"),
    Option("started_at", "when the job started: epoch seconds or ISO 8601", None, _parse_text, "TIME"),
    Option("margin", "time kept free before the deadline for the final save and push, or auto", None,
           _parse_margin, "DURATION|auto"),
    Option("grace", "time between a termination signal and the platform's SIGKILL", 30.0,
           lambda t, option: parse_duration(t, option=option), "DURATION"),
    Option("push_to", "where secured checkpoints go: hf://NS/NAME, hf://datasets/NS/NAME, NS/NAME, "
           "s3://BUCKET/PREFIX or a path", None, _parse_text, "DEST"),
    Option("output_dir", "where the job writes its checkpoints", None, _parse_text, "DIR"),
    Option("node_rank", "this node's index in a many-node job (one guard per node); the launcher's arguments "
           "(torchrun --node-rank, accelerate launch --machine_rank), Slurm (SLURM_NODEID) and Kubernetes "
           "(JOB_COMPLETION_INDEX) come first", None, _parse_count, "N"),
    Option("nodes", "the node count of a many-node job; the launcher's arguments (torchrun --nnodes, accelerate "
           "launch --num_machines) and Slurm (SLURM_NNODES) come first", None, _parse_nodes, "N"),
    Option("run_id", "this run's id, the same on every node (it names the run's parts at the destination); by "
           "default torchrun --rdzv-id, Slurm's job id (and requeue count), else a new one per guard", None,
           _parse_run_id, "ID"),
    Option("background_push", "with a destination, push each complete checkpoint as the job saves it: on, off",
           True, _parse_bool, "on|off"),
    Option("final_push_window", "with no deadline, how long the final push (upload, verification and its retries) "
           "may take after the job ended; an upload estimated to take longer gets 3x its estimate", FINAL_PUSH_WINDOW_S,
           lambda t, option: parse_duration(t, option=option), "DURATION"),
    Option("push_interval", "the least time between two background pushes (the Hub's commit rate limits)", 600.0,
           lambda t, option: parse_duration(t, option=option), "DURATION"),
    Option("push_stall", "a push that moved no byte for this long is logged and, when a newer complete checkpoint "
           "exists, replaced by its push (0: off)", PUSH_STALL_S, lambda t, option: parse_duration(t, option=option),
           "DURATION"),
    Option("sanity_steps", "training steps whose loss must be finite", 5, _parse_count, "N"),
    Option("dry_run", "stop the job once the sanity steps pass", False, _parse_bool, flag_only_bool=True),
    Option("stall_timeout", "no training step (before the first: no output) for this long is a hang (0: off)", 1800.0,
           lambda t, option: parse_duration(t, option=option), "DURATION"),
    Option("require_env", "an environment variable that must be set and non-empty (repeatable)", (),
           _parse_text, "NAME", repeat=True),
    Option("report", "write the JSON report there (atomically)", None, _parse_text, "FILE"),
    # --- preflight ---
    Option("require_model", "a Hub model id the job needs (repeatable)", (), _parse_text, "ID", repeat=True),
    Option("require_dataset", "a Hub dataset id the job needs (repeatable)", (), _parse_text, "ID", repeat=True),
    Option("require_gpus", "the number of GPUs the job needs", None, _parse_count, "N"),
    Option("gpu_type", "text the GPU name must contain (e.g. H100)", None, _parse_text, "NAME"),
    Option("min_free_disk", "free disk space the output folder needs", None,
           lambda t, option: parse_size(t, option=option), "SIZE"),
    Option("expected_duration", "how long the job should take; preflight fails if the timeout is under 1.3x",
           None, lambda t, option: parse_duration(t, option=option), "DURATION"),
    Option("skip_check", "turn a preflight check into n/a with a reason (repeatable)", (), _parse_skip,
           "NAME=REASON", repeat=True),
    Option("require_shards", "local data files the job reads: GLOB[:MIN] files at least, each readable in its "
           "format (repeatable)", (), _parse_shards, "GLOB[:MIN]", repeat=True),
    Option("launch_smoke", "before a torchrun/accelerate launch job, a tiny all_reduce under the same launcher: "
           "auto (more than one process or node), on, off (alone: on)", "auto", _parse_smoke, "auto|on|off", bare="on",
           choices=("on", "off", "auto", "1", "0", "true", "false", "yes", "no")),
    Option("launch_smoke_timeout", "time limit of the launch smoke", 120.0,
           lambda t, option: parse_duration(t, option=option), "DURATION"),
    Option("no_preflight", "skip every preflight check (each is listed as n/a)", False, _parse_bool,
           flag_only_bool=True),
    # --- resume, watch internals ---
    Option("resume", "fetch DEST/last-checkpoint before the job starts: on, off, if-valid, auto (alone: on)", "auto",
           _parse_resume, "MODE", bare="on",
           choices=("on", "off", "if-valid", "auto", "1", "0", "true", "false", "yes", "no")),
    Option("uv", "run a PEP 723 script in the environment uv builds for it: auto (when the guard runs under uv "
           "and the script's dependencies are missing here), on, off", "auto", _parse_uv, "MODE"),
    Option("requeue", "after a secured TIMEOUT/INTERRUPTED under Slurm, run `scontrol requeue $SLURM_JOB_ID`", False,
           _parse_bool, flag_only_bool=True),
    Option("check_every", "after the sanity pass, read the loss from the device every N steps", 10,
           _parse_count, "N"),
    Option("max_skipped_steps", "optimizer steps in a row a GradScaler may skip (inf/NaN gradients: the fp16 loss "
           "scale collapsing) before the run fails as non_finite_loss; 0: off", 50, _parse_count, "N"),
    Option("loss_rise_factor", "a loss above this many times its early level (the lower of the first loss and the "
           "median of the first 5 steps) for --loss-rise-steps steps in a row is a sustained rise: named once, a "
           "warning on the verdict; 0: off", 10.0,
           _parse_factor, "K"),
    Option("loss_rise_steps", "training steps the loss must stay above --loss-rise-factor x its early level, or "
           "exactly the same (the weights not updated), to be named in a warning",
           20, _parse_count, "N"),
    Option("heartbeat", "interval of the [guard] heartbeat line (0: off)", 300.0,
           lambda t, option: parse_duration(t, option=option), "DURATION"),
    Option("trackio", "log losses, heartbeats and the verdict into this trackio project (jobguard[trackio])", None,
           _parse_text, "PROJECT"),
    Option("alert_webhook", "send the guard's alerts (non-finite loss, stall, loss rise, slow steps, securing, "
           "pushes, the VERDICT) to this Slack, Discord or JSON webhook through trackio (jobguard[trackio]); "
           "TRACKIO_WEBHOOK_URL when unset", None, _parse_text, "URL"),
    Option("alert_level", "the lowest alert level sent to the webhook: info, warn, error (the dashboard keeps all)",
           "info", _parse_alert_level, "LEVEL"),
    Option("alert_throughput_drop", "warn when the step rate over --alert-throughput-window falls below this "
           "fraction of the run's own median rate (0: off)", 0.5, _parse_fraction, "FRACTION"),
    Option("alert_throughput_window", "the window of the throughput-drop alert", 300.0,
           lambda t, option: parse_duration(t, option=option), "DURATION"),
)



@dataclass(frozen=True)
class Config:
    """The resolved options of one guard run (frozen).

    Components read ``settings`` (typed, built once here; each gets its own part: ``settings.watch`` the loop,
    ``settings.secure`` the budget and securing, ``settings.preflight`` the checks ...); ``values`` is the option
    table's view, for the config log (``describe``). Options are not attributes (``config.grace`` raises
    ``AttributeError``): a component reads its typed part, e.g. ``config.settings.watch.grace_s``.

    Attributes:
        values: option name -> parsed value (durations in seconds, sizes in bytes, repeatable options as tuples).
        sources: option name -> ``"flag"``, ``"env"`` or ``"default"``.
        script: the job's script (script form), or None.
        command: the job's command: ``[python, script, *args]`` in script form, or the command after ``--``.
        script_args: arguments after the script.
        subcommand: ``run`` (default), ``preflight``.
        environ: the environment the options were resolved from (and the job's, before the guard's additions).
        settings: the typed settings (``RunSettings``).
    """

    values: Mapping[str, Any]
    sources: Mapping[str, str]
    command: tuple[str, ...] = ()
    script: Path | None = None
    script_args: tuple[str, ...] = ()
    subcommand: str = "run"
    environ: Mapping[str, str] = field(default_factory=dict, repr=False)
    settings: RunSettings = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "settings", run_settings(self.values, self.sources, command=self.command,
                                                          script=self.script, script_args=self.script_args,
                                                          environ=self.environ))

    def describe(self) -> list[tuple[str, str, str]]:
        """Rows ``(option, value, source)`` for the config log; secrets are masked by the caller's masker."""
        rows = []
        for opt in OPTIONS:
            value = self.values[opt.name]
            if opt.name == "require_shards":
                text = ",".join(f"{glob}:{count}" if count else glob for glob, count in value) or "-"
            elif isinstance(value, tuple):
                text = ",".join("=".join(v) if isinstance(v, tuple) else str(v) for v in value) or "-"
            elif value is None:
                text = "auto" if opt.name == "margin" else "-"
            elif opt.metavar and opt.metavar.startswith("DURATION") and isinstance(value, float):
                text = format_duration_s(value)
            elif isinstance(value, bool):
                text = "on" if value else "off"
            else:
                text = str(value)
            rows.append((opt.flag, text, self.sources[opt.name]))
        return rows


# ---------------------------------------------------------------------------------------------------------------
# Typed settings, built once per Config: each component gets its own part, never the string-keyed values
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WatchSettings:
    """What the supervisor's loop and its watchdog need.

    Attributes:
        sanity_steps: ``--sanity-steps``: training steps whose loss must be finite.
        check_every: ``--check-every``: after the sanity pass, the loss is read every N steps.
        stall_timeout_s: ``--stall-timeout`` in seconds (0: off).
        dry_run: ``--dry-run``: stop the job once the sanity steps pass.
        max_skipped_steps: ``--max-skipped-steps`` (0: off).
        grace_s: ``--grace`` in seconds: SIGTERM -> SIGKILL.
        loss_rise_factor: ``--loss-rise-factor`` (k; 0: off). loss_rise_steps: ``--loss-rise-steps`` (the window).
    """

    sanity_steps: int
    check_every: int
    stall_timeout_s: float
    dry_run: bool
    max_skipped_steps: int
    grace_s: float
    loss_rise_factor: float
    loss_rise_steps: int


@dataclass(frozen=True)
class SecureSettings:
    """What the time budget, the resume and securing need.

    Attributes:
        timeout_s: ``--timeout`` in seconds, or None; ``timeout_option``: the flag or variable it came from.
        started_at: ``--started-at`` text, or None; ``started_at_option`` likewise.
        margin_s: ``--margin`` in seconds, or None (auto).
        grace_s: ``--grace`` in seconds.
        push_to: ``--push-to`` text, or None.
        output_dir: ``--output-dir``, or None; ``output_dir_from_flag``: given as the flag (not the variable).
        background_push: ``--background-push``.
        push_interval_s: ``--push-interval`` in seconds.
        push_stall_s: ``--push-stall`` in seconds (0: off; ``guard.secure.cadence.PUSH_STALL_S`` by default).
        resume: ``--resume`` mode (``on``, ``off``, ``if-valid``, ``auto``).
        requeue: ``--requeue``.
        final_push_window_s: ``--final-push-window`` in seconds (securing after a good end with no deadline).
        run_id: this run's id, the same on every node of the job (``--run-id``, else the launcher's or Slurm's
            id, else a new one: ``guard.run.nodes``).
        node_rank: this node's index (``--node-rank`` and the sources before it, ``guard.run.nodes``); 0 on one node.
        nodes: the job's node count; 1 on one node.
        node: the whole :class:`guard.run.nodes.NodeIdentity` (where each value came from, what disagreed).
    """

    timeout_s: float | None
    timeout_option: str
    started_at: str | None
    started_at_option: str
    margin_s: float | None
    grace_s: float
    push_to: str | None
    output_dir: str | None
    output_dir_from_flag: bool
    background_push: bool
    push_interval_s: float
    resume: str
    requeue: bool
    final_push_window_s: float
    push_stall_s: float = PUSH_STALL_S
    run_id: str = ""
    node_rank: int = 0
    nodes: int = 1
    node: NodeIdentity = field(default_factory=NodeIdentity)


@dataclass(frozen=True)
class PreflightSettings:
    """What preflight checks against (the ``--require-*`` options and their kin)."""

    no_preflight: bool
    require_env: tuple[str, ...]
    require_model: tuple[str, ...]
    require_dataset: tuple[str, ...]
    require_gpus: int | None
    gpu_type: str | None
    min_free_disk_bytes: int | None
    expected_duration_s: float | None
    skip_check: tuple[tuple[str, str], ...]
    require_shards: tuple[tuple[str, int | None], ...]
    launch_smoke: str
    launch_smoke_timeout_s: float


@dataclass(frozen=True)
class ObserveSettings:
    """The heartbeat, trackio and the alerts: ``heartbeat_s`` (0: off), ``trackio`` (a project name, or None),
    ``alert_webhook`` (``--alert-webhook`` URL, or None), ``alert_level`` (the lowest level sent),
    ``alert_throughput_drop`` (a fraction of the median steps/s; 0: off), ``alert_throughput_window_s``."""

    heartbeat_s: float
    trackio: str | None
    alert_webhook: str | None
    alert_level: str
    alert_throughput_drop: float
    alert_throughput_window_s: float


@dataclass(frozen=True)
class JobSettings:
    """The job: ``command`` (its argv), ``script`` and ``script_args`` (script form), ``uv`` (``--uv`` mode)."""

    command: tuple[str, ...]
    script: Path | None
    script_args: tuple[str, ...]
    uv: str


@dataclass(frozen=True)
class RunSettings:
    """Every option of one run, typed and grouped by the component that reads it (built once per ``Config``)."""

    watch: WatchSettings
    secure: SecureSettings
    preflight: PreflightSettings
    observe: ObserveSettings
    job: JobSettings
    report: str | None


def _option_label(name: str, sources: Mapping[str, str]) -> str:
    opt = next(o for o in OPTIONS if o.name == name)
    return opt.flag if sources.get(name) == "flag" else env_name(name)


def run_settings(values: Mapping[str, Any], sources: Mapping[str, str], *, command: Sequence[str] = (),
                 script: Path | None = None, script_args: Sequence[str] = (),
                 environ: Mapping[str, str] | None = None) -> RunSettings:
    """Build the typed settings from resolved ``values`` (see ``resolve``); the one place that reads them.
    ``environ`` (default: empty) is where the node's identity is read from besides the options
    (``guard.run.nodes.resolve_node``: the launcher's, Slurm's and Kubernetes' variables)."""
    def opt_float(name: str) -> float | None:
        value = values.get(name)
        return None if value is None else float(value)

    grace_s = float(values["grace"])
    node = resolve_node(environ or {}, command, node_rank=values.get("node_rank"), nodes=values.get("nodes"),
                        run_id=values.get("run_id"), node_rank_source=_option_label("node_rank", sources),
                        nodes_source=_option_label("nodes", sources), run_id_source=_option_label("run_id", sources))
    watch = WatchSettings(sanity_steps=int(values["sanity_steps"]), check_every=int(values["check_every"]),
                          stall_timeout_s=float(values["stall_timeout"]), dry_run=bool(values["dry_run"]),
                          max_skipped_steps=int(values.get("max_skipped_steps") or 0), grace_s=grace_s,
                          loss_rise_factor=float(values.get("loss_rise_factor") or 0.0),
                          loss_rise_steps=int(values.get("loss_rise_steps") or 20))
    secure = SecureSettings(
        timeout_s=opt_float("timeout"), timeout_option=_option_label("timeout", sources),
        started_at=values.get("started_at"), started_at_option=_option_label("started_at", sources),
        margin_s=opt_float("margin"), grace_s=grace_s, push_to=values.get("push_to") or None,
        output_dir=values.get("output_dir") or None, output_dir_from_flag=sources.get("output_dir") == "flag",
        background_push=bool(values["background_push"]), push_interval_s=float(values["push_interval"]),
        resume=str(values["resume"]), requeue=bool(values["requeue"]),
        final_push_window_s=float(values.get("final_push_window") or FINAL_PUSH_WINDOW_S),
        push_stall_s=float(values.get("push_stall", PUSH_STALL_S)), run_id=node.run_id, node_rank=node.node_rank,
        nodes=node.nodes, node=node)
    min_free = values.get("min_free_disk")
    preflight = PreflightSettings(
        no_preflight=bool(values["no_preflight"]), require_env=tuple(values["require_env"]),
        require_model=tuple(values["require_model"]), require_dataset=tuple(values["require_dataset"]),
        require_gpus=values.get("require_gpus"), gpu_type=values.get("gpu_type"),
        min_free_disk_bytes=None if min_free is None else int(min_free),
        expected_duration_s=opt_float("expected_duration"), skip_check=tuple(values["skip_check"]),
        require_shards=tuple(values["require_shards"]), launch_smoke=str(values["launch_smoke"]),
        launch_smoke_timeout_s=float(values["launch_smoke_timeout"]))
    observe = ObserveSettings(heartbeat_s=float(values["heartbeat"]), trackio=values.get("trackio") or None,
                              alert_webhook=values.get("alert_webhook") or None,
                              alert_level=str(values.get("alert_level") or "info"),
                              alert_throughput_drop=float(values.get("alert_throughput_drop") or 0.0),
                              alert_throughput_window_s=float(values.get("alert_throughput_window") or 300.0))
    job = JobSettings(command=tuple(command), script=script, script_args=tuple(script_args), uv=str(values["uv"]))
    return RunSettings(watch=watch, secure=secure, preflight=preflight, observe=observe, job=job,
                       report=values.get("report") or None)


def resolve(flags: Mapping[str, Any], environ: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    """Resolve every option: flag, else ``GUARD_<OPTION>``, else the default.

    Args:
        flags: option name -> raw text(s) from argparse (None, or an empty list, when the flag was not given;
            ``True`` for a switch that was given).
        environ: the environment to read ``GUARD_*`` from.

    Returns:
        ``(values, sources)``.

    Raises:
        UsageError: a malformed value; the message names the flag or the variable and the accepted forms.
    """
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for opt in OPTIONS:
        raw: Any = flags.get(opt.name)
        given = raw not in (None, [], ())
        if given:
            source, label = "flag", opt.flag
        elif environ.get(env_name(opt.name), "").strip():
            raw = environ[env_name(opt.name)]
            source, label = "env", env_name(opt.name)
            if opt.repeat:
                # A comma list; for NAME=REASON items only a comma before the next NAME= separates, so a reason
                # may hold commas itself.
                splitter = r",(?=\s*[\w.-]+=)" if opt.name == "skip_check" else ","
                raw = [part for part in re.split(splitter, raw) if part.strip()]
        else:
            values[opt.name], sources[opt.name] = opt.default, "default"
            continue
        if opt.flag_only_bool and raw is True:
            value: Any = True
        elif opt.repeat:
            value = tuple(opt.parse(item, option=label) if opt.parse else item for item in raw)
        else:
            value = opt.parse(raw, option=label) if opt.parse else raw
        values[opt.name], sources[opt.name] = value, source
    margin_s, timeout_s = values.get("margin"), values.get("timeout")
    if margin_s is not None and timeout_s is not None and float(margin_s) >= float(timeout_s):
        label = "--margin" if sources.get("margin") == "flag" else env_name("margin")
        raise UsageError(f"{label} {format_duration_s(float(margin_s))} is not less than the budget "
                         f"({format_duration_s(float(timeout_s))}): every run would be stopped at once",
                         option=label, hint="give a margin shorter than --timeout, or --margin auto")
    return values, sources


# ---------------------------------------------------------------------------------------------------------------
# Other GUARD_* variables (not options)
# ---------------------------------------------------------------------------------------------------------------


def debug_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """``GUARD_DEBUG=1``: tracebacks for the guard's own errors."""
    env = os.environ if environ is None else environ
    return env.get("GUARD_DEBUG", "").strip().lower() in TRUE_VALUES


def log_level(environ: Mapping[str, str] | None = None) -> str:
    """``GUARD_LOG_LEVEL`` (default ``INFO``)."""
    env = os.environ if environ is None else environ
    return env.get("GUARD_LOG_LEVEL", "INFO").strip().upper() or "INFO"


def alert_webhook_url(option_url: str | None, environ: Mapping[str, str]) -> tuple[str | None, str]:
    """The webhook the alerts go to and where it came from: ``--alert-webhook``/``GUARD_ALERT_WEBHOOK``
    (``option_url``, ``ObserveSettings.alert_webhook``), else ``TRACKIO_WEBHOOK_URL`` (the variable trackio itself
    reads), else ``(None, "")``."""
    if option_url:
        return option_url, "--alert-webhook"
    fallback = environ.get("TRACKIO_WEBHOOK_URL", "").strip()
    return (fallback, "TRACKIO_WEBHOOK_URL") if fallback else (None, "")


def webhook_secrets(args: Sequence[str], environ: Mapping[str, str]) -> list[str]:
    """Webhook URLs to mask in everything the guard writes (a Slack or Discord webhook URL is a credential):
    ``--alert-webhook URL`` or ``--alert-webhook=URL`` in ``args``, ``GUARD_ALERT_WEBHOOK`` and
    ``TRACKIO_WEBHOOK_URL``. Read before the options are parsed, so that the config log masks them too."""
    found = [environ.get(name, "").strip() for name in (env_name("alert_webhook"), "TRACKIO_WEBHOOK_URL")]
    for i, token in enumerate(args):
        if token == "--alert-webhook" and i + 1 < len(args):
            found.append(args[i + 1])
        elif token.startswith("--alert-webhook="):
            found.append(token.split("=", 1)[1])
    return sorted({url for url in found if url})


def guard_options_in(args: Sequence[str]) -> list[str]:
    """The guard's own flags found among the job's arguments (``--timeout`` in ``train.py --timeout 1h``).

    Everything after the script belongs to the job, so such a flag reaches the job, which may refuse it
    (argparse: exit 2, "unrecognized arguments"). ``--flag=value`` counts too; the job's own ``--`` ends the
    search. Returns the flags in order, each once.
    """
    flags = {opt.flag for opt in OPTIONS}
    found: list[str] = []
    for token in args:
        if token == "--":
            break
        flag = token.split("=", 1)[0]
        if flag in flags and flag not in found:
            found.append(flag)
    return found
