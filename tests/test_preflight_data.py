"""The data check: shard sets on disk (parquet, JSON lines, CSV, Arrow, tar), found data, the datasets cache."""

from __future__ import annotations

import io
import json
import tarfile
from collections import namedtuple
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from guard.errors import UsageError
from guard.preflight import PreflightOptions, run_preflight
from guard.preflight.data import (
    LARGE_DATA_BYTES,
    ShardSet,
    check_data,
    check_datasets_cache,
    find_local_data,
    inspect_shard,
)
from guard.run.config import resolve

HTML = "<!DOCTYPE html>\n<html><head><title>429 Too Many Requests</title></head><body>slow down</body></html>\n"


def parquet_shards(folder: Path, count: int, *, of: int | None = None) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        path = folder / f"train-{i:05d}-of-{(of or count):05d}.parquet"
        pq.write_table(pa.table({"text": [f"row {i}", "x"], "label": [i, 1]}), path)
        paths.append(path)
    return paths


def rows_for(tmp_path: Path, *sets: ShardSet, **kwargs: object) -> list:
    return check_data(sets, cwd=tmp_path, **kwargs)  # type: ignore[arg-type]


def test_two_of_four_parquet_shards_fail_with_the_counts(tmp_path: Path) -> None:
    parquet_shards(tmp_path / "data", 2, of=4)
    [row] = rows_for(tmp_path, ShardSet("data/train-*.parquet", 4))
    assert row.status == "fail"
    assert row.seen == "data/train-*.parquet: 2 files matched, the job expects at least 4"


def test_four_parquet_shards_pass_with_one_schema_and_the_count_opened(tmp_path: Path) -> None:
    parquet_shards(tmp_path / "data", 4)
    [row] = rows_for(tmp_path, ShardSet("data/*.parquet", 4))
    assert row.status == "pass", row
    assert "4 files (parquet" in row.seen and "one schema (text:string, label:int64)" in row.seen
    assert row.seen.endswith("opened 4 of 4")


def test_an_html_page_saved_as_parquet_is_named(tmp_path: Path) -> None:
    parquet_shards(tmp_path / "data", 3)
    (tmp_path / "data" / "train-00003-of-00004.parquet").write_text(HTML)
    [row] = rows_for(tmp_path, ShardSet("data/*.parquet", 4))
    assert row.status == "fail"
    assert "data/train-00003-of-00004.parquet is an HTML page, not a parquet file" in row.seen


def test_a_truncated_parquet_shard_is_named_by_pyarrow(tmp_path: Path) -> None:
    [_, second] = parquet_shards(tmp_path / "data", 2)
    second.write_bytes(second.read_bytes()[:-20])  # the footer is gone
    [row] = rows_for(tmp_path, ShardSet("data/*.parquet"))
    assert row.status == "fail"
    assert f"data/{second.name} is not a readable parquet file" in row.seen


def test_a_shard_with_another_schema_is_named(tmp_path: Path) -> None:
    parquet_shards(tmp_path / "data", 2)
    pq.write_table(pa.table({"text": ["a"], "label": ["one"]}), tmp_path / "data" / "train-00009.parquet")
    [row] = rows_for(tmp_path, ShardSet("data/*.parquet"))
    assert row.status == "fail"
    assert "data/train-00009.parquet has another schema than data/train-00000-of-00002.parquet" in row.seen
    assert "column 'label' is string, not int64" in row.seen


def test_an_empty_shard_fails(tmp_path: Path) -> None:
    parquet_shards(tmp_path / "data", 2)
    (tmp_path / "data" / "train-00002.parquet").write_bytes(b"")
    [row] = rows_for(tmp_path, ShardSet("data/*.parquet"))
    assert (row.status, row.seen) == ("fail", "data/*.parquet: data/train-00002.parquet is empty (0 bytes)")


