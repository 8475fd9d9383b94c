"""Structural checks by format (guard.secure.formats) on real files: valid, truncated, zero-length."""

from __future__ import annotations

import json
import os
import pickle
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from guard.secure import formats  # noqa: E402


def _model() -> dict[str, object]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 2))
    return {"model": net.state_dict(), "step": 7, "half": torch.zeros(5, dtype=torch.half)}


def _cut(path: Path, keep: float) -> Path:
    data = path.read_bytes()
    out = path.with_name(f"cut-{path.name}")
    out.write_bytes(data[: int(len(data) * keep)])
    return out


def _empty(path: Path) -> Path:
    out = path.with_name(f"empty-{path.name}")
    out.write_bytes(b"")
    return out


@pytest.fixture
def zip_pt(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt.pt"
    torch.save(_model(), path)
    return path


@pytest.fixture
def legacy_pt(tmp_path: Path) -> Path:
    path = tmp_path / "legacy.pt"
    torch.save(_model(), path, _use_new_zipfile_serialization=False)
    return path


@pytest.fixture
def safetensors_file(tmp_path: Path) -> Path:
    from safetensors.torch import save_file

    path = tmp_path / "model.safetensors"
    save_file({"w": torch.randn(32, 8), "b": torch.zeros(8)}, str(path), metadata={"format": "pt"})
    return path


def test_torch_zip_whole_truncated_empty(zip_pt: Path) -> None:
    assert formats.kind_of(zip_pt) == "torch-zip"
    assert formats.check_file(zip_pt) is None
    for keep in (0.1, 0.5, 0.99):
        why = formats.check_file(_cut(zip_pt, keep))
        assert why is not None and "zip" in why
    assert formats.check_file(_empty(zip_pt)) == "empty (0 bytes)"


def test_torch_zip_loads_only_when_the_check_passes(zip_pt: Path) -> None:
    cut = _cut(zip_pt, 0.9)
    with pytest.raises(RuntimeError, match="central directory"):
        torch.load(cut)
    assert formats.check_file(cut) is not None
    torch.load(zip_pt)


def test_legacy_pickle_whole_truncated_empty(legacy_pt: Path) -> None:
    assert formats.kind_of(legacy_pt) == "pickle"
    assert formats.check_file(legacy_pt) is None
    size = legacy_pt.stat().st_size
    for cut_at in (10, size // 3, size - 200, size - 1):
        out = legacy_pt.with_name(f"cut{cut_at}.pt")
        out.write_bytes(legacy_pt.read_bytes()[:cut_at])
        why = formats.check_file(out)
        assert why is not None and "cut short" in why, (cut_at, why)
    assert formats.check_file(_empty(legacy_pt)) == "empty (0 bytes)"
    extra = legacy_pt.with_name("extra.pt")
    extra.write_bytes(legacy_pt.read_bytes() + b"\0" * 16)
    assert "after the last storage" in (formats.check_file(extra) or "")


def test_plain_pickle(tmp_path: Path) -> None:
    path = tmp_path / "random_states_0.pkl"
    path.write_bytes(pickle.dumps({"step": 3, "rng": list(range(500))}))
    assert formats.check_file(path) is None
    assert "does not end" in (formats.check_file(_cut(path, 0.5)) or "")
    assert formats.check_file(_empty(path)) == "empty (0 bytes)"


def test_the_stub_unpickler_runs_no_code_of_the_file(tmp_path: Path) -> None:
    class Boom:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, ("touch " + str(tmp_path / "ran"),))

    path = tmp_path / "evil.pkl"
    path.write_bytes(pickle.dumps(Boom()))
    assert formats.check_file(path) is None  # a whole pickle stream
    formats._StubUnpickler(path.open("rb")).load()
    assert not (tmp_path / "ran").exists()


def test_safetensors_whole_truncated_empty(safetensors_file: Path) -> None:
    assert formats.check_file(safetensors_file) is None
    for keep in (0.02, 0.5, 0.999):
        why = formats.check_file(_cut(safetensors_file, keep))
        assert why is not None, keep
    assert formats.check_file(_empty(safetensors_file)) == "empty (0 bytes)"
    longer = safetensors_file.with_name("longer.safetensors")
    longer.write_bytes(safetensors_file.read_bytes() + b"x")
    assert "the file has" in (formats.check_file(longer) or "")


def test_json(tmp_path: Path) -> None:
    path = tmp_path / "trainer_state.json"
    path.write_text(json.dumps({"global_step": 20, "log_history": [{"loss": 1.0}] * 20}))
    assert formats.check_file(path) is None
    assert "does not parse" in (formats.check_file(_cut(path, 0.5)) or "")


def test_files_of_no_known_format_are_taken_as_they_are(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"\x01\x02garbage" * 10)
    (tmp_path / "raw.safetensors").write_bytes(b"\xff" * 100)  # not a safetensors header
    (tmp_path / "notes.txt").write_text("hello")
    for name in ("weights.bin", "raw.safetensors", "notes.txt"):
        assert formats.check_file(tmp_path / name) is None, name
    assert formats.kind_of(tmp_path / "raw.safetensors") is None
    (tmp_path / "tiny.safetensors").write_bytes(b"\x10\x00")
    assert "shorter than" in (formats.check_file(tmp_path / "tiny.safetensors") or "")


def _dcp_save(folder: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": torch.nn.Linear(64, 32).state_dict(), "step": 5}, checkpoint_id=str(folder))


def test_distcp_set(tmp_path: Path) -> None:
    folder = tmp_path / "step_5"
    _dcp_save(folder)
    names = sorted(os.listdir(folder))
    assert formats.check_files(folder, names) == []
    shard = next(n for n in names if n.endswith(".distcp"))
    # a shard cut short
    data = (folder / shard).read_bytes()
    (folder / shard).write_bytes(data[: len(data) // 2])
    assert any("cut short" in p for p in formats.check_files(folder, names))
    (folder / shard).write_bytes(data)
    # a shard the metadata does not name (a rank still writing, another save's)
    (folder / "__1_0.distcp").write_bytes(b"x" * 100)
    assert any("__1_0.distcp is not named" in p for p in formats.check_files(folder, [*names, "__1_0.distcp"]))
    (folder / "__1_0.distcp").unlink()
    # metadata not written yet (it is written last)
    meta = (folder / ".metadata").read_bytes()
    (folder / ".metadata").unlink()
    assert any(".metadata missing" in p for p in formats.check_files(folder, [shard]))
    (folder / ".metadata").write_bytes(meta[: len(meta) // 2])
    assert any("does not parse" in p for p in formats.check_files(folder, names))
    (folder / ".metadata").write_bytes(b"")
    assert formats.check_files(folder, names)


def test_check_files_names_each_problem(tmp_path: Path, zip_pt: Path) -> None:
    sub = tmp_path / "checkpoint-3"
    sub.mkdir()
    (sub / "model.pt").write_bytes(zip_pt.read_bytes()[:100])
    (sub / "trainer_state.json").write_text("{}")
    problems = formats.check_files(tmp_path, ["ckpt.pt", "checkpoint-3/model.pt", "checkpoint-3/trainer_state.json"])
    assert len(problems) == 1 and problems[0].startswith("checkpoint-3/model.pt: ")
