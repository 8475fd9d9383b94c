"""Where a hung job waits: Python stacks of its processes, for the log of a ``stalled`` verdict.

Two sources, both best effort and bounded: each agent inside the job prints the stacks of all its threads
when asked (``{"t": "dump"}``; the agent's reader thread runs while the main thread is blocked in C code, as
in a collective or I/O), and ``py-spy dump --pid`` (when ``py-spy`` is installed) for every process of the job,
including ones without an agent.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from typing import Any

from guard.core.children import CHILDREN
from guard.core.masking import Masker

__all__ = ["dump_stacks"]

log = logging.getLogger("guard.stacks")

PY_SPY_TIMEOUT_S = 5.0
MAX_PROCESSES = 8


def dump_stacks(job: Any, masker: Masker, *, runner: Any = CHILDREN.run) -> int:
    """Log ``py-spy dump`` of up to 8 processes of the job's tree; returns how many were dumped. Each ``py-spy`` is
    run through ``runner`` (default ``CHILDREN.run``: registered as the helper thread's child while it runs)."""
    py_spy = shutil.which("py-spy")
    if py_spy is None:
        log.info("stacks: asked the agents to print theirs (install py-spy for native frames too)")
        return 0
    done = 0
    for proc in [p for p in job.descendants()][:MAX_PROCESSES]:
        try:
            out = runner([py_spy, "dump", "--pid", str(proc.pid)], capture_output=True, text=True,
                         timeout=PY_SPY_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as exc:
            log.info("py-spy dump --pid %d failed: %s", proc.pid, exc)
            continue
        text = masker.mask_text((out.stdout or out.stderr or "").strip())
        log.info("py-spy dump --pid %d:\n%s", proc.pid, text)
        done += 1
    return done
