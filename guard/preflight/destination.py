"""The ``destination`` check: on a platform whose disk dies with the job, a job that saves needs a destination.

Hugging Face Jobs (``JOB_ID``, ``CPU_CORES``, ``MEMORY``: ``guard.run.platform``) run in a container that is
destroyed when the job ends, with every file in it (hub-docs ``jobs-overview.md``: the first failure its guide
names is "Model not found on Hub after a successful-looking run"). A job there that saves checkpoints or a model
(a Trainer, ``torch.save()``, ``save_model()``, ``save_pretrained()``, or the guard's ``--output-dir``) with no
destination (no ``--push-to``, no ``push_to_hub``) fails preflight: ``check=destination``, exit 3, unless
``--skip-check destination=REASON``. On Kubernetes, where a pod's own disk is as short-lived unless a persistent
volume is mounted there (which the guard does not tell), it is a warning; elsewhere the disk stays.

An object store destination (``--push-to s3://BUCKET/PREFIX``) is probed as the pushes will use it
(``check_object_store``: ``guard.secure.dest.s3probe``): credentials found, the bucket exists, a probe object
under the prefix written, read back and removed, every request bounded. Any failure is a ``fail`` row of
``check=destination`` with what to do.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from guard.errors import DestinationError
from guard.preflight._job import JobView
from guard.preflight._models import CheckResult, PreflightOptions
from guard.preflight.script import ScriptFacts

__all__ = ["check_destination", "check_object_store"]

NAME = "destination"
HINT = ("add --push-to hf://NS/NAME (the guard secures checkpoints and the final model there), or set "
        "push_to_hub=True with hub_model_id=NS/NAME in the TrainingArguments")


def check_destination(opts: PreflightOptions, job: JobView, facts: ScriptFacts | None) -> list[CheckResult]:
    """One row: ``fail`` on Hugging Face Jobs, ``warn`` on Kubernetes, for a job that saves with no destination;
    ``pass`` with one; ``n/a`` otherwise (a disk that stays, or nothing saved)."""
    if job.hub_target is not None or job.folder_target is not None or job.object_target is not None:
        where = job.hub_target.origin if job.hub_target is not None else str(job.folder_target or job.object_target)
        return [CheckResult(NAME, "pass", f"the job's model leaves the machine: {where}")]
    saves = list(facts.saves) if facts is not None else []
    if opts.output_dir and not saves:
        saves.append(f"--output-dir {opts.output_dir}")
    if not saves:
        return [CheckResult(NAME, "n/a", "nothing is saved that the guard can see, and no destination")]
    what = ", ".join(saves[:3])
    if opts.platform == "hf_jobs":
        return [CheckResult(NAME, "fail", f"the job saves ({what}) on Hugging Face Jobs with no destination: "
                            "the container and every file in it are destroyed when the job ends", HINT)]
    if opts.platform == "kubernetes":
        return [CheckResult(NAME, "warn", f"the job saves ({what}) in a Kubernetes pod with no destination: "
                            "unless a persistent volume holds the output folder, the files end with the pod", HINT)]
    return [CheckResult(NAME, "n/a", f"the job saves ({what}) to a disk that outlives it ({opts.platform})")]


def check_object_store(target: str | None, *, timeout_s: float,
                       store_factory: Callable[..., Any] | None = None,
                       clock: Callable[[], float] = time.monotonic) -> list[CheckResult]:
    """The probe of an ``s3://BUCKET/PREFIX`` destination (``S3Store.probe``): one ``pass`` row with how long it
    took, or one ``fail`` row (the probe's message and hint; boto3 not installed names the ``jobguard[s3]`` extra).
    No row without an object store destination.

    Args:
        target: ``JobView.object_target`` (the canonical ``s3://...`` text) or None.
        timeout_s: the limit of each request (``PreflightOptions.network_timeout_s``); the probe's four requests
            together get four times that, each tried once.
        store_factory: ``S3Store.from_url`` or a stand-in (called with the URL and the store's keyword arguments).
        clock: monotonic seconds.
    """
    if not target:
        return []
    if store_factory is None:
        from guard.secure.dest.s3 import S3Store

        store_factory = S3Store.from_url
    started = clock()
    try:
        store = store_factory(target, request_timeout_s=timeout_s, request_attempts=1, max_concurrency=2)
    except DestinationError as err:
        return [CheckResult(NAME, "fail", f"{target}: {err.message}", err.hint)]
    try:
        store.probe(deadline=clock() + 4 * timeout_s)
    except DestinationError as err:
        return [CheckResult(NAME, "fail", err.message, err.hint)]
    finally:
        store.close()
    return [CheckResult(NAME, "pass", f"{target}: the bucket answers; a probe object was written under the prefix, "
                        f"read back and removed in {clock() - started:.1f} s")]
