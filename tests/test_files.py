"""Tests for ``guard.files.write_atomic``: the one atomic writer."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from guard.files import write_atomic


def test_replaces_the_file_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    target = tmp_path / "report.json"
    target.write_bytes(b"old")
    write_atomic(target, b"new\n")
    assert target.read_bytes() == b"new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def test_mode_defaults_to_what_open_would_give(tmp_path: Path) -> None:
    old_umask = os.umask(0o027)
    try:
        write_atomic(tmp_path / "a", b"x")
    finally:
        os.umask(old_umask)
    write_atomic(tmp_path / "b", b"x", mode=0o600)
    assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o640
    assert stat.S_IMODE((tmp_path / "b").stat().st_mode) == 0o600


def test_a_missing_folder_raises_and_writes_nothing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        write_atomic(tmp_path / "missing" / "report.json", b"x")
    assert list(tmp_path.iterdir()) == []


def test_a_symlink_is_replaced_not_followed(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.write_bytes(b"keep")
    link = tmp_path / "link"
    link.symlink_to(real)
    write_atomic(link, b"new")
    assert real.read_bytes() == b"keep"
    assert not link.is_symlink() and link.read_bytes() == b"new"
