"""The guard reads saved weights itself (issue 33, item 2): a safetensors file holding a NaN or an infinity is never
secured and never resumed. Real safetensors bytes written by the ``safetensors`` library from torch tensors, a real
folder destination, real worker processes for the resume."""

from __future__ import annotations

import itertools
import json
import math
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from guard.errors import WeightsNotFiniteError
from guard.secure import resume, securer, weights
from guard.secure.checkpoints import TRAINER_STATE_NAME
from guard.secure.securer import Securer

FLOATS = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
          "F8_E5M2": torch.float8_e5m2, "F8_E4M3": torch.float8_e4m3fn}
#: The largest finite magnitudes of each dtype: their top byte is that of a non-finite value in all but the lowest
#: exponent bit(s), so the exact test must say finite.
HUGE = {"F64": 1e308, "F32": 3e38, "BF16": 3e38, "F16": 65000.0, "F8_E5M2": 57344.0, "F8_E4M3": 448.0}


def save(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return path


def huge(dtype: str, n: int = 64) -> torch.Tensor:
    signs = torch.tensor([1.0, -1.0], dtype=torch.float64).repeat(n // 2)
    return (signs * HUGE[dtype]).to(FLOATS[dtype])


@pytest.mark.parametrize("dtype", sorted(FLOATS))
def test_finite_tensors_pass_even_at_the_largest_finite_magnitudes(tmp_path: Path, dtype: str) -> None:
    path = save(tmp_path / "m.safetensors", {"big": huge(dtype), "small": torch.randn(1000).to(FLOATS[dtype]),
                                             "zeros": torch.zeros(7, dtype=FLOATS[dtype])})
    assert weights.first_non_finite(path) is None


@pytest.mark.parametrize(("dtype", "value", "at"), [
    (d, v, a) for d, v, a in itertools.product(sorted(FLOATS), ("nan", "inf", "-inf"), (0, 511, 1023))
    if not (d == "F8_E4M3" and v != "nan")])  # float8_e4m3fn has no infinity
def test_a_nan_or_an_infinity_anywhere_names_its_tensor(tmp_path: Path, dtype: str, value: str, at: int) -> None:
    bad = huge(dtype, 1024)  # every element's top byte looks like a non-finite one: only the exact test tells
    bad[at] = float(value)
    path = save(tmp_path / "m.safetensors", {"a.finite": torch.randn(10).to(FLOATS[dtype]), "b.bad": bad,
                                             "c.ints": torch.arange(5)})
    assert weights.first_non_finite(path) == ("b.bad", dtype)


def test_every_chunk_is_read_and_the_first_bad_tensor_in_file_order_is_named(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(weights, "CHUNK_BYTES", 64)  # many chunks per tensor; the NaN lies in the last one
    late = torch.randn(1000)
    late[-1] = float("nan")
    other = torch.randn(100)
    other[3] = float("inf")
    path = save(tmp_path / "m.safetensors", {"layer.0": torch.randn(300), "layer.1": late, "layer.2": other})
    header = json.loads(path.read_bytes()[8:8 + int.from_bytes(path.read_bytes()[:8], "little")])
    first = min(("layer.1", "layer.2"), key=lambda name: header[name]["data_offsets"][0])
    assert weights.first_non_finite(path) == (first, "F32")


def test_integer_and_boolean_tensors_are_not_read(tmp_path: Path) -> None:
    path = save(tmp_path / "m.safetensors", {"ids": torch.full((100,), -1, dtype=torch.int32),
                                             "mask": torch.ones(64, dtype=torch.bool),
                                             "u8": torch.full((64,), 255, dtype=torch.uint8)})
    assert weights.first_non_finite(path) is None


def test_other_files_and_files_cut_short_are_left_to_the_format_checks(tmp_path: Path) -> None:
    bad = torch.randn(100)
    bad[50] = float("nan")
    torch.save({"w": bad}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)  # pre-1.6 layout: not read
    (tmp_path / "raw.bin").write_bytes(b"\0" + bad.numpy().tobytes())  # a job's own bytes: no format known
    whole = save(tmp_path / "m.safetensors", {"w": bad}).read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(whole[:-300])  # the NaN's bytes are gone
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    checked = weights.check_files(tmp_path, ["legacy.pt", "raw.bin", "cut.safetensors", "junk.safetensors"])
    assert (checked.bad, checked.files) == (None, 1)
    found = weights.check_files(tmp_path, ["legacy.pt", "m.safetensors"]).bad
    assert found is not None and (found.file, found.tensor, found.dtype) == ("m.safetensors", "w", "F32")


TORCH_FLOATS = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


@pytest.mark.parametrize(("dtype", "value"), list(itertools.product(sorted(TORCH_FLOATS), ("nan", "inf", "-inf"))))
def test_a_torch_save_zip_is_read_without_torch_and_names_the_tensor(tmp_path: Path, dtype: str,
                                                                       value: str) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).to(TORCH_FLOATS[dtype])
    state = {"step": 7, "model": model.state_dict(), "ids": torch.arange(5),
             "optimizer": {"state": {0: {"exp_avg": torch.zeros(4, dtype=TORCH_FLOATS[dtype])}}, "lr": 0.1}}
    torch.save(state, tmp_path / "ckpt.pt")
    assert weights.first_non_finite(tmp_path / "ckpt.pt") is None
    with torch.no_grad():
        model[1].bias[1] = float(value)
    torch.save(state, tmp_path / "ckpt.pt")
    assert weights.first_non_finite(tmp_path / "ckpt.pt") == ("model.1.bias", dtype)
    state["optimizer"]["state"][0]["exp_avg"][3] = float(value)
    with torch.no_grad():
        model[1].bias[1] = 0.0
    torch.save(state, tmp_path / "ckpt.pt")
    assert weights.first_non_finite(tmp_path / "ckpt.pt") == ("optimizer.state.0.exp_avg", dtype)


def test_a_whole_module_and_a_view_are_read_with_their_storage(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 3)
    with torch.no_grad():
        model.weight[2, 2] = float("nan")
    torch.save(model, tmp_path / "model.pt")  # a pickled module: its class is named, never imported
    name = weights.first_non_finite(tmp_path / "model.pt")
    assert name is not None and name[0].endswith("weight") and name[1] == "F32"
    base = torch.arange(10.0)
    base[8] = float("inf")
    torch.save({"view": base[2:5]}, tmp_path / "view.pt")  # torch.save writes the whole storage of a view
    assert weights.first_non_finite(tmp_path / "view.pt") == ("view", "F32")


def test_the_check_stops_at_its_deadline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(weights, "CHUNK_BYTES", 1024)
    path = save(tmp_path / "m.safetensors", {"w": torch.randn(10_000)})
    ticks = itertools.count()
    with pytest.raises(weights.CheckTimedOut) as caught:
        weights.first_non_finite(path, deadline=3.0, clock=lambda: float(next(ticks)))
    assert caught.value.path == str(path)


def nan_checkpoint(out: Path, step: int, *, finite: bool) -> Path:
    folder = out / f"checkpoint-{step}"
    state = {"model.weight": torch.randn(4, 4), "model.bias": torch.randn(4)}
    if not finite:
        state["model.bias"][2] = float("nan")
    save(folder / "model.safetensors", state)
    (folder / TRAINER_STATE_NAME).write_text(json.dumps({"global_step": step}))
    return folder


def test_a_push_of_non_finite_weights_is_refused_before_any_byte_moves(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    good = nan_checkpoint(tmp_path / "out", 10, finite=True)
    Securer(str(dest)).push_checkpoint(good, step=10, deadline=math.inf)
    before = sorted(str(p.relative_to(dest)) for p in dest.rglob("*"))
    bad = nan_checkpoint(tmp_path / "out", 20, finite=False)
    with pytest.raises(WeightsNotFiniteError) as caught:
        Securer(str(dest)).push_checkpoint(bad, step=20, deadline=math.inf)
    assert (caught.value.file, caught.value.tensor) == ("model.safetensors", "model.bias")
    assert "model.safetensors: tensor model.bias (F32)" in caught.value.message
    assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*")) == before  # nothing staged, nothing swapped
    assert json.loads((dest / "last-checkpoint" / "guard_manifest.json").read_text())["step"] == 10


def test_a_final_model_of_non_finite_weights_is_never_published(tmp_path: Path) -> None:
    out = tmp_path / "out"
    state = {"w": torch.randn(8)}
    state["w"][0] = float("-inf")
    save(out / "model.safetensors", state)
    with pytest.raises(WeightsNotFiniteError):
        Securer(str(tmp_path / "dest")).push_final(out, deadline=math.inf)
    assert not (tmp_path / "dest" / "model.safetensors").exists()


def secured_by_an_older_guard(dest: Path, folder: Path, step: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a guard that did not read the weights (or an older run's push) left at the destination."""
    with monkeypatch.context() as patched:
        patched.setattr(securer, "refuse_not_finite", lambda *args, **kwargs: 0.0)
        Securer(str(dest)).push_checkpoint(folder, step=step, deadline=math.inf)


def test_resume_never_fetches_a_secured_checkpoint_of_non_finite_weights(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    dest = tmp_path / "dest"
    secured_by_an_older_guard(dest, nan_checkpoint(tmp_path / "run1", 30, finite=False), 30, monkeypatch)
    out = tmp_path / "out"
    nan_checkpoint(out, 20, finite=True)
    with caplog.at_level("INFO", logger="guard"):
        chosen = resume.choose(out, Securer(str(dest)), deadline=time.monotonic() + 60, abort=lambda: False)
    assert chosen is not None and (chosen.path, chosen.step, chosen.source) == (out / "checkpoint-20", 20,
                                                                                 "output folder")
    assert not (out / "checkpoint-30").exists()  # never placed where the job would load it
    assert sorted(os.listdir(out)) == ["checkpoint-20"]  # no staging folder left behind
    assert "model.safetensors: tensor model.bias (F32)" in caplog.text and "not resumed" in caplog.text

    fresh = tmp_path / "fresh"
    assert resume.choose(fresh, Securer(str(dest)), deadline=time.monotonic() + 60, abort=lambda: False) is None
    assert os.listdir(fresh) == []


def test_resume_skips_an_older_runs_ckpt_pt_of_non_finite_weights(tmp_path: Path) -> None:
    """A loop's ``out/ckpt.pt`` saved in place (nanoGPT) by a run the guard did not watch, its weights NaN: no
    marker, no taint; only its bytes tell. Resume starts fresh rather than load it."""
    out = tmp_path / "out"
    out.mkdir()
    weight = torch.randn(4, 4)
    weight[0, 0] = float("nan")
    torch.save({"model": {"fc.weight": weight}, "iter_num": 40}, out / "ckpt.pt")
    assert resume.choose(out, Securer(str(tmp_path / "dest")), deadline=time.monotonic() + 60,
                         abort=lambda: False) is None
    assert (out / "ckpt.pt").is_file()  # left where it is: the job's own file


def test_resume_skips_a_local_checkpoint_of_non_finite_weights(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    out = tmp_path / "out"
    nan_checkpoint(out, 10, finite=True)
    nan_checkpoint(out, 20, finite=False)  # a newer save, whole by format, no marker, no taint: only its bytes tell
    with caplog.at_level("INFO", logger="guard"):
        chosen = resume.choose(out, Securer(str(tmp_path / "dest")), deadline=time.monotonic() + 60,
                               abort=lambda: False)
    assert chosen is not None and (chosen.path, chosen.step) == (out / "checkpoint-10", 10)
    assert "checkpoint-20 holds weights that are not finite (model.safetensors: tensor model.bias" in caplog.text


@pytest.mark.parametrize(("dtype", "value"), [
    (d, v) for d, v in itertools.product(sorted(FLOATS), ("nan", "-nan", "inf", None))
    if not (d == "F8_E4M3" and v in ("inf", None))])
def test_a_mask_may_hold_minus_inf_and_nothing_else_non_finite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               dtype: str, value: str | None) -> None:
    """An attention mask kept in the state dict (GPT-style ``register_buffer("mask", full(-inf).triu(1))``) holds
    -inf by design: every save of such a model was refused. Its name allows -inf (the agent's rule too); a NaN (of
    either sign), a +inf, or a -inf in a tensor not named as a mask is still found, in every chunk."""
    monkeypatch.setattr(weights, "CHUNK_BYTES", 64)
    if dtype == "F8_E4M3":  # no infinity: its all-ones value is a NaN, never a mask's -inf
        mask = torch.zeros(64, dtype=FLOATS[dtype])
        mask[5] = float("nan")
        path = save(tmp_path / "m.safetensors", {"h.0.attn.mask": mask})
        assert weights.first_non_finite(path) == ("h.0.attn.mask", dtype)
        return
    mask = torch.full((32, 32), -math.inf, dtype=torch.float64).triu(1)
    mask[:, 0] = HUGE[dtype]  # the largest finite value beside -inf: only the bits tell them apart (and the sum
    # of a float32 chunk overflows to +inf, then NaN: the exact test decides)
    mask = mask.to(FLOATS[dtype])
    tensors = {"h.0.attn.causal_mask": mask, "h.0.weight": torch.randn(8).to(FLOATS[dtype])}
    path = save(tmp_path / "m.safetensors", tensors)
    assert weights.first_non_finite(path) is None
    if value is None:  # the same -inf in a weight
        tensors["h.0.weight"][3] = -math.inf
        path = save(tmp_path / "m.safetensors", tensors)
        assert weights.first_non_finite(path) == ("h.0.weight", dtype)
        return
    mask.view(-1)[1000] = -math.nan if value == "-nan" else float(value)  # in the last of the small chunks
    path = save(tmp_path / "m.safetensors", tensors)
    assert weights.first_non_finite(path) == ("h.0.attn.causal_mask", dtype)


def test_a_torch_save_zip_with_a_minus_inf_mask_buffer_is_finite(tmp_path: Path) -> None:
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)
            self.register_buffer("mask", torch.full((6, 6), float("-inf")).triu(1))

    model = torch.nn.Sequential(Block(), Block())
    torch.save({"model": model.state_dict(), "step": 3}, tmp_path / "ckpt.pt")
    assert weights.first_non_finite(tmp_path / "ckpt.pt") is None
    model[1].mask[2, 0] = float("inf")
    torch.save({"model": model.state_dict(), "step": 3}, tmp_path / "ckpt.pt")
    assert weights.first_non_finite(tmp_path / "ckpt.pt") == ("model.1.mask", "F32")
