"""Storage checks on real temporary folders (``disk_usage`` is injected only to script a full or tiny disk)."""

from __future__ import annotations

import os
from collections import namedtuple
from pathlib import Path

import pytest

from guard.preflight.storage import (
    DEFAULT_MIN_FREE_BYTES,
    check_cache,
    check_free_space,
    check_shm,
    check_writable,
    estimate_free_bytes,
)

Usage = namedtuple("Usage", "total used free")


def usage(total: int = 10**12, free: int = 10**12):
    return lambda path: Usage(total, total - free, free)


def test_existing_folder_is_writable_and_no_probe_file_is_left(tmp_path: Path) -> None:
    row = check_writable("output folder", tmp_path, hint="h")
    assert row.status == "pass" and row.seen == f"output folder {tmp_path} writable"
    assert list(tmp_path.iterdir()) == []


def test_missing_folder_is_tested_in_its_nearest_parent_and_not_created(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b"
    row = check_writable("output folder", target, hint="h")
    assert row.status == "pass" and f"(will be created in {tmp_path})" in row.seen
    assert not (tmp_path / "a").exists()


def test_a_path_under_a_file_is_not_writable(tmp_path: Path) -> None:
    (tmp_path / "file.txt").write_text("x")
    row = check_writable("output folder", tmp_path / "file.txt" / "out", hint="choose another")
    assert row.status == "fail" and "is not a folder" in row.seen and row.hint == "choose another"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through permission bits")
def test_read_only_folder_fails(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        row = check_writable("output folder", ro / "out", hint="h")
    finally:
        ro.chmod(0o700)
    assert row.status == "fail" and "not writable" in row.seen


def test_read_only_file_system_fails() -> None:
    if not Path("/proc/sys").is_dir():
        pytest.skip("no /proc/sys here")
    row = check_writable("output folder", Path("/proc/sys/guard-out"), hint="h")
    assert row.status == "fail" and "not writable" in row.seen


def test_free_space_below_min_free_disk_fails(tmp_path: Path) -> None:
    row = check_free_space(tmp_path, min_free_bytes=50 * 10**9, model_size_bytes=None,
                           disk_usage=usage(free=20 * 10**9))
    assert row.status == "fail"
    assert row.seen == f"20.0 GB free at {tmp_path}; need 50.0 GB (--min-free-disk)"


def test_free_space_default_is_ten_gb_and_only_warns(tmp_path: Path) -> None:
    row = check_free_space(tmp_path, min_free_bytes=None, model_size_bytes=None, disk_usage=usage(free=5 * 10**9))
    assert row.status == "warn" and "need 10.0 GB (default; model size unknown)" in row.seen
    assert DEFAULT_MIN_FREE_BYTES == 10 * 10**9


def test_free_space_estimate_from_the_model_size(tmp_path: Path) -> None:
    assert estimate_free_bytes(2 * 10**9) == 14 * 10**9
    row = check_free_space(tmp_path, min_free_bytes=None, model_size_bytes=2 * 10**9,
                           disk_usage=usage(free=10 * 10**9))
    assert row.status == "warn" and "need 14.0 GB (estimate: 7 x the model's 2.0 GB)" in row.seen
    ok = check_free_space(tmp_path, min_free_bytes=None, model_size_bytes=10**6, disk_usage=usage(free=10**9))
    assert ok.status == "pass"


def test_free_space_of_a_real_folder(tmp_path: Path) -> None:
    row = check_free_space(tmp_path / "not-yet", min_free_bytes=1, model_size_bytes=None)
    assert row.status == "pass" and f"free at {tmp_path}" in row.seen


def test_small_shm_warns_naming_the_fix(tmp_path: Path) -> None:
    row = check_shm(tmp_path, disk_usage=usage(total=64 * 1024**2))
    assert row.status == "warn" and "67.1 MB" in row.seen
    assert "--shm-size" in row.hint and "medium: Memory" in row.hint


def test_large_shm_passes_and_missing_shm_is_na(tmp_path: Path) -> None:
    assert check_shm(tmp_path, disk_usage=usage(total=8 * 1024**3)).status == "pass"
    missing = check_shm(tmp_path / "nope")
    assert missing.status == "n/a" and missing.seen == f"no {tmp_path / 'nope'} on this system"


def test_hf_cache_writable_from_hf_home(tmp_path: Path) -> None:
    row = check_cache({"HF_HOME": str(tmp_path)})
    assert row.status == "pass" and str(tmp_path / "hub") in row.seen


def test_unwritable_hf_cache_fails_online_and_warns_offline(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    env = {"HF_HUB_CACHE": str(tmp_path / "file" / "hub")}
    assert check_cache(env).status == "fail"
    offline = check_cache({**env, "HF_HUB_OFFLINE": "1"})
    assert offline.status == "warn" and "HF_HUB_OFFLINE=1" in offline.seen
