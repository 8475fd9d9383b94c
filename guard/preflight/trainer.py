"""Trainer-config checks: settings that waste a paid run, read before the first training step.

The same function serves two callers: the preflight, with the ``TrainingArguments`` literals read statically
from the script (``ScriptFacts.trainer_config``), and the supervisor, with the dict the in-job agent sends when a
``Trainer`` is built (keys ``output_dir, push_to_hub, hub_model_id, hub_strategy, save_strategy, eval_strategy,
report_to, bf16, fp16, torch_compile, gradient_checkpointing, has_eval_dataset, max_steps, loss_class``).
A missing key means "unknown" and is never flagged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import PurePath
from typing import TYPE_CHECKING, Any

from guard.preflight._common import hf_offline
from guard.preflight._models import CheckResult
from guard.preflight.gpu import GpuInfo

if TYPE_CHECKING:
    from guard.preflight._job import JobView

__all__ = ["check_compile_mentions", "check_job_settings", "check_trainer_config"]

NAME = "trainer-config"

#: Compute capability needed: bf16 math (Ampere, 8.0); Triton, which ``torch.compile``'s inductor uses (7.0).
BF16_MIN_CC = (8, 0)
COMPILE_MIN_CC = (7, 0)


def _strategy(value: Any) -> str | None:
    """``IntervalStrategy.STEPS`` / ``"steps"`` -> ``"steps"``; None stays None."""
    if value is None:
        return None
    text = str(getattr(value, "value", value)).strip().lower()
    return text.rsplit(".", 1)[-1]


def _on(config: Mapping[str, Any], key: str) -> bool:
    return config.get(key) is True or str(config.get(key)).lower() == "true"


def check_trainer_config(
    config: Mapping[str, Any],
    *,
    gpus: Sequence[GpuInfo] | None,
    timeout_known: bool,
    environ: Mapping[str, str],
) -> list[CheckResult]:
    """Check the Trainer's settings before its first step.

    Args:
        config: the Trainer's settings (see the module docstring); missing keys are unknown.
        gpus: the GPUs the job sees (``PreflightReport.gpus``); None when unknown (no compute-capability check).
        timeout_known: whether the job has a known deadline (a kill then loses unsaved work).
        environ: the job's environment (``HF_HUB_OFFLINE`` against ``push_to_hub``).

    Returns:
        Rows named ``trainer-config``: one ``pass`` summary when nothing is wrong, ``n/a`` for an empty config.
    """
    if not config:
        return [CheckResult(NAME, "n/a",
                            "no TrainingArguments literals found (checked again when the Trainer is built)")]
    rows: list[CheckResult] = []
    eval_strategy = _strategy(config.get("eval_strategy"))
    if eval_strategy not in (None, "no") and config.get("has_eval_dataset") is False:
        rows.append(CheckResult(
            NAME, "fail", f"eval_strategy={eval_strategy!r} but the Trainer gets no eval_dataset",
            "pass eval_dataset= to the Trainer, or set eval_strategy='no' (it would crash at the first evaluation)"))
    push = _on(config, "push_to_hub")
    if push and not config.get("hub_model_id"):
        name = PurePath(str(config.get("output_dir") or "trainer_output")).name
        rows.append(CheckResult(
            NAME, "warn", f"push_to_hub=True without hub_model_id: pushes to <your user>/{name}",
            "set hub_model_id='namespace/name' to choose the repo"))
    if push and (offline := hf_offline(environ)):
        rows.append(CheckResult(NAME, "fail", f"push_to_hub=True with {offline}: every push will fail",
                                "unset HF_HUB_OFFLINE, or set push_to_hub=False and --push-to a folder"))
    if timeout_known:
        if _strategy(config.get("save_strategy")) == "no":
            rows.append(CheckResult(
                NAME, "warn", "save_strategy='no' with a deadline: the Trainer saves nothing on its own",
                "set save_strategy='steps' (the guard still forces one save before the deadline)"))
        if push and _strategy(config.get("hub_strategy")) == "end":
            rows.append(CheckResult(
                NAME, "warn", "hub_strategy='end' with a deadline: nothing reaches the Hub before the end",
                "use hub_strategy='every_save' or 'checkpoint', or --push-to so the guard pushes checkpoints"))
    rows.extend(_gpu_rows(config, gpus))
    loss = str(config.get("loss_class") or "")
    if _on(config, "gradient_checkpointing") and loss.startswith("Cached"):
        rows.append(CheckResult(
            NAME, "warn", f"gradient_checkpointing=True with {loss}: the cached (GradCache) loss already "
            "recomputes activations in mini-batches; checkpointing adds a third forward pass",
            "turn gradient_checkpointing off and lower mini_batch_size instead"))
    if not any(row.status in ("fail", "warn") for row in rows):
        rows.insert(0, CheckResult(NAME, "pass", _summary(config, gpus)))
    return rows


def _gpu_rows(config: Mapping[str, Any], gpus: Sequence[GpuInfo] | None) -> list[CheckResult]:
    if not gpus:
        return []
    known = [g for g in gpus if g.compute_capability is not None]
    if not known:
        return []
    lowest = min(known, key=lambda g: g.compute_capability or (0, 0))
    cc = lowest.compute_capability or (0, 0)
    rows: list[CheckResult] = []
    if _on(config, "bf16") and cc < BF16_MIN_CC:
        rows.append(CheckResult(
            NAME, "fail", f"bf16=True on GPU {lowest.index} ({lowest.name}, cc {lowest.cc_text}): bf16 needs cc 8.0+",
            "use fp16=True instead, or run on an Ampere or newer GPU (A10G, L4, A100, H100/H200)"))
    if _on(config, "torch_compile") and cc < COMPILE_MIN_CC:
        rows.append(CheckResult(
            NAME, "fail", f"torch_compile on GPU {lowest.index} ({lowest.name}, cc {lowest.cc_text}): "
            "Triton needs cc 7.0+",
            "turn torch_compile off, or run on a Volta or newer GPU"))
    return rows


def _summary(config: Mapping[str, Any], gpus: Sequence[GpuInfo] | None) -> str:
    keys = ("eval_strategy", "save_strategy", "push_to_hub", "hub_model_id", "hub_strategy", "bf16", "fp16",
            "torch_compile", "gradient_checkpointing", "has_eval_dataset", "max_steps")
    shown = ", ".join(f"{k}={config[k]!r}" for k in keys if k in config)
    ccs = sorted({g.cc_text for g in gpus or () if g.compute_capability})
    gpu = f"; GPU cc {'/'.join(ccs)}" if ccs else ""
    return (shown or "no setting to check") + gpu


def check_compile_mentions(job: JobView, gpus: Sequence[GpuInfo] | None) -> list[CheckResult]:
    """A ``torch.compile`` the script calls only under an ``if`` that may not be taken, on a GPU Triton cannot
    compile for: a warning (the same setting, always on, is a failure in ``check_trainer_config``).

    Also one warning per config file named on the job's command line that could not be read.
    """
    rows = [CheckResult(NAME, "warn", f"job arguments: {problem}", "check the file's path and format")
            for problem in job.args.problems]
    compiles = [m for m in job.mentions if m.kind == "compile"]
    known = [g for g in gpus or () if g.compute_capability is not None]
    if compiles and known and job.config.get("torch_compile") is not True:
        lowest = min(known, key=lambda g: g.compute_capability or (0, 0))
        if (lowest.compute_capability or (0, 0)) < COMPILE_MIN_CC:
            rows.append(CheckResult(
                NAME, "warn", f"{compiles[0].describe(job.script_name)}; GPU {lowest.index} ({lowest.name}, "
                f"cc {lowest.cc_text}) is under Triton's cc 7.0", "keep it off on this GPU"))
    return rows


def check_job_settings(
    config: Mapping[str, Any],
    *,
    gpus: Sequence[GpuInfo] | None,
    timeout_known: bool,
    environ: Mapping[str, str],
) -> list[CheckResult]:
    """What the supervisor runs when the agent reports the Trainer's arguments (``training_args`` when
    ``TrainingArguments`` is built, ``trainer_config`` when training begins).

    ``check_trainer_config``'s rows, plus the credentials the actual settings need (``env`` rows: a Hub token for
    ``push_to_hub=True``, ``WANDB_API_KEY`` for ``report_to`` wandb unless ``WANDB_MODE`` is offline/disabled,
    ``MLFLOW_TRACKING_URI``) and the trackers installed (``tracking`` rows). Only ``fail`` and ``warn`` rows of
    those two groups are returned. Arguments as for ``check_trainer_config``.
    """
    from guard.preflight._job import job_from_config  # _job imports the script module
    from guard.preflight._models import PreflightOptions
    from guard.preflight.env import check_env
    from guard.preflight.misc import check_tracking

    rows = check_trainer_config(config, gpus=gpus, timeout_known=timeout_known, environ=environ)
    job = job_from_config(config, environ)
    extra = check_env(PreflightOptions(), job, environ=environ) + check_tracking(job, environ=environ)
    return rows + [row for row in extra if row.status in ("fail", "warn")]
