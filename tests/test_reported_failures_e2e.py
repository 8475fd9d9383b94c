"""End to end: the verdict and the cause for failures users report (issue 21), on tiny real jobs."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import JOBS, run_guard

pytestmark = pytest.mark.slow


# -- zero training steps ---------------------------------------------------------------------------------------------


def test_an_empty_dataloader_that_saves_and_exits_0_is_incomplete(tmp_path: Path) -> None:
    run = run_guard([str(JOBS / "empty_loader.py"), "--out", str(tmp_path / "out")], cwd=tmp_path)
    fields = run.fields()
    assert (fields["status"], fields["reason"], run.returncode) == ("FAIL", "incomplete", 7), run.stdout + run.stderr
    assert "no training step" in fields["hint"] and "AdamW" in fields["hint"]
    assert "3 sample(s) with batch_size=8 and drop_last=True" in fields["hint"]
    assert (tmp_path / "out" / "model.pt").exists()  # the job did save; the verdict is the guard's


def test_an_evaluation_script_that_never_trains_passes_and_says_it_ran_no_step(tmp_path: Path) -> None:
    run = run_guard([str(JOBS / "empty_loader.py"), "--eval", "--samples", "16"], cwd=tmp_path)
    fields = run.fields()
    assert (fields["status"], fields["reason"], run.returncode) == ("PASS", "ok", 0), run.stdout + run.stderr
    assert fields["steps"] == "0"
    assert "step" not in fields
