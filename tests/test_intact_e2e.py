"""End to end: what is secured is a checkpoint the next run can load (issue 18's first list, replayed with small
jobs of our own on the CPU)."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest
from conftest import JOBS, signal_when, start_guard

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.slow]

FAST = ["--skip-check", "python=imports are checked by the other tests"]


def test_a_checkpoint_rewritten_in_place_on_sigterm_never_replaces_the_secured_copy(tmp_path: Path) -> None:
    # The job's SIGTERM handler rewrites ckpt.pt chunk by chunk over 20 s, longer than --grace 8s: the file is cut
    # short when the guard would push it (petuum/adaptdl #70). The secured copy stays the good save and loads.
    ready, out, dest = tmp_path / "ready", tmp_path / "out", tmp_path / "dest"
    proc = start_guard([*FAST, "--grace", "8s", "--push-to", str(dest), str(JOBS / "rewrite_on_term.py"), str(out),
                        "--ready", str(ready), "--step_s", "0.2"], cwd=tmp_path)
    stdout, stderr = signal_when(proc, ready, signal.SIGTERM, settle_s=1.0)
    verdict = [line for line in stdout.splitlines() if line.startswith("VERDICT:")][-1]
    # refused by the format check (cut short) or by the save's own record (rewritten since that save)
    assert ("ckpt.pt: not a whole zip archive" in stderr or "was rewritten after that save" in stderr), stderr[-3000:]
    secured = torch.load(dest / "last-checkpoint" / "ckpt.pt")  # "failed finding central directory" before
    match = re.search(r"resumes from step (\d+)", verdict)
    assert match is not None and int(match[1]) == secured["step"], verdict
    assert "secured=yes" in verdict and proc.returncode == 75
