"""Which S3 client for ``--push-to s3://``: the same uploads through each candidate against a local S3 server, with
their time, CPU, peak memory and what each leaves verified.

Run from the repository root, in an environment that has the candidates (only boto3 is the project's; install the
others in a throwaway one, never in the project's dependencies)::

    python -m venv /tmp/s3bench && /tmp/s3bench/bin/pip install boto3 obstore minio "moto[server]"
    /tmp/s3bench/bin/python benchmarks/bench_s3_clients.py [--rounds 3] [--big-mb 2000] [--cases many,big]
        [--only boto3-guard,boto3-transfer,boto3-transfer-sha256,obstore,minio] [--endpoint URL] [--workdir DIR]

Without ``--endpoint`` it starts ``moto_server`` (``tests/s3server.py``; next to the interpreter or on ``PATH``)
on 127.0.0.1. Cases: ``many``: the checkpoint of ``benchmarks/bench_destinations.py`` (200 MB of random bytes in 60
files: four 37.5 MB shards, a 49 MB optimizer state, small files); ``big``: one file of ``--big-mb`` MB (10^6
bytes). Every candidate gets the guard's transfer settings (``S3Store``'s defaults): 8 requests in flight, one
PUT up to 64 MiB, 16 MiB parts above, so the rows compare the clients, not their defaults. Each upload runs in a
fresh child process (``--child``), so its peak resident memory (``VmHWM``) is that client's alone; the child
reports its import time, the upload's wall and CPU time (``process_time``: every thread of the process, Rust's
too), the resident memory after the import and at its peak. The clients take turns within a round. The parent then
reads every object back with ``HEAD`` (``ChecksumMode=ENABLED``): its size, and the checksum the store keeps for it
(what a later reader can check against), and removes everything the child wrote.

Candidates:

- ``boto3-guard``: the guard's push as it ships, ``S3Store.put_part`` then ``S3Store.write_record`` (what
  ``Securer`` calls; ``guard/secure/dest/s3.py`` and ``s3io.py``): each object and each part sent with its
  SHA-256, a ``HEAD`` per object comparing the size and the stored SHA-256 with what was sent, the node's
  manifest, every object checked by ``HEAD`` again, then the record by one conditional write.
- ``boto3-transfer``: boto3's managed transfer (s3transfer, one transfer manager for all files) with botocore's
  default request checksum (CRC32); nothing read back.
- ``boto3-transfer-sha256``: the same asked for ``ChecksumAlgorithm=SHA256``; nothing read back.
- ``obstore``: ``obstore.put`` (Rust ``object_store``) with ``checksum_algorithm="sha256"``; nothing read back.
- ``minio``: ``Minio.fput_object``: the payload's SHA-256 in the request signature over plain HTTP (Content-MD5
  over HTTPS), no checksum kept by the store; nothing read back.

The server is moto on the same cores as the client: its work is in the wall times (a real store's is not), so the
CPU and memory columns are the clients' own figures and the wall times are not a store's. moto keeps the checksum a
client sends without checking it against the bytes (real S3 refuses a mismatch with ``BadDigest``), and keeps it
only when ``x-amz-sdk-checksum-algorithm`` names the algorithm: obstore sends ``x-amz-checksum-sha256`` on a
single PUT without that header, so its one-PUT objects show no checksum here, where S3 would keep one. All requests
go over plain HTTP, where every client also hashes each body for the SigV4 signature. Prints the load average
before and after, then a Markdown table of the medians.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

MIB = 1024 * 1024
#: The guard's S3Store defaults (guard/secure/dest/s3.py), which every candidate is given too.
PART_BYTES = 16 * MIB
MULTIPART_ABOVE_BYTES = 64 * MIB
IN_FLIGHT = 8
KEYS = {"AWS_ACCESS_KEY_ID": "bench-key-0001", "AWS_SECRET_ACCESS_KEY": "bench-secret-0001",
        "AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}

#: ``(relative name, local path)`` of each file of the upload, sorted.
Files = list[tuple[str, Path]]
#: An upload: ``(source folder, its files, bucket, key prefix, endpoint) -> the key prefix the files went under``.
Upload = Callable[[Path, Files, str, str, str], str]


def _each_file(files: Files, put: Callable[[str, Path], Any]) -> None:
    """``put`` each file, ``IN_FLIGHT`` files at a time (what the guard does with small files)."""
    with cf.ThreadPoolExecutor(IN_FLIGHT) as pool:
        for done in [pool.submit(put, rel, path) for rel, path in files]:
            done.result()


def up_boto3_guard(src: Path, files: Files, bucket: str, prefix: str, endpoint: str) -> str:
    """The guard's push as it ships (``Securer`` calls these two): ``S3Store.put_part`` (every file up with its
    SHA-256 and checked by ``HEAD``, then the node's manifest), then ``S3Store.write_record`` (every file checked
    by ``HEAD`` again, then the record by one conditional write). The store's defaults, the standard AWS
    variables (``AWS_ENDPOINT_URL``)."""
    from guard.secure.dest.s3 import S3Store

    store = S3Store(bucket, prefix.rstrip("/"))
    try:
        deadline = time.monotonic() + 3600
        part = store.put_part(src, [rel for rel, _ in files], run_id="bench", step=1, node_rank=0, nodes=1,
                              place=None, source=None, deadline=deadline)
        store.write_record([part], deadline=deadline)
    finally:
        store.close()
    return prefix + ".guard/staging/bench/step-1/node-0/"


def _transfer(files: Files, bucket: str, prefix: str, extra_args: dict[str, str] | None) -> str:
    """boto3's managed transfer (s3transfer): one transfer manager for all files."""
    import boto3
    from boto3.s3.transfer import TransferConfig, create_transfer_manager

    client = boto3.client("s3")
    config = TransferConfig(multipart_threshold=MULTIPART_ABOVE_BYTES, multipart_chunksize=PART_BYTES,
                            max_concurrency=IN_FLIGHT)
    with create_transfer_manager(client, config) as manager:
        for future in [manager.upload(str(path), bucket, prefix + rel, extra_args=extra_args)
                       for rel, path in files]:
            future.result()
    return prefix


