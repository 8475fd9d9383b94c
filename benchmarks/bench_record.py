"""The record's cost on many nodes: each node's guard puts its part of one checkpoint, and the record moves once
every part is there (issue 34; ``guard.secure.securer.Securer`` with ``node_rank``/``nodes``, on an S3 destination).

Run from the repository root: ``python benchmarks/bench_record.py [--nodes 2,4,8] [--size-mb 200] [--rounds 3]``.

For each node count n, a checkpoint of ``--size-mb`` MB (10^6 bytes) of random bytes is split over n node folders
(each its own ``step_100/`` with 4 files of ``size / (4 n)`` bytes; node 0 also holds a small ``.metadata``-like
file). n threads, one per node, each run the guard's own push of its part, ``Securer.push_checkpoint`` (the code a
node's securing worker runs): put every file verified by SHA-256, the node's manifest, then list the step's
manifests until all n are in and whole, then one conditional write of the record. Timed, per round:

- **record**: from the moment the last node's manifest was written (its part verified) to the first record write
  that returned: the listing poll (``guard.secure.meeting.PARTS_POLL_S``), the union check and the record's own
  verification (one ``HEAD`` per file) and write;
- **securing**: from the start of the puts to that record write: what a deadline must leave for the whole
  checkpoint.

The destination is a local S3 server (moto, ``tests/s3server.py``) on the same cores as the n client threads: its
work is in the figures. Prints the load average before and after, then a Markdown table of the medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "tests"))

from tests.s3server import MotoServer  # noqa: E402
from tests.s3server import env as s3_env  # noqa: E402

MB = 1_000_000


def make_parts(root: Path, nodes: int, size_mb: int) -> list[Path]:
    """n node folders of one checkpoint: ``root/node-k/step_100/`` with 4 files each (see the module docstring)."""
    each = size_mb * MB // (4 * nodes)
    folders = []
    for node in range(nodes):
        folder = root / f"node-{node}" / "step_100"
        folder.mkdir(parents=True)
        for i in range(4):
            with open(folder / f"__{node}_{i}.bin", "wb") as out:
                out.write(b"\0")
                for offset in range(1, each, 16 * MB):
                    out.write(os.urandom(min(16 * MB, each - offset)))
        if node == 0:
            (folder / "metadata.json").write_text(f'{{"nodes": {nodes}}}')
        folders.append(folder)
    return folders


def one_round(moto: MotoServer, nodes: int, folders: list[Path], round_no: int) -> tuple[float, float]:
    """``(record s, securing s)`` of one checkpoint secured by ``nodes`` node threads."""
    from guard.secure.dest.s3 import S3Store
    from guard.secure.securer import Securer

    bucket = moto.bucket()
    parts_done: list[float] = []
    records_done: list[float] = []
    lock = threading.Lock()

    class Timed(S3Store):
        def put_part(self, *args: Any, **kwargs: Any) -> Any:
            manifest = super().put_part(*args, **kwargs)
            with lock:
                parts_done.append(time.monotonic())
            return manifest

        def write_record(self, *args: Any, **kwargs: Any) -> Any:
            record = super().write_record(*args, **kwargs)
            with lock:
                records_done.append(time.monotonic())
            return record

    errors: list[BaseException] = []

    def node(rank: int) -> None:
        try:
            store = Timed(bucket, f"round-{round_no}", client=moto.client())
            Securer(f"s3://{bucket}/round-{round_no}", run_id=f"bench-{round_no}", store=store, node_rank=rank,
                    nodes=nodes).push_checkpoint(folders[rank], step=100, deadline=time.monotonic() + 600)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=node, args=(rank,)) for rank in range(nodes)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    first_record = min(records_done)
    return first_record - max(parts_done), first_record - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="2,4,8")
    parser.add_argument("--size-mb", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    counts = [int(n) for n in args.nodes.split(",")]
    print(f"load average before: {os.getloadavg()}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-record-") as tmp, MotoServer(Path(tmp)) as moto:
        os.environ.update(s3_env(moto.url))
        for nodes in counts:
            folders = make_parts(Path(tmp) / f"n{nodes}", nodes, args.size_mb)
            timings = [one_round(moto, nodes, folders, round_no) for round_no in range(args.rounds)]
            record = statistics.median(t[0] for t in timings)
            securing = statistics.median(t[1] for t in timings)
            rows.append((nodes, args.size_mb / nodes, record, securing))
            print(f"{nodes} nodes: record {record:.2f}s, securing {securing:.2f}s", flush=True)
    print(f"load average after: {os.getloadavg()}")
    print("\n| nodes | part per node (MB) | last part verified -> record written (s) | securing, all parts and the "
          "record (s) |\n|---|---|---|---|")
    for nodes, part_mb, record, securing in rows:
        print(f"| {nodes} | {part_mb:.0f} | {record:.2f} | {securing:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
