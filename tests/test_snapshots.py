"""A file saved in place faster than a push starts is copied as soon as its report arrives, held to the signature
the agent reported (``guard.secure.snapshots``), and the record names the folder it was saved in."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from guard.secure import snapshots
from guard.secure.dest.base import MANIFEST_NAME
from guard.secure.scans import Disk
from guard.secure.securer import Securer
from guard.secure.snapshots import Snapshots


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def save(path: Path, step: int) -> dict[str, object]:
    """Write ``path`` in place (the same inode, as ``torch.save`` does) and return the agent's message fields."""
    with open(path, "wb") as out:
        out.write(f"step {step} ".encode() * 50)
    st = os.stat(path)
    return {"path": str(path), "step": step, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


def folders(tmp_path: Path) -> tuple[Path, Disk, Clock]:
    """An output folder, a ``Disk`` whose snapshots go to ``tmp_path/snaps``, and its clock."""
    out = tmp_path / "out"
    out.mkdir()
    disk, clock = Disk(), Clock()
    disk.snapshots = Snapshots(clock=clock, base=tmp_path / "snaps")
    return out, disk, clock


def seen(disk: Disk, message: dict[str, object], out: Path):  # type: ignore[no-untyped-def]
    return disk.file_saved(str(message["path"]), int(message["step"]), str(out), 0,  # type: ignore[call-overload]
                           snapshots.signature_of(message))


def test_a_file_saved_in_place_again_soon_is_secured_from_its_copy_under_its_own_step(tmp_path: Path) -> None:
    out, disk, clock = folders(tmp_path)
    first = seen(disk, save(out / "ckpt.pt", 10), out).info
    assert first is not None and first.source is None and first.folder == out  # saved once: read in place
    clock.now += 0.1
    info = seen(disk, save(out / "ckpt.pt", 20), out).info
    assert info is not None and info.folder != out and info.source == out and info.step == 20
    save(out / "ckpt.pt", 30)  # the job saves again before any push read it: the copy still holds step 20
    assert (info.folder / "ckpt.pt").read_bytes().startswith(b"step 20 ")
    dest = tmp_path / "dest"
    Securer(str(dest)).push_checkpoint(info.folder, step=20, files=list(info.files), deadline=math.inf,
                                       saved_by_s=info.newest_mtime_s, source=str(info.source))
    assert (dest / "last-checkpoint" / "ckpt.pt").read_bytes().startswith(b"step 20 ")
    manifest = json.loads((dest / "last-checkpoint" / MANIFEST_NAME).read_text())
    assert manifest["step"] == 20 and manifest["source"] == str(out) and manifest["place"] == "."


def test_a_save_already_overwritten_when_its_report_is_read_is_not_a_checkpoint(tmp_path: Path) -> None:
    out, disk, clock = folders(tmp_path)
    seen(disk, save(out / "ckpt.pt", 10), out)
    clock.now += 0.1
    stale = save(out / "ckpt.pt", 20)
    os.utime(out / "ckpt.pt", ns=(stale["mtime_ns"] + 10**9, stale["mtime_ns"] + 10**9))  # type: ignore[operator]
    assert seen(disk, stale, out).info is None  # step 30's content would be secured as step 20's


@pytest.mark.parametrize("gap_s", [snapshots.SNAPSHOT_BELOW_S + 1])
def test_a_file_saved_in_place_seldom_is_read_in_place(tmp_path: Path, gap_s: float) -> None:
    out, disk, clock = folders(tmp_path)
    seen(disk, save(out / "ckpt.pt", 10), out)
    clock.now += gap_s
    info = seen(disk, save(out / "ckpt.pt", 20), out).info
    assert info is not None and info.folder == out and info.source is None
    assert not (tmp_path / "snaps").exists()


def test_old_snapshots_are_removed_and_the_newest_two_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(snapshots, "KEEP_COUNT", 3)
    out, disk, clock = folders(tmp_path)
    infos = []
    for step in range(10, 80, 10):
        clock.now += 0.1
        infos.append(seen(disk, save(out / "ckpt.pt", step), out).info)
    kept = sorted(p.name for p in (tmp_path / "snaps").iterdir())
    assert len(kept) == 3 and infos[-1] is not None and infos[-1].folder.name == kept[-1]
    clock.now += snapshots.KEEP_S + 1
    seen(disk, save(out / "ckpt.pt", 80), out)  # saved long after the last: read in place
    clock.now += 0.1
    seen(disk, save(out / "ckpt.pt", 90), out)
    assert len(list((tmp_path / "snaps").iterdir())) == 2  # older than KEEP_S, but the newest two stay