def up_boto3_transfer(src: Path, files: Files, bucket: str, prefix: str, endpoint: str) -> str:
    """The managed transfer with botocore's default request checksum (CRC32 where the operation takes one)."""
    return _transfer(files, bucket, prefix, None)


def up_boto3_transfer_sha256(src: Path, files: Files, bucket: str, prefix: str, endpoint: str) -> str:
    """The managed transfer asked for SHA-256 (``ChecksumAlgorithm``): botocore hashes each object or part."""
    return _transfer(files, bucket, prefix, {"ChecksumAlgorithm": "SHA256"})


def up_obstore(src: Path, files: Files, bucket: str, prefix: str, endpoint: str) -> str:
    """``obstore.put`` (Rust ``object_store``) with ``checksum_algorithm="sha256"``."""
    import obstore
    from obstore.store import S3Store

    store = S3Store(bucket, endpoint=endpoint, region="us-east-1", access_key_id=KEYS["AWS_ACCESS_KEY_ID"],
                    secret_access_key=KEYS["AWS_SECRET_ACCESS_KEY"], virtual_hosted_style_request=False,
                    checksum_algorithm="sha256", client_options={"allow_http": True})
    _each_file(files, lambda rel, path: obstore.put(
        store, prefix + rel, path, use_multipart=path.stat().st_size > MULTIPART_ABOVE_BYTES,
        chunk_size=PART_BYTES, max_concurrency=IN_FLIGHT))
    return prefix


