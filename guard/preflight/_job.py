"""What the checks need to know about the job, derived once from the options and the script's facts."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from guard.preflight._models import PreflightOptions
from guard.preflight.cmdline import JobArgs, to_bool
from guard.preflight.script import Mention, ScriptFacts

__all__ = ["HubTarget", "JobView", "args_config", "job_from_config", "parse_push_to"]


@dataclass(frozen=True)
class HubTarget:
    """Where the job writes on the Hub.

    Attributes:
        repo_type: ``model``, ``dataset`` or ``space``.
        repo_id: ``namespace/name``, or None when the Trainer picks the name (``push_to_hub`` without
            ``hub_model_id``: the token's own namespace).
        origin: what asked for it, for messages (``--push-to hf://acme/x``, ``hub_model_id='acme/x'``).
    """

    repo_type: str
    repo_id: str | None
    origin: str

    @property
    def namespace(self) -> str | None:
        """The namespace written to, or None for "the token's user"."""
        return self.repo_id.split("/", 1)[0] if self.repo_id else None


def parse_push_to(text: str | None) -> HubTarget | Path | str | None:
    """Read a ``--push-to`` value (the contract's forms) with ``guard.secure.dest.parse_destination``.

    ``hf://NS/NAME`` and bare ``NS/NAME`` are model repos, ``hf://datasets/NS/NAME`` a dataset repo; an absolute
    path, ``./``, ``../`` or ``file://`` is a folder; ``s3://BUCKET/PREFIX`` an object store (its canonical text).
    None for no value.

    Raises:
        UsageError: the text is none of these forms (from ``parse_destination``).
    """
    if not text or not text.strip():
        return None
    from guard.secure.dest import parse_destination  # lazily: the stores are imported only when opened

    dest = parse_destination(text)
    if dest.kind == "folder" and dest.path is not None:
        return dest.path
    if dest.kind == "s3":
        return str(dest)
    return HubTarget(dest.repo_type or "model", dest.repo_id, f"--push-to {text.strip()}")


@dataclass(frozen=True)
class JobView:
    """The job as the checks see it.

    Attributes:
        config: the Trainer settings known statically (``ScriptFacts.trainer_config``), ``{}`` without a script.
        hub_target: where the job writes on the Hub, or None.
        object_target: the ``s3://BUCKET/PREFIX`` the guard secures to, or None.
        folder_target: the ``--push-to`` folder, or None.
        output_dir: ``--output-dir``, else the script's ``output_dir=`` literal, else None.
        trackers: ``wandb``, ``mlflow``, ``trackio``: what the job reports to.
        trackio_space_id: the trackio Space (script literal or ``TRACKIO_SPACE_ID``), or None.
        trackio_private: whether that Space is asked to be private (None: not said, so public by default).
        mentions: what the script does only on a path that may not be taken (``ScriptFacts.mentions``): the
            checks make these warnings at most.
        args: the job's own command line and config files, as read by ``guard.preflight.cmdline``.
        script_name: the script's file name, for messages.
        settings_source: ``"TrainingArguments"`` when the view comes from the Trainer's actual arguments (the
            agent's report), for messages; None for the static view.
    """

    config: Mapping[str, Any] = field(default_factory=dict)
    hub_target: HubTarget | None = None
    object_target: str | None = None
    folder_target: Path | None = None
    output_dir: Path | None = None
    trackers: frozenset[str] = frozenset()
    trackio_space_id: str | None = None
    trackio_private: bool | None = None
    mentions: tuple[Mention, ...] = ()
    args: JobArgs = field(default_factory=JobArgs)
    script_name: str = "the script"
    settings_source: str | None = None

    @classmethod
    def build(cls, opts: PreflightOptions, facts: ScriptFacts | None, environ: Mapping[str, str],
              args: JobArgs | None = None) -> JobView:
        """Combine the options, the job's command line, the script's facts and the environment.

        Precedence: the guard's options, then the job's command line (and its config file), then the script's
        literals.
        """
        args = args or JobArgs()
        config = dict(facts.trainer_config) if facts else {}
        config.update(args_config(args))
        dest = parse_push_to(opts.push_to)
        hub_target = dest if isinstance(dest, HubTarget) else None
        if hub_target is None and (args.flag("push_to_hub") or (
                args.text("hub_model_id") and args.flag("push_to_hub") is None)):
            repo_id = args.text("hub_model_id")
            origin = args.source("hub_model_id", repo_id) if repo_id else args.source("push_to_hub")
            hub_target = HubTarget("model", repo_id if repo_id and "/" in repo_id else None, origin)
        if hub_target is None and config.get("push_to_hub") is True:
            repo_id = config.get("hub_model_id")
            origin = f"hub_model_id={repo_id!r}" if repo_id else "push_to_hub=True"
            hub_target = HubTarget("model", repo_id if isinstance(repo_id, str) and "/" in repo_id else None, origin)
        if hub_target is None and facts is not None and facts.push_calls and args.flag("push_to_hub") is not False:
            named = next((repo for repo in facts.push_calls if repo), "")
            repo_id = named or config.get("hub_model_id") or None
            origin = f"push_to_hub({named!r}) in {facts.path.name}" if named else f"push_to_hub() in {facts.path.name}"
            hub_target = HubTarget("model", repo_id if isinstance(repo_id, str) and "/" in repo_id else None, origin)
        output = opts.output_dir or (Path(config["output_dir"]) if isinstance(config.get("output_dir"), str) else None)
        report_to = config.get("report_to") or []
        if any(str(t).lower() == "all" for t in report_to):  # every integration installed (transformers)
            report_to = [name for name in ("wandb", "mlflow", "trackio") if importlib.util.find_spec(name)]
        trackers = {str(t).lower() for t in report_to if str(t).lower() in ("wandb", "mlflow", "trackio")}
        trackers |= set(facts.trackers) if facts else set()
        space = (facts.trackio_space_id if facts else None) or config.get("trackio_space_id") or \
            environ.get("TRACKIO_SPACE_ID") or None
        private = facts.trackio_private if facts and facts.trackio_private is not None else None
        if private is None and isinstance(config.get("hub_private_repo"), bool):
            private = config["hub_private_repo"]
        return cls(
            config=config,
            hub_target=hub_target,
            folder_target=dest if isinstance(dest, Path) else None,
            object_target=dest if isinstance(dest, str) else None,
            output_dir=output,
            trackers=frozenset(trackers),
            trackio_space_id=space if isinstance(space, str) else None,
            trackio_private=private,
            mentions=facts.mentions if facts else (),
            args=args,
            script_name=facts.path.name if facts else "the script",
        )


def job_from_config(config: Mapping[str, Any], environ: Mapping[str, str]) -> JobView:
    """The job as the Trainer's actual settings (the agent's dict) describe it: Hub target, trackers, output.

    ``report_to`` here is what transformers resolved (``"all"`` already expanded into the installed ones).
    """
    hub_target = None
    if config.get("push_to_hub") is True:
        repo_id = config.get("hub_model_id")
        origin = f"push_to_hub=True, hub_model_id={repo_id!r}" if repo_id else "push_to_hub=True"
        hub_target = HubTarget("model", repo_id if isinstance(repo_id, str) and "/" in repo_id else None, origin)
    report_to = config.get("report_to") or []
    if isinstance(report_to, str):
        report_to = [report_to]
    trackers = {str(t).lower() for t in report_to if str(t).lower() in ("wandb", "mlflow", "trackio")}
    space = config.get("trackio_space_id") or environ.get("TRACKIO_SPACE_ID") or None
    output = config.get("output_dir")
    return JobView(config=config, hub_target=hub_target, output_dir=Path(output) if isinstance(output, str) else None,
                   trackers=frozenset(trackers), trackio_space_id=space if "trackio" in trackers else None,
                   trackio_private=config.get("hub_private_repo") if isinstance(config.get("hub_private_repo"), bool)
                   else None, script_name="the job", settings_source="TrainingArguments")


#: TrainingArguments fields read from the job's command line into ``JobView.config`` (the agent's dict shape).
_ARG_KEYS = ("output_dir", "push_to_hub", "hub_model_id", "hub_strategy", "save_strategy", "eval_strategy",
             "bf16", "fp16", "torch_compile", "gradient_checkpointing", "max_steps", "hub_private_repo",
             "trackio_space_id")


def args_config(args: JobArgs) -> dict[str, Any]:
    """The TrainingArguments settings the job's command line gives, in the agent's dict shape.

    Booleans are read as HfArgumentParser reads them; ``report_to`` is a list; ``evaluation_strategy`` is the old
    name of ``eval_strategy``.
    """
    config: dict[str, Any] = {}
    for key in _ARG_KEYS:
        source = "evaluation_strategy" if key == "eval_strategy" and key not in args.values else key
        if source not in args.values:
            continue
        value = args.values[source]
        boolean = to_bool(value)
        if key in ("push_to_hub", "bf16", "fp16", "torch_compile", "gradient_checkpointing", "hub_private_repo"):
            if boolean is not None:
                config[key] = boolean
        elif value is not True:  # a bare flag where a value belongs: argparse would refuse it
            config[key] = value[0] if isinstance(value, list) and len(value) == 1 else value
    if "report_to" in args.values:
        items = args.items("report_to")
        config["report_to"] = [] if [i.lower() for i in items] == ["none"] else items
    return config
