"""What several test jobs share (imported from the jobs' own folder): where a job resumes from, and a step counter
that accelerate checkpoints with the model (``Accelerator.register_for_checkpointing``)."""

import os
import re


def resume_from(out: str, pattern: str = r"step_(\d+)") -> str | None:
    """The checkpoint the guard fetched (``guard.resume_path()``: the secured one, whole on this node's disk), else
    the newest folder of ``out`` whose name ``pattern`` matches (its group: the step; a newer save there may be only
    this node's part of it), else None."""
    try:
        import guard

        fetched = guard.resume_path()
    except ImportError:  # run without the guard on the path
        fetched = None
    if fetched:
        return str(fetched)
    saved = sorted((int(m[1]), name) for name in (os.listdir(out) if os.path.isdir(out) else [])
                   if (m := re.fullmatch(pattern, name)))
    return os.path.join(out, saved[-1][1]) if saved else None


class Counter:
    """The job's step, saved and loaded with accelerate's state."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
