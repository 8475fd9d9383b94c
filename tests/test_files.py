"""Tests for ``guard.files.write_atomic``: the one atomic writer."""

from __future__ import annotations

import errno
import os
import stat
import time
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


def test_a_fifo_is_written_in_place_not_replaced_by_a_regular_file(tmp_path: Path) -> None:
    """``--report /dev/null`` and a FIFO: a rename over a path that is not a regular file would put a file where
    the device was (as root, /dev/null for the whole machine). A FIFO stands in for the device here."""
    import threading

    fifo = tmp_path / "report.fifo"
    os.mkfifo(fifo)
    got: list[bytes] = []

    def read() -> None:
        with open(fifo, "rb") as reader:
            got.append(reader.read())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the reader's open() must come first (a writer never waits for one)
        try:
            write_atomic(fifo, b'{"status": "PASS"}\n')
            break
        except OSError as exc:
            assert exc.errno == errno.ENXIO
            time.sleep(0.01)
    reader.join(10)
    assert got == [b'{"status": "PASS"}\n']
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert [p.name for p in tmp_path.iterdir()] == ["report.fifo"]  # no temporary file left


def test_a_fifo_without_a_reader_is_an_error_not_a_wait(tmp_path: Path) -> None:
    fifo = tmp_path / "report.fifo"
    os.mkfifo(fifo)
    with pytest.raises(OSError) as info:
        write_atomic(fifo, b"x")
    assert info.value.errno == errno.ENXIO
