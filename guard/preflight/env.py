"""Environment checks: the variables the job needs are set. Names only: a value is never printed.

Needed: every ``--require-env`` name; the ``secrets`` and ``env`` names of the script's ``[tool.hf-jobs]`` table
(``hf jobs uv run`` sets them at launch; on HF Jobs a missing one fails, elsewhere it is a warning, since the
script may be tried outside HF Jobs); ``HF_TOKEN`` when the job writes to the Hub; ``WANDB_API_KEY`` when it
reports to Weights & Biases (not with ``WANDB_MODE=offline|disabled``); ``MLFLOW_TRACKING_URI`` when it reports to
MLflow. A push or a tracker the script starts only on a path that may not be taken (``ScriptFacts.mentions``)
makes a missing variable a warning, never a failure.
"""

from __future__ import annotations

import logging
import netrc
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlparse

from guard.preflight._common import hf_token
from guard.preflight._job import JobView
from guard.preflight._models import CheckResult, PreflightOptions
from guard.preflight.hfjobs import TABLE, HfJobsTable
from guard.preflight.script import Mention

__all__ = ["check_env"]

NAME = "env"
log = logging.getLogger("guard.preflight")


def _set(environ: Mapping[str, str], name: str) -> bool:
    return bool((environ.get(name) or "").strip())