def up_minio(src: Path, files: Files, bucket: str, prefix: str, endpoint: str) -> str:
    """``Minio.fput_object``: one PUT up to 64 MiB (its part size set to that), else 16 MiB parts, 8 at once."""
    from minio import Minio

    client = Minio(endpoint.split("://", 1)[1], access_key=KEYS["AWS_ACCESS_KEY_ID"],
                   secret_key=KEYS["AWS_SECRET_ACCESS_KEY"], secure=endpoint.startswith("https"),
                   region="us-east-1")
    _each_file(files, lambda rel, path: client.fput_object(
        bucket, prefix + rel, str(path),
        part_size=PART_BYTES if path.stat().st_size > MULTIPART_ABOVE_BYTES else MULTIPART_ABOVE_BYTES,
        num_parallel_uploads=IN_FLIGHT))
    return prefix


#: Each candidate: (the modules it imports, its upload).
CLIENTS: dict[str, tuple[tuple[str, ...], Upload]] = {
    "boto3-guard": (("boto3", "guard.secure.dest.s3"), up_boto3_guard),
    "boto3-transfer": (("boto3", "boto3.s3.transfer"), up_boto3_transfer),
    "boto3-transfer-sha256": (("boto3", "boto3.s3.transfer"), up_boto3_transfer_sha256),
    "obstore": (("obstore",), up_obstore),
    "minio": (("minio",), up_minio),
}