def test_without_pyarrow_parquet_is_checked_by_its_magic_and_the_row_warns(tmp_path: Path) -> None:
    parquet_shards(tmp_path / "data", 2)
    [row] = rows_for(tmp_path, ShardSet("data/*.parquet"), pyarrow_module=None)
    assert row.status == "warn" and "pyarrow not installed: magic bytes only" in row.seen
    (tmp_path / "data" / "zz.parquet").write_bytes(b"PAR1 but no footer")
    [row] = rows_for(tmp_path, ShardSet("data/*.parquet"), pyarrow_module=None)
    assert row.status == "fail" and "data/zz.parquet is not a parquet file (no PAR1 magic" in row.seen


def test_json_lines_shards_first_record_parses(tmp_path: Path) -> None:
    folder = tmp_path / "jsonl"
    folder.mkdir()
    for i in range(3):
        (folder / f"part-{i}.jsonl").write_text("".join(json.dumps({"text": f"t{i}{j}"}) + "\n" for j in range(5)))
    [row] = rows_for(tmp_path, ShardSet("jsonl/*.jsonl", 3))
    assert row.status == "pass" and "3 files (jsonl" in row.seen
    (folder / "part-3.jsonl").write_text('{"text": "cut in the mid\n')
    [row] = rows_for(tmp_path, ShardSet("jsonl/*.jsonl", 3))
    assert row.status == "fail" and "jsonl/part-3.jsonl first record is not JSON" in row.seen


def _tar(path: Path, members: dict[str, bytes]) -> None:
    with tarfile.open(path, "w") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


def test_webdataset_tar_shards_need_a_valid_tar_header(tmp_path: Path) -> None:
    folder = tmp_path / "wds"
    folder.mkdir()
    for i in range(2):
        _tar(folder / f"shard-{i:06d}.tar", {f"{k:05d}.txt": b"hello" for k in range(3)})
    [row] = rows_for(tmp_path, ShardSet("wds/shard-*.tar", 2))
    assert row.status == "pass" and "2 files (tar" in row.seen
    corrupt = bytearray((folder / "shard-000001.tar").read_bytes())
    corrupt[148:156] = b"0000000\x00"  # a wrong header checksum
    (folder / "shard-000001.tar").write_bytes(bytes(corrupt))
    [row] = rows_for(tmp_path, ShardSet("wds/shard-*.tar", 2))
    assert row.status == "fail" and "wds/shard-000001.tar is not a readable tar file" in row.seen


