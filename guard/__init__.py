"""jobguard: a runtime guard for machine-learning training jobs.

Run a job under the guard with ``python -m guard [OPTIONS] train.py [ARGS]`` (or ``-- COMMAND``); see the README
and ``CONTRACT.md`` for the command line, the VERDICT line and the exit codes.

Inside the job, the script may talk to the guard. Every function here is a cheap no-op when the script runs
without a supervisor, so a script can call them unconditionally::

    import guard
    guard.report(step=step, loss=loss)      # a training step's loss (float or 0-d tensor)
    if guard.should_checkpoint():           # the guard wants a checkpoint now
        save(path); guard.checkpoint_saved(path)
    if guard.should_stop():                 # the guard wants the job to end cleanly
        break

Importing ``guard`` loads only the standard library (never torch or huggingface_hub).
"""

from __future__ import annotations

import os
import sys

from .core.version import __version__  # relative: this package may be loaded under a private name

TYPE_CHECKING = False  # typing's own flag, without importing typing in every job process (see protocol.py)
if TYPE_CHECKING:
    from typing import Any

#: The private name the job's ``sitecustomize`` loads this package under (never ``guard``, which a project's own
#: ``guard.py`` may be); the agent of the process lives in ``PRIVATE_NAME + ".inside.agent"``.
PRIVATE_NAME = "_jobguard"


class _LazyAgent:
    """The process's agent, imported on first use (the supervisor process never needs it): the one the job's
    ``sitecustomize`` loaded under the private name, else ``guard.inside.agent``."""

    def get(self) -> Any:
        loaded = sys.modules.get(PRIVATE_NAME + ".inside.agent")
        if loaded is not None:
            return loaded.get()
        from .inside import agent
        return agent.get()


_agent = _LazyAgent()

__all__ = [
    "__version__",
    "checkpoint_saved",
    "protect",
    "report",
    "resume_path",
    "should_checkpoint",
    "should_stop",
]


def report(step: int | None = None, loss: Any = None) -> None:
    """Report a training step's loss to the guard.

    Args:
        step: the training step (int, optional; default: one more than the last reported step).
        loss: the step's loss: a float, or a 0-d tensor (read from the device only during the sanity pass and
            then every ``--check-every`` steps; no host-device sync per step).

    Once ``report`` is called, the automatic ``.backward()`` hook stops counting, so steps are not counted twice.
    Without a supervisor this does nothing.
    """
    agent = _agent.get()
    if agent is None or loss is None:
        return
    agent.backward_hook = False
    agent.on_loss(loss, step, "report")


def should_checkpoint() -> bool:
    """True when the guard asks the job to save a checkpoint now (then call ``checkpoint_saved(path)``).

    Without a supervisor: always False.
    """
    agent = _agent.get()
    if agent is None:
        return False
    agent.note_api("should_checkpoint")
    return bool(agent.checkpoint_due())


def checkpoint_saved(path: str | os.PathLike[str], step: int | None = None) -> None:
    """Tell the guard a complete checkpoint now lies at ``path`` (a folder), saved at ``step``.

    The guard copies it to the destination (``--push-to``) and verifies it. Call it only after every file of
    the checkpoint is written and closed. ``path`` must lie inside the job's output folder (never ``/``, the
    home or the working folder: the guard refuses those). When the guard asked for this checkpoint together
    with a stop (deadline, signal), the process ends here (``SystemExit(0)``) unless the script reads
    ``should_stop()`` to end by itself. A folder without a Trainer state file gets a small marker,
    ``guard_checkpoint.json`` (``{"step": N}``), so that it also counts as complete later (when the guard must
    secure the newest checkpoint on disk). Without a supervisor this does nothing.
    """
    agent = _agent.get()
    if agent is None:
        return
    agent.note_api("checkpoint_saved")
    text = os.fspath(path) if path is not None else ""
    if not str(text).strip():
        agent.warn("checkpoint_saved() needs the checkpoint's folder or file: an empty path was ignored")
        return
    step = step if step is not None else agent.watch.step
    _mark_complete(text, step)
    agent.checkpoint_done(text, step)
    agent.end_process()  # after a stop the guard asked for: the job ends here, unless it reads should_stop()


def _mark_complete(path: str, step: int | None) -> None:
    import json

    from .files import write_atomic  # relative: this package may be loaded under a private name

    marker = os.path.join(path, "guard_checkpoint.json")
    if not os.path.isdir(path) or os.path.exists(marker) or os.path.exists(os.path.join(path, "trainer_state.json")):
        return
    try:
        write_atomic(marker, json.dumps({"step": step}).encode("utf-8"))
    except OSError:
        pass  # a read-only folder: the report alone still counts


def should_stop() -> bool:
    """True when the guard asks the job to end cleanly (after a requested checkpoint, or on a signal).

    Without a supervisor: always False.
    """
    agent = _agent.get()
    if agent is None:
        return False
    agent.note_api("should_stop")
    return bool(agent.stop_requested)


def resume_path() -> str | None:
    """The checkpoint folder the guard fetched for this run to resume from (``--resume``), or None."""
    agent = _agent.get()
    return agent.settings.resume_path if agent is not None else None


def protect(*options: str) -> None:
    """Re-run this script under the guard when it was started without one: one line at the top of a script, for
    launchers whose command cannot be changed.

    ``guard.protect("--timeout", "2h")`` replaces the current process (``os.execv``, same PID, so a container's
    PID 1 stays PID 1) with ``python -m guard OPTIONS SCRIPT ARGS``; ``GUARD_*`` variables work as usual. Under
    the guard (the agent is present) it does nothing, so it never loops. Under a launcher that starts one process
    per rank (torchrun: ``LOCAL_RANK`` is set) it does nothing but warn: put the guard around the launcher instead
    (``python -m guard -- torchrun ...``). Call it before anything heavy is imported.

    Args:
        options: guard options, as on the command line (e.g. ``"--push-to", "hf://me/run"``).
    """
    if _agent.get() is not None:
        return
    if os.environ.get("LOCAL_RANK") is not None or os.environ.get("TORCHELASTIC_RUN_ID"):
        sys.stderr.write("[guard] protect(): one process per rank (torchrun); run the guard around the launcher "
                         "instead: jobguard -- torchrun ...\n")
        return
    script = getattr(sys.modules.get("__main__"), "__file__", None)
    if not script:
        sys.stderr.write("[guard] protect(): no script file (interactive session); nothing to re-run\n")
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    argv = [sys.executable, "-m", "guard", *options, os.path.abspath(script), *sys.argv[1:]]
    os.execv(sys.executable, argv)