def _rss_mb(field: str = "VmHWM") -> float:
    """This process's peak (``VmHWM``) or current (``VmRSS``) resident memory, MB (``ru_maxrss`` would not do: Linux
    keeps the parent's peak across ``execve``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(client: str, src: Path, bucket: str, prefix: str, endpoint: str) -> dict[str, Any]:
    """One upload in this (fresh) process: its figures, and the key prefix its files went under."""
    import importlib

    modules, upload = CLIENTS[client]
    started = time.perf_counter()
    for module in modules:
        importlib.import_module(module)
    import_s = time.perf_counter() - started
    rss_after_import = _rss_mb("VmRSS")
    files = sorted((str(p.relative_to(src)), p) for p in src.rglob("*") if p.is_file())
    cpu0, wall0 = time.process_time(), time.perf_counter()  # process_time: every thread of this process
    base = upload(src, files, bucket, prefix, endpoint)
    return {"import_s": import_s, "wall_s": time.perf_counter() - wall0, "cpu_s": time.process_time() - cpu0,
            "rss_import_mb": rss_after_import, "rss_peak_mb": _rss_mb(), "base": base}


def stored(s3: Any, bucket: str, prefix: str, base: str, src: Path) -> tuple[str, int]:
    """``(checksums the store keeps, bytes)`` of what a child uploaded under ``base``: every object's size checked
    by ``HEAD``; then everything under ``prefix`` removed (moto holds objects in memory)."""
    kinds: set[str] = set()
    total = 0
    for path in sorted(p for p in src.rglob("*") if p.is_file()):
        key = base + str(path.relative_to(src))
        head = s3.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
        size = path.stat().st_size
        if int(head["ContentLength"]) != size:
            raise SystemExit(f"{key}: {head['ContentLength']} bytes at the store, {size} sent")
        found = [name[len("Checksum"):] for name in head if name.startswith("Checksum") and name != "ChecksumType"
                 and head[name]]
        how = "parts" if "-" in str(head.get("ETag", "")) else "one PUT"  # a multipart object's ETag ends in -N
        scope = f" {head['ChecksumType'].lower().replace('_', '-')}" if found and head.get("ChecksumType") else ""
        kinds.add(f"{'+'.join(sorted(found)) if found else 'none'}{scope} ({how})")
        total += size
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        if page.get("Contents"):
            s3.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": o["Key"]} for o in page["Contents"]],
                                                     "Quiet": True})
    return ", ".join(sorted(kinds)), total


def big_file(root: Path, size_mb: int) -> Path:
    folder = root / "big"
    folder.mkdir(parents=True)
    with open(folder / "model.safetensors", "wb") as out:
        left = size_mb * 1_000_000
        while left:
            out.write(os.urandom(min(16 * MIB, left)))
            left -= min(16 * MIB, left)
    return folder


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=5, metavar=("CLIENT", "SRC", "BUCKET", "PREFIX", "ENDPOINT"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=3, help="rounds per client and case (default 3)")
    parser.add_argument("--big-mb", type=int, default=2000, help="the one large file, MB of 10^6 bytes (2000)")
    parser.add_argument("--only", default=",".join(CLIENTS), help=f"clients (default all: {','.join(CLIENTS)})")
    parser.add_argument("--cases", default="many,big", help="many, big or both (default)")
    parser.add_argument("--endpoint", help="a running S3 server (default: start moto_server on 127.0.0.1)")
    parser.add_argument("--workdir", default=None, help="where the test files go (default: a temporary folder)")
    args = parser.parse_args()
    if args.child:
        client, src, bucket, prefix, endpoint = args.child
        print(json.dumps(child(client, Path(src), bucket, prefix, endpoint)))
        return 0
    os.environ.update(KEYS)
    import boto3

    from benchmarks.bench_destinations import make_checkpoint

    names = [n for n in args.only.split(",") if n]
    for name in names:
        if name not in CLIENTS:
            parser.error(f"--only: no client {name!r} (one of {', '.join(CLIENTS)})")
        try:
            __import__(CLIENTS[name][0][0])
        except ImportError:
            parser.error(f"{name} needs {CLIENTS[name][0][0]}, not installed in {sys.executable}")
    server = None
    if args.endpoint is None:
        from tests.s3server import MotoServer

        server = MotoServer()
        args.endpoint = server.url
    os.environ["AWS_ENDPOINT_URL"] = args.endpoint
    s3 = boto3.client("s3")
    bucket = f"bench-{os.getpid()}"
    s3.create_bucket(Bucket=bucket)
    load_before = os.getloadavg()
    runs: dict[tuple[str, str], list[dict[str, float]]] = {}
    kept: dict[tuple[str, str], tuple[str, int]] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-s3-", dir=args.workdir) as tmp:
            sources = {"many": make_checkpoint(Path(tmp) / "many", 200, 60)} if "many" in args.cases else {}
            if "big" in args.cases:
                sources["big"] = big_file(Path(tmp), args.big_mb)
            for case, src in sources.items():
                for round_no in range(args.rounds):  # the clients take turns, so a change of load hits them all
                    for name in names:
                        prefix = f"{name}/{case}/{round_no}/"
                        out = subprocess.run([sys.executable, __file__, "--child", name, str(src), bucket, prefix,
                                              args.endpoint], capture_output=True, text=True, check=False,
                                             timeout=3600)
                        if out.returncode != 0:
                            raise SystemExit(f"{name} {case}: {out.stderr[-2000:]}")
                        figures = json.loads(out.stdout.strip().splitlines()[-1])
                        kept[case, name] = stored(s3, bucket, prefix, figures.pop("base"), src)
                        runs.setdefault((case, name), []).append(figures)
                        print(f"{name} {case} round {round_no + 1}: {figures}", file=sys.stderr, flush=True)
    finally:
        if server is not None:
            server.stop()
    load_after = os.getloadavg()
    print(f"load average (1/5/15 min) {'/'.join(f'{x:.1f}' for x in load_before)} before, "
          f"{'/'.join(f'{x:.1f}' for x in load_after)} after; {os.cpu_count()} cores; medians of {args.rounds}")
    print()
    print("| case | client | wall s (min-max) | MB/s | CPU s | peak RSS MB (after import) | import s | "
          "the store keeps |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for (case, name), each in runs.items():
        kinds, size = kept[case, name]

        def med(key: str, each: list[dict[str, float]] = each) -> float:
            return statistics.median(r[key] for r in each)

        walls = [r["wall_s"] for r in each]
        print(f"| {case} | {name} | {med('wall_s'):.2f} ({min(walls):.1f}-{max(walls):.1f}) | "
              f"{size / 1e6 / med('wall_s'):.0f} | {med('cpu_s'):.2f} | "
              f"{med('rss_peak_mb'):.0f} ({med('rss_import_mb'):.0f}) | {med('import_s'):.2f} | {kinds} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
