"""End to end, issue 33: when the newest save is refused for its weights at the deadline, the newest good save still
whole on disk is secured, though the guard never saw it. The scans hand securing the newest complete save only;
before, a job saving every step with safetensors (a save the agent does not see), whose last save (made on SIGTERM,
a "NaN-safe" masked mean of an empty batch: ModernBERT #233) held NaN weights, ended ``TIMEOUT secured_step=5``
with checkpoint-26 whole and good on disk (or ``secured=no`` when no scan had handed any save before). Real guard,
real job processes, torch on the CPU, a folder destination."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import JOBS, loaded_s, run_guard, secured_step
from safetensors.torch import load_file

pytestmark = [pytest.mark.slow]

FAST = ["--skip-check", "python=imports are checked by the other tests"]


def test_the_save_before_a_refused_last_save_is_secured_at_the_deadline(tmp_path: Path) -> None:
    out, dest = tmp_path / "out", tmp_path / "dest"
    run = run_guard([*FAST, "--timeout", loaded_s(25), "--push-to", str(dest), str(JOBS / "masked_mean_nan.py"),
                     "--output-dir", str(out), "--steps", "100000", "--save-every", "1", "--empty-at", "0",
                     "--step-s", "0.1", "--format", "safetensors", "--nan-on-term"], timeout_s=200)
    fields = run.fields()
    assert (fields["status"], fields["secured"], run.returncode) == ("TIMEOUT", "yes", 75), run.stderr[-3000:]
    stopped = re.search(r"stopped at step (\d+)", run.stdout)
    assert stopped is not None, run.stdout[-1000:]
    last = int(stopped[1])
    assert f"cannot secure checkpoint step {last}: its weights are not finite" in run.stderr, run.stderr[-3000:]
    assert int(fields["secured_step"]) == last - 1 == secured_step(dest), run.verdict
    assert fields["checkpoint"] == str(out / f"checkpoint-{last - 1}"), run.verdict
    state = load_file(str(dest / "last-checkpoint" / "model.safetensors"))
    assert all(bool(torch.isfinite(t).all()) for t in state.values())
    assert torch.equal(state["weight"], load_file(str(out / f"checkpoint-{last - 1}" / "model.safetensors"))["weight"])