def _wandb_netrc(environ: Mapping[str, str]) -> Path | None:
    """The netrc file holding a W&B login (``wandb login`` writes ``machine api.wandb.ai``), or None."""
    host = urlparse(environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"
    home = Path(environ.get("HOME") or Path.home())
    path = Path(environ["NETRC"]).expanduser() if environ.get("NETRC") else home / ".netrc"
    try:
        return path if netrc.netrc(str(path)).authenticators(host) else None
    except (OSError, netrc.NetrcParseError):
        return None


def wandb_off(environ: Mapping[str, str]) -> str | None:
    """``WANDB_MODE=offline``/``disabled`` (or ``dryrun``, or ``WANDB_DISABLED=true``) as text, else None.

    Source: wandb's ``WANDB_MODE`` ("online", "offline", "disabled"; wandb docs, environment variables);
    ``WANDB_DISABLED`` is the older switch transformers still documents.
    """
    mode = (environ.get("WANDB_MODE") or "").strip().lower()
    if mode in ("offline", "disabled", "dryrun"):
        return f"WANDB_MODE={mode}"
    if (environ.get("WANDB_DISABLED") or "").strip().lower() in ("1", "true", "yes"):
        return "WANDB_DISABLED=true"
    return None


def _wandb_key(environ: Mapping[str, str]) -> str | None:
    """Where a W&B key is found (``WANDB_API_KEY`` or a netrc login), or None."""
    if _set(environ, "WANDB_API_KEY"):
        return "WANDB_API_KEY"
    path = _wandb_netrc(environ)
    return f"W&B login in {path}" if path is not None else None


def _caught(mention: Mention) -> bool:
    """``mention`` sits inside ``try/except``: the path is taken, and its failure is caught (the job goes on)."""
    return mention.condition.startswith("it raises nothing (try/except")


def _mention_rows(job: JobView, environ: Mapping[str, str]) -> list[CheckResult]:
    """A push or tracker on a path that may not be taken, its credential missing.

    Under an ``if`` (an upstream script's ``if training_args.push_to_hub:``): logged at DEBUG, never a warning
    (nothing to act on unless the user turns it on, and then the path is taken and the credential is checked as
    required). Inside ``try/except``: a warning row, since that path is taken and its failure is caught, so the
    job runs on without the push or the tracker and says so only in its own output."""
    rows: list[CheckResult] = []

    def say(name: str, mention: Mention, hint: str) -> None:
        text = f"{name} not set: {mention.describe(job.script_name)}"
        if _caught(mention):
            rows.append(CheckResult(NAME, "warn", text, hint))
        else:
            log.debug("env: %s (only if you turn it on: %s)", text, hint)

    pushes = [m for m in job.mentions if m.kind == "push"]
    if pushes and job.hub_target is None and hf_token(environ)[0] is None:
        push = next((m for m in pushes if _caught(m)), pushes[0])
        say("HF_TOKEN", push, "pass a write token (-s HF_TOKEN), or the push fails and nothing is pushed")
    for tracker in sorted({m.what for m in job.mentions if m.kind == "tracker"} - job.trackers):
        ours = [m for m in job.mentions if m.kind == "tracker" and m.what == tracker]
        first = next((m for m in ours if _caught(m)), ours[0])
        if tracker == "wandb" and not wandb_off(environ) and _wandb_key(environ) is None:
            say("WANDB_API_KEY", first, "pass WANDB_API_KEY, or set WANDB_MODE=offline")
        elif tracker == "mlflow" and not _set(environ, "MLFLOW_TRACKING_URI"):
            say("MLFLOW_TRACKING_URI", first, "export MLFLOW_TRACKING_URI=...")
    return rows


def _tracker_origin(job: JobView, tracker: str) -> str:
    """``"--report_to wandb"`` when the job's command line asks for it, ``"TrainingArguments report_to wandb"``
    from the agent's report, else ``"reports to wandb"``."""
    if job.settings_source:
        return f"{job.settings_source} report_to {tracker}"
    if tracker in [t.lower() for t in job.args.items("report_to")]:
        return job.args.source("report_to", tracker)
    return f"reports to {tracker}"


def check_env(opts: PreflightOptions, job: JobView, *, environ: Mapping[str, str],
              hf_jobs: HfJobsTable | None = None) -> list[CheckResult]:
    """Rows for the variables the job needs.

    Args:
        opts: the options (``require_env``, ``platform``).
        job: what the job does (Hub target, trackers).
        environ: the job's environment.
        hf_jobs: the script's ``[tool.hf-jobs]`` table, or None.

    Returns:
        One ``fail`` row per missing variable, one ``pass`` row listing the ones set (with why each is needed),
        or one ``n/a`` row when nothing is needed.
    """
    needed: list[tuple[str, str]] = [(name, "--require-env") for name in dict.fromkeys(opts.require_env)]
    found: list[str] = []
    rows: list[CheckResult] = []
    for name, why in needed:
        if _set(environ, name):
            found.append(f"{name} ({why})")
        else:
            state = "set but empty" if name in environ else "not set"
            rows.append(CheckResult(NAME, "fail", f"{name} {state} ({why})",
                                    f"export {name}=... (on HF Jobs: -s {name}; Slurm: export it before sbatch)"))
    if hf_jobs is not None and hf_jobs.error is None:
        on_hf = opts.platform == "hf_jobs"
        listed = [(n, "secrets") for n in hf_jobs.secrets] + [(n, "env") for n in hf_jobs.env]
        for name, key in listed:
            if name in opts.require_env:
                continue
            why = f"[{TABLE}] {key} in {hf_jobs.path.name}"
            if _set(environ, name):
                found.append(f"{name} ({why})")
                continue
            state = "set but empty" if name in environ else "not set"
            hint = (f"export {name} where you run hf jobs uv run (it sends the value), or -s {name}=..."
                    if key == "secrets" else f"hf jobs uv run sets it from the table; elsewhere export {name}=...")
            if on_hf:
                rows.append(CheckResult(NAME, "fail", f"{name} {state} ({why})", hint))
            else:  # the script's HF Jobs metadata; not required off HF Jobs: nothing to act on here
                log.debug("env: %s %s (%s; not on HF Jobs, so not required): %s", name, state, why, hint)
    if job.hub_target is not None:
        why = f"pushing to the Hub: {job.hub_target.origin}"
        token, where = hf_token(environ)
        if token:
            label = where if where in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN") else f"saved token {where}"
            found.append(f"{label} ({why})")
        else:
            rows.append(CheckResult(NAME, "fail", f"HF_TOKEN not set and no saved token ({why})",
                                    "pass a write token: hf jobs run -s HF_TOKEN ..., or export HF_TOKEN=hf_..."))
    if "wandb" in job.trackers:
        why = _tracker_origin(job, "wandb")
        if off := wandb_off(environ):
            found.append(f"no W&B key needed ({off})")
        elif login := _wandb_key(environ):
            found.append(f"{login} ({why})")
        else:
            rows.append(CheckResult(NAME, "fail", f"WANDB_API_KEY not set and no wandb login ({why})",
                                    "pass WANDB_API_KEY as a secret, or set WANDB_MODE=offline"))
    if "mlflow" in job.trackers:
        if _set(environ, "MLFLOW_TRACKING_URI"):
            found.append("MLFLOW_TRACKING_URI (reports to mlflow)")
        else:
            rows.append(CheckResult(NAME, "fail", "MLFLOW_TRACKING_URI not set (reports to mlflow): runs would "
                                    "go to ./mlruns inside the job and be lost with it",
                                    "export MLFLOW_TRACKING_URI=https://your-mlflow-server"))
    if job.mentions:
        rows.extend(_mention_rows(job, environ))
    if found:
        rows.insert(0, CheckResult(NAME, "pass", "set: " + ", ".join(found)))
    if not rows:
        rows.append(CheckResult(NAME, "n/a", "no variable needed (no --require-env, no Hub push, no wandb/mlflow)"))
    return rows

