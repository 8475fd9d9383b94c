"""Wall time of the data check on many small shards (``--require-shards``), with pyarrow reading each footer.

Run from the repository root: ``python benchmarks/bench_shards.py [--shards 2000] [--rounds 3]``.

Writes ``--shards`` parquet files (2 columns, 100 rows each) and as many JSON-lines files into a temporary folder,
then times ``check_data`` over each set ``--rounds`` times (the files are in the page cache after writing, so
this is the check's own cost, not the disk's). Prints a Markdown table: median, min, max, files opened.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from guard.preflight.data import ShardSet, check_data  # noqa: E402 - after the repo root is on sys.path


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shards", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import pyarrow as pa
    import pyarrow.parquet as pq

    with tempfile.TemporaryDirectory(prefix="bench-shards-") as tmp:
        root = Path(tmp)
        (root / "pq").mkdir()
        (root / "jl").mkdir()
        table = pa.table({"text": [f"row {i}" for i in range(100)], "label": list(range(100))})
        for i in range(args.shards):
            pq.write_table(table, root / "pq" / f"train-{i:05d}-of-{args.shards:05d}.parquet")
            (root / "jl" / f"train-{i:05d}.jsonl").write_text(
                "".join(json.dumps({"text": f"row {k}", "label": k}) + "\n" for k in range(100)))
        print(f"| shard set ({args.shards} files) | median s | min s | max s | opened |")
        print("|---|---|---|---|---|")
        for name, pattern in (("parquet footers + schema (pyarrow)", "pq/*.parquet"),
                              ("JSON lines, first record", "jl/*.jsonl")):
            times, seen = [], ""
            for _ in range(args.rounds):
                start = time.perf_counter()
                [row] = check_data([ShardSet(pattern, args.shards)], cwd=root)
                times.append(time.perf_counter() - start)
                seen = row.seen
                assert row.status == "pass", row
            opened = seen.split("opened ", 1)[1]
            print(f"| {name} | {statistics.median(times):.2f} | {min(times):.2f} | {max(times):.2f} | {opened} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
