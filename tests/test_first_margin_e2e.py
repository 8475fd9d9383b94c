"""The first margin comes from the job's own model, not a 1,000 MB guess (issue 36): a plain loop's optimizer
tells the agent its parameters' size, and the margin assumes that checkpoint until a save measures one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import JOBS, run_guard

pytestmark = [pytest.mark.slow]


def test_a_plain_loops_first_margin_is_sized_by_its_optimizer(tmp_path: Path) -> None:
    """accumulating_loop.py: torch.optim.SGD over a Linear(8, 1) (9 float32 parameters: 36 bytes, twice that with
    SGD's buffer). Before, the margin said '1000 MB (a guess: no checkpoint seen yet)' until the first save."""
    run = run_guard(["--skip-check", "python=imports are checked by the other tests", "--timeout", "120s",
                     str(JOBS / "accumulating_loop.py"), str(tmp_path / "out"), "--iters", "10", "--every", "1000"],
                    timeout_s=120)
    assert run.fields()["status"] == "PASS", run.stderr[-3000:]
    sized = re.findall(r"margin now \d+s \(.*push [\d.]+s of ([\d.]+) MB \(the model's weights and optimizer state\)",
                       run.stderr)
    assert sized and float(sized[-1]) < 0.1, run.stderr[-3000:]