def test_csv_and_arrow_formats(tmp_path: Path) -> None:
    (tmp_path / "a.csv").write_text("text,label\nhi,1\n")
    table = pa.table({"x": [1, 2]})
    with pa.OSFile(str(tmp_path / "b.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    assert inspect_shard(tmp_path / "a.csv", "csv", pa) == (None, None)
    problem, schema = inspect_shard(tmp_path / "b.arrow", "arrow", pa)
    assert problem is None and schema.names == ["x"]
    (tmp_path / "c.arrow").write_bytes(b"not arrow at all")
    assert "not a readable arrow file" in (inspect_shard(tmp_path / "c.arrow", "arrow", pa)[0] or "")


def test_the_time_limit_bounds_how_many_files_are_opened(tmp_path: Path) -> None:
    parquet_shards(tmp_path / "data", 6)
    ticks = iter(range(100))  # each look at the clock is one second later; the limit is 3 s

    [row] = rows_for(tmp_path, ShardSet("data/*.parquet", 6), time_limit_s=3, clock=lambda: float(next(ticks)))
    assert row.status == "pass"
    assert "6 files" in row.seen and "the rest by size only" in row.seen
    opened = int(row.seen.split("opened ")[1].split(" of ")[0])
    assert opened < 6


def test_data_the_script_names_is_found_and_a_missing_one_only_warns(tmp_path: Path) -> None:
    parquet_shards(tmp_path / "data", 2)
    script = tmp_path / "train.py"
    script.write_text('from datasets import load_dataset\n'
                      'ds = load_dataset("parquet", data_files={"train": "data/*.parquet", "test": "gone/*.parquet"})\n'
                      'other = load_dataset("json", data_dir="jsonl_dir")\n'
                      'hub = load_dataset("parquet", data_files="hf://datasets/acme/x/*.parquet")\n')
    found = find_local_data(script, ["--train_file", "train.jsonl", "--data-dir=/srv/d"])
    assert [(s.pattern, s.origin, s.required) for s in found] == [
        ("data/*.parquet", "data_files= in train.py", False),
        ("gone/*.parquet", "data_files= in train.py", False),
        ("jsonl_dir", "data_dir= in train.py", False),
        ("train.jsonl", "--train_file argument", False),
        ("/srv/d", "--data-dir argument", False),
    ]
    rows = check_data(found[:2], cwd=tmp_path)
    assert [r.status for r in rows] == ["pass", "warn"]
    assert rows[1].seen == "gone/*.parquet (data_files= in train.py): no file matched, the job expects at least 1"
    assert "--require-shards GLOB:MIN makes it a requirement" in (rows[1].hint or "")


def test_run_preflight_has_data_rows_and_the_corrupt_shard_fails_it(tmp_path: Path) -> None:
    parquet_shards(tmp_path / "data", 1)
    (tmp_path / "data" / "train-00001.parquet").write_text(HTML)
    shards = str(tmp_path / "data" / "*.parquet")
    report = run_preflight(PreflightOptions(require_shards=((shards, 2),), skip_checks={"gpu": "no GPU here"}),
                           environ={"HF_HOME": str(tmp_path / "hf")})
    assert report.failed is not None and report.failed.name == "data"
    assert "train-00001.parquet is an HTML page" in report.failed.seen
    assert [r["name"] for r in report.to_json()].count("data") == 1
    empty = run_preflight(PreflightOptions(skip_checks={"gpu": "no GPU here"}), environ={"HF_HOME": str(tmp_path)})
    [row] = [r for r in empty.results if r.name == "data"]
    assert row.status == "n/a" and "no shards named" in row.seen


Part = namedtuple("Part", "device mountpoint fstype opts")


def test_a_datasets_cache_in_the_container_layer_warns_for_large_data(tmp_path: Path) -> None:
    parts = [Part("overlay", "/", "overlay", "rw"), Part("/dev/sdb", "/data", "ext4", "rw")]
    env = {"HF_HOME": "/root/.cache/huggingface"}
    row = check_datasets_cache(env, data_bytes=LARGE_DATA_BYTES * 2, uses_datasets=True, partitions=lambda: parts)
    assert row is not None and row.status == "warn"
    assert "/root/.cache/huggingface/datasets is on overlay" in row.seen and "HF_DATASETS_CACHE" in (row.hint or "")
    persistent = {"HF_DATASETS_CACHE": "/data/cache"}
    assert check_datasets_cache(persistent, data_bytes=LARGE_DATA_BYTES * 2, uses_datasets=True,
                                partitions=lambda: parts) is None
    assert check_datasets_cache(env, data_bytes=1000, uses_datasets=True, partitions=lambda: parts) is None


def test_require_shards_option_flag_and_env_forms() -> None:
    values, sources = resolve({"require_shards": ["data/*.parquet:4", "c:/x/*.jsonl", "w/*.tar"]}, {})
    assert values["require_shards"] == (("data/*.parquet", 4), ("c:/x/*.jsonl", None), ("w/*.tar", None))
    values, sources = resolve({}, {"GUARD_REQUIRE_SHARDS": "a/*.parquet:2,b/*.jsonl"})
    assert values["require_shards"] == (("a/*.parquet", 2), ("b/*.jsonl", None)) and sources["require_shards"] == "env"
    with pytest.raises(UsageError, match="GLOB:MIN with MIN >= 1"):
        resolve({"require_shards": ["a/*.parquet:0"]}, {})
    values, _ = resolve({"launch_smoke": "off", "launch_smoke_timeout": "30s"}, {})
    assert (values["launch_smoke"], values["launch_smoke_timeout"]) == ("off", 30.0)
    assert resolve({}, {})[0]["launch_smoke"] == "auto"
    with pytest.raises(UsageError, match="accepted: auto, on, off"):
        resolve({"launch_smoke": "sometimes"}, {})
