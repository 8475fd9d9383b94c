"""A save is a read point (issue 33, item 1): before the agent reports a save, it reads the losses still pending in
the ``--check-every`` window, so a non-finite loss reaches the guard before the save it covers. Without it, a job
checked every 100,000 steps trained on with NaN weights to its end, and each of its saves was reported as if good."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import JOBS, run_guard

pytestmark = [pytest.mark.slow]

FAST = ["--skip-check", "python=imports are checked by the other tests"]


def test_the_first_save_after_a_nan_stops_the_job_and_is_never_secured(tmp_path: Path) -> None:
    out, dest = tmp_path / "out", tmp_path / "dest"
    run = run_guard([*FAST, "--check-every", "100000", "--push-interval", "0s", "--push-to", str(dest),
                     str(JOBS / "nan_then_save.py"), "--output-dir", str(out), "--steps", "60", "--nan-at", "12",
                     "--save-every", "5"], timeout_s=200)
    fields = run.fields()
    assert (fields["status"], fields["reason"], run.returncode) == ("FAIL", "non_finite_loss", 4), run.stderr[-3000:]
    assert fields["step"] == "12" and fields["loss"] == "nan", run.verdict
    # the save of step 15 read the window: the job was stopped there, not at its end (step 60)
    assert "step 60" not in run.stdout and not (out / "ckpt-20.pt").exists(), run.stdout[-2000:]
    secured = dest / "last-checkpoint" / "ckpt-10.pt"
    if (dest / "last-checkpoint").exists():
        assert sorted(p.name for p in (dest / "last-checkpoint").glob("*.pt")) == ["ckpt-10.pt"]
        state = torch.load(secured, weights_only=True)
        assert all(bool(torch.isfinite(t).all()) for t in state["model"].values())


def test_a_trainers_own_save_after_a_nan_is_never_secured(tmp_path: Path) -> None:
    # issue 33: a Trainer with save_steps=20 and NaN from step 16 left checkpoint-20 at the destination
    out, dest = tmp_path / "out", tmp_path / "dest"
    run = run_guard([*FAST, "--check-every", "100000", "--push-interval", "0s", "--push-to", str(dest),
                     str(JOBS / "trainer_nan.py"), "--output-dir", str(out), "--max-steps", "60", "--nan-at", "16",
                     "--save-steps", "20"], timeout_s=300)
    fields = run.fields()
    assert (fields["status"], fields["reason"], run.returncode) == ("FAIL", "non_finite_loss", 4), run.stderr[-3000:]
    assert fields["step"] == "16", run.verdict
    assert not (out / "checkpoint-40").exists(), sorted(p.name for p in out.iterdir())
    assert not (dest / "last-checkpoint").exists() or \
        "checkpoint-20" not in (dest / "last-checkpoint" / "guard_manifest.json").read_text()


def _all_finite(path: Path) -> bool:
    state = torch.load(path, weights_only=True)
    tensors = state.get("model", state)
    return all(bool(torch.isfinite(t).all()) for t in tensors.values())


def test_weights_gone_nan_under_a_finite_loss_are_never_pushed(tmp_path: Path) -> None:
    """ModernBERT #233: a masked mean kept "NaN-safe" stays finite (0.0) while its gradients, then the weights, go
    NaN. Before the weights were a witness this run ended PASS and pushed the NaN final model over the good
    checkpoint; now the first save holding a non-finite tensor ends it as a non-finite failure."""
    out, dest = tmp_path / "out", tmp_path / "dest"
    run = run_guard([*FAST, "--push-interval", "0s", "--push-to", str(dest), str(JOBS / "masked_mean_nan.py"),
                     "--output-dir", str(out), "--steps", "40", "--save-every", "10", "--empty-at", "25"],
                    timeout_s=200)
    fields = run.fields()
    assert (fields["status"], fields["reason"], run.returncode) == ("FAIL", "non_finite_loss", 4), run.stderr[-3000:]
    assert fields["step"] == "30", run.verdict
    assert "not finite (model.weight)" in run.stderr or "not finite (model.bias)" in run.stderr, run.stderr[-2000:]
    pushed = sorted(dest.rglob("*.pt"))
    assert all(_all_finite(p) for p in pushed), [str(p) for p in pushed]
    assert not (out / "model.pt").exists(), "the job was stopped at the NaN save, before its final model"


def test_safetensors_weights_gone_nan_are_read_by_the_guard_and_never_secured(tmp_path: Path) -> None:
    """ModernBERT #233 with saves the agent does not see (``safetensors.torch.save_file``): the guard finds the
    folders on disk and reads their weights itself before a push. Before, the run ended PASS with checkpoint-40
    (NaN weights, finite loss 0.0) secured and the NaN final model published; now FAIL non_finite_loss naming the
    file and tensor, step 20 secured, nothing non-finite at the destination."""
    from safetensors.torch import load_file

    out, dest = tmp_path / "out", tmp_path / "dest"
    run = run_guard([*FAST, "--push-interval", "0s", "--push-to", str(dest), str(JOBS / "masked_mean_nan.py"),
                     "--output-dir", str(out), "--steps", "40", "--save-every", "10", "--empty-at", "25",
                     "--step-s", "0.4", "--format", "safetensors"], timeout_s=200)
    fields = run.fields()
    assert (fields["status"], fields["reason"], run.returncode) == ("FAIL", "non_finite_loss", 4), run.stderr[-3000:]
    assert "model.safetensors: tensor" in run.stderr and "has a NaN or an infinity" in run.stderr, run.stderr[-2000:]
    assert fields.get("secured") == "yes" and int(fields["secured_step"]) < 30, run.verdict
    pushed = sorted(dest.rglob("*.safetensors"))
    assert pushed, sorted(str(p) for p in dest.rglob("*"))
    assert all(bool(torch.isfinite(t).all()) for p in pushed for t in load_file(str(p)).values()), pushed
    assert not (dest / "model.safetensors").exists()  # the NaN final model is never published


def test_the_save_whose_weights_gave_the_first_non_finite_loss_is_never_secured(tmp_path: Path) -> None:
    # run_clm.py and trl's sft.py at --learning_rate 1e6 --save_steps 1: checkpoint-1 held finite weights of 1e6,
    # step 2's loss (their forward pass) was NaN, and the guard secured checkpoint-1 and said "resume from step 1"
    out, dest = tmp_path / "out", tmp_path / "dest"
    run = run_guard([*FAST, "--push-interval", "0s", "--push-to", str(dest), str(JOBS / "saving_loop.py"),
                     "--output-dir", str(out), "--steps", "30", "--save-every", "1", "--blow-at", "8"], timeout_s=200)
    fields = run.fields()
    assert (fields["status"], fields["reason"], run.returncode) == ("FAIL", "non_finite_loss", 4), run.stderr[-3000:]
    assert fields["step"] == "9" and fields["loss"] == "inf", run.verdict
    assert fields.get("secured_step") != "8", run.verdict
    state = torch.load(dest / "last-checkpoint" / "model.pt", weights_only=True)
    assert state["step"] == int(fields["secured_step"]) < 8, (state["step"], run.verdict)
    x = torch.randn(64, 8)
    assert bool(torch.isfinite((x @ state["model"]["weight"].T + state["model"]["bias"]).pow(2).mean()))
