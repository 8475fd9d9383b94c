"""One step unit (issue 33 item 8): under gradient accumulation a plain loop's losses, its saves and the VERDICT
count optimizer steps, as its checkpoints' names do. Real guard, a real job with torch.optim.SGD on the CPU."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import JOBS, run_guard, secured_step

pytestmark = [pytest.mark.slow]

FAST = ["--skip-check", "python=imports are checked by the other tests"]
JOB = str(JOBS / "accumulating_loop.py")


def test_a_nan_under_gradient_accumulation_is_named_by_its_optimizer_step(tmp_path: Path) -> None:
    """8 micro-batches per step, NaN from iteration 12, a save every 5 iterations: before, the VERDICT said
    step=89 (the 89th .backward() call) and the taint compared that with the saves' steps, so ckpt-15.pt (saved
    after the NaN, at iteration 15) counted as saved before it."""
    out, dest = tmp_path / "out", tmp_path / "dest"
    run = run_guard([*FAST, "--check-every", "1000", "--push-interval", "0s", "--push-to", str(dest), JOB,
                     str(out), "--accum", "8", "--nan-at", "12", "--iters", "40"], timeout_s=120)
    fields = run.fields()
    assert (fields["status"], fields["reason"]) == ("FAIL", "non_finite_loss"), run.stderr[-3000:]
    assert int(fields["step"]) == 12, run.verdict
    assert secured_step(dest) == 10, run.stderr[-3000:]
    secured = dest / "last-checkpoint" / "ckpt-10.pt"
    state = torch.load(secured, weights_only=True)
    assert state["iter"] == 10 and all(bool(torch.isfinite(t).all()) for t in state["model"].values())
    assert not re.search(r"steps after step \d+ are lost", run.stderr)


def test_a_healthy_accumulating_loop_reports_its_saves_at_their_iteration(tmp_path: Path) -> None:
    out, dest = tmp_path / "out", tmp_path / "dest"
    run = run_guard([*FAST, "--push-interval", "0s", "--push-to", str(dest), JOB, str(out), "--accum", "4",
                     "--iters", "20"], timeout_s=120)
    fields = run.fields()
    assert (fields["status"], run.returncode) == ("PASS", 0), run.stderr[-3000:]
    assert int(fields["step"]) == 20, run.verdict
    assert secured_step(dest) == 20
    assert torch.load(dest / "last-checkpoint" / "ckpt-20.pt", weights_only=True)["iter"] == 20
    # loss= is the optimizer step's loss, the job's own printed value (the sum of its divided micro-batch losses),
    # not its last micro-batch's divided loss (a quarter of it here; nanoGPT's 0.0976 against its printed 3.905)
    printed = dict(re.findall(r"^iter (\d+): loss ([0-9.]+)$", run.stdout, re.M))
    assert float(fields["loss"]) == pytest.approx(float(printed["20"]), rel=1e-4), (run.verdict, printed["20"])


@pytest.mark.parametrize("hide", [False, True])
def test_a_gradient_norm_gone_nan_is_the_first_non_finite_step(tmp_path: Path, hide: bool) -> None:
    """Issue 33 item 2 (ModernBERT #233: clip_grad_norm_ returned nan while the loss was finite): the norm is a
    witness, read with the losses. Step 22's loss is finite and its gradient NaN: the run fails at step 22, not at
    step 23 (the first NaN loss) nor at the next save (the weights witness) when nan_to_num hides every later
    loss as 0.0; nothing saved from step 22 on is at the destination."""
    out, dest = tmp_path / "out", tmp_path / "dest"
    run = run_guard([*FAST, "--check-every", "1000", "--push-interval", "0s", "--push-to", str(dest),
                     str(JOBS / "grad_norm_nan.py"), str(out), "--bad-at", "22", *(["--hide"] if hide else [])],
                    timeout_s=120)
    fields = run.fields()
    assert (fields["status"], fields["reason"]) == ("FAIL", "non_finite_loss"), run.stderr[-3000:]
    assert int(fields["step"]) == 22, run.verdict
    assert "clip_grad_norm_ returned nan" in fields["hint"], run.verdict  # the hint names the witness
    assert secured_step(dest) == 20
    state = torch.load(dest / "last-checkpoint" / "ckpt-20.pt", weights_only=True)
    assert all(bool(torch.isfinite(t).all()) for t in state["model"].values())


def test_a_trainer_under_gradient_accumulation_reports_the_loss_it_logs(tmp_path: Path) -> None:
    """gradient_accumulation_steps=2: the step's loss is the sum of its micro-batches' training_step returns (each
    divided by the accumulation steps), the loss the Trainer logs; before, their mean: half the logged loss."""
    run = run_guard([*FAST, str(JOBS / "slow_trainer.py"), "--output-dir", str(tmp_path / "out"), "--max-steps",
                     "6", "--step-s", "0", "--accum", "2", "--logging-steps", "1", "--save-steps", "100"],
                    timeout_s=120)
    fields = run.fields()
    assert (fields["status"], int(fields["step"])) == ("PASS", 6), run.stderr[-3000:]
    logged = re.findall(r"\{'loss': '([0-9.]+)'", run.stdout)
    assert len(logged) == 6, run.stdout[-2000:]
    assert float(fields["loss"]) == pytest.approx(float(logged[-1]), rel=1e-3), (run.verdict, logged[-1])
