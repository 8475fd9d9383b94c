"""A verified push of the same checkpoint to each destination: time and MB/s, one row per destination.

Run from the repository root: ``python benchmarks/bench_destinations.py [--rounds 3] [--size-mb 200] [--files 60]
[--only folder,hub-xet,hub-lfs,s3]``.

The checkpoint is ``--size-mb`` MB (10^6 bytes) of random bytes in ``--files`` files: four model shards of 3/16 of
the size each (real safetensors files: one ``F32`` tensor of random finite values each, so the push reads their
weights as it would a Trainer's, ``guard.secure.weights``), an optimizer state of the rest less 1 MB (random bytes
after a zero first byte), and small files (config, trainer state, RNG states) that make up the count, like a sharded
Trainer save. Random bytes do not compress and do not deduplicate, and each round writes a new checkpoint (not
timed), so no round gains from what an earlier one stored (hf_xet remembers the chunks it uploaded in its local cache
and would send nothing the second time). Before the pushes, the weights check alone (``weights.check_files`` on the
four shards, the page cache warm as a push finds it) is timed on its own checkpoint: the share of a push it is.

A destination is a function ``(workdir) -> context manager yielding push(checkpoint_dir, round_no) -> bytes``: the
push is the guard's verified push into a fresh place at that destination (upload or copy, then verification
against the local sizes and SHA-256s, then the record), timed by the caller. ``DESTINATIONS`` maps a row's name to
its function; a new destination adds one function and one entry. Rows:

- ``folder``: ``Securer(path).push_checkpoint`` into a new folder on the same disk.
- ``hub-xet``: ``Securer(repo).push_checkpoint`` to the local Hub test server (``tests/hubserver.py``) in this
  process, Xet on (the client's default): hf_xet chunks, hashes and uploads xorbs and a shard to the server's Xet
  storage (``tests/xetcas.py``), which rebuilds each file and checks its SHA-256 before the commit may name it.
- ``hub-lfs``: the same with ``HF_HUB_DISABLE_XET=1`` (plain LFS PUTs), for comparison.
- ``s3``: ``Securer("s3://BUCKET/round-N").push_checkpoint`` to a local S3 server (``moto_server``, a child
  process: ``tests/s3server.py``) through the standard AWS variables: every file put with its SHA-256 (in parts
  above 64 MiB), checked by ``HEAD``, the node's manifest, then the record by one conditional write.

The Hub server runs in this process, moto in a child, both on the same cores as the client: their work (reading
the bodies, rebuilding and hashing the files) is in the figures, as a real store's would be in the network time.
Prints the load average before and after, then a Markdown table of the medians.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from tests.hubserver import TOKENS, HubServer, client_constants, client_env  # noqa: E402

#: A destination's push: (checkpoint folder, round number) -> bytes pushed; it returns once verified and recorded.
Push = Callable[[Path, int], int]
DEADLINE_S = 1800.0


def make_checkpoint(root: Path, size_mb: int, files: int) -> Path:
    """A sharded Trainer-like save of ``size_mb`` MB of random bytes in ``files`` files (at least 8)."""
    folder = root / "checkpoint-100"
    folder.mkdir(parents=True)
    mb = 1_000_000
    shard_bytes = size_mb * mb * 3 // 16
    rng_files = max(files - 8, 1)  # besides: 4 shards, the optimizer, the scheduler, the config, the trainer state
    sizes = {f"model-{i + 1:05d}-of-00004.safetensors": shard_bytes for i in range(4)}
    sizes["optimizer.pt"] = size_mb * mb - 4 * shard_bytes - mb
    sizes.update({f"rng_state_{i}.pth": (mb - 4096) // rng_files for i in range(rng_files)})
    sizes["scheduler.pt"] = 1_064
    for name, size in sizes.items():
        if name.endswith(".safetensors"):
            _write_safetensors(folder / name, size)
            continue
        with open(folder / name, "wb") as out:
            out.write(b"\0")  # a first byte of no known format (0x80 would be checked as a pickle, and refused)
            for offset in range(1, size, 16 * mb):
                out.write(os.urandom(min(16 * mb, size - offset)))
    (folder / "config.json").write_text('{"model_type": "gpt2", "n_layer": 12}')
    (folder / "trainer_state.json").write_text('{"global_step": 100, "log_history": []}' + " " * 3000)
    return folder


#: Clears the second-highest bit of an F32's top byte: the exponent is never all ones, the value always finite.
_FINITE_TOP = bytes(value & 0xBF for value in range(256))


def _write_safetensors(path: Path, size: int) -> None:
    """A safetensors file of about ``size`` bytes: one ``F32`` tensor of random finite values."""
    import json

    count = (size - 8 - 128) // 4
    header = json.dumps({"weight": {"dtype": "F32", "shape": [count], "data_offsets": [0, count * 4]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as out:
        out.write(len(header).to_bytes(8, "little") + header)
        chunk = 16 << 20
        for offset in range(0, count * 4, chunk):
            data = bytearray(os.urandom(min(chunk, count * 4 - offset)))
            data[3::4] = data[3::4].translate(_FINITE_TOP)
            out.write(data)


def time_weights_check(workdir: Path, args: Any) -> list[tuple[float, int]]:
    """(seconds, bytes read) of ``weights.check_files`` on a checkpoint's safetensors shards, ``args.rounds`` times
    after one warm-up read."""
    from guard.secure.weights import check_files

    checkpoint = make_checkpoint(workdir / "src-weights", args.size_mb, args.files)
    names = sorted(p.name for p in checkpoint.glob("*.safetensors"))
    check_files(checkpoint, names)
    runs = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        checked = check_files(checkpoint, names)
        runs.append((time.perf_counter() - start, checked.size_bytes))
        assert checked.bad is None and checked.files == 4
    return runs


@contextlib.contextmanager
def folder_destination(workdir: Path) -> Iterator[Push]:
    from guard.secure.securer import Securer

    def push(checkpoint: Path, round_no: int) -> int:
        result = Securer(str(workdir / f"dest-{round_no}")).push_checkpoint(
            checkpoint, step=100, deadline=time.monotonic() + DEADLINE_S)
        return result.size_bytes

    yield push


def _hub_destination(workdir: Path, *, xet: bool) -> contextlib.AbstractContextManager[Push]:
    @contextlib.contextmanager
    def serve() -> Iterator[Push]:
        with HubServer() as hub, client_constants(xet=xet):
            os.environ.update({**client_env(hub.url, xet=xet), "HF_HOME": str(workdir / "hf")})
            from huggingface_hub import HfApi

            from guard.secure.hubhttp import install_request_bounds
            from guard.secure.securer import Securer

            install_request_bounds()  # the guard's bounded HTTP client (it turns progress bars off too)
            api = HfApi(endpoint=hub.url, token=TOKENS["write"])

            def push(checkpoint: Path, round_no: int) -> int:
                repo_id = f"alice/bench-{'xet' if xet else 'lfs'}-{round_no}"
                result = Securer(repo_id, api=api).push_checkpoint(checkpoint, step=100,
                                                                   deadline=time.monotonic() + DEADLINE_S)
                if xet:
                    assert any("/cas/v1/xorbs/" in r.path for r in hub.requests), "the push did not use Xet"
                hub.requests.clear()
                with hub._state.lock:  # keep the server's memory flat: the repo is not read again
                    hub._state.repos.pop(("model", repo_id), None)
                    hub._state.lfs_store.clear()
                hub.cas.xorbs.clear()
                return result.size_bytes

            yield push

    return serve()


def hub_xet_destination(workdir: Path) -> contextlib.AbstractContextManager[Push]:
    return _hub_destination(workdir, xet=True)


def hub_lfs_destination(workdir: Path) -> contextlib.AbstractContextManager[Push]:
    return _hub_destination(workdir, xet=False)


@contextlib.contextmanager
def s3_destination(workdir: Path) -> Iterator[Push]:
    from tests.s3server import MotoServer
    from tests.s3server import env as s3_env

    with MotoServer() as moto:
        os.environ.update(s3_env(moto.url))
        from guard.secure.securer import Securer

        bucket = moto.bucket()

        def push(checkpoint: Path, round_no: int) -> int:
            securer = Securer(f"s3://{bucket}/round-{round_no}", run_id="bench")
            result = securer.push_checkpoint(checkpoint, step=100, deadline=time.monotonic() + DEADLINE_S)
            client = moto.client()  # keep the server's memory flat: the round's objects are not read again
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
                for obj in page.get("Contents", []):
                    client.delete_object(Bucket=bucket, Key=obj["Key"])
            return result.size_bytes

        yield push


DESTINATIONS: dict[str, Callable[[Path], contextlib.AbstractContextManager[Push]]] = {
    "folder": folder_destination,
    "hub-xet": hub_xet_destination,
    "hub-lfs": hub_lfs_destination,
    "s3": s3_destination,
}


def measure(name: str, workdir: Path, args: Any) -> list[tuple[float, int]]:
    """(seconds, bytes) of each counted round of one destination, after the warm-up rounds."""
    runs: list[tuple[float, int]] = []
    with DESTINATIONS[name](workdir / name) as push:
        for round_no in range(-args.warmup, args.rounds):
            checkpoint = make_checkpoint(workdir / f"src-{name}-{round_no + args.warmup}", args.size_mb, args.files)
            start = time.perf_counter()
            size_bytes = push(checkpoint, round_no + args.warmup)
            elapsed = time.perf_counter() - start
            label = "warm-up" if round_no < 0 else f"round {round_no + 1}"
            print(f"{name} {label}: {elapsed:.3f}s ({size_bytes / 1e6 / elapsed:.0f} MB/s)", file=sys.stderr)
            if round_no >= 0:
                runs.append((elapsed, size_bytes))
            for path in sorted(checkpoint.parent.rglob("*"), reverse=True):  # the disk, not the page cache, is full
                path.unlink() if path.is_file() else path.rmdir()
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="counted rounds per destination (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds per destination first (default 1)")
    parser.add_argument("--size-mb", type=int, default=200, help="checkpoint size in MB of 10^6 bytes (default 200)")
    parser.add_argument("--files", type=int, default=60, help="files in the checkpoint (default 60)")
    parser.add_argument("--only", default=",".join(DESTINATIONS), help="destinations, comma-separated "
                        f"(default all: {','.join(DESTINATIONS)})")
    args = parser.parse_args()
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in DESTINATIONS]
    if unknown:
        parser.error(f"unknown destination(s) {unknown}; known: {sorted(DESTINATIONS)}")
    load_before = os.getloadavg()
    results: dict[str, list[tuple[float, int]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-dest-") as tmp:
        checks = time_weights_check(Path(tmp), args)
        for name in names:
            results[name] = measure(name, Path(tmp), args)
    load_after = os.getloadavg()
    size_bytes = next(iter(results.values()))[0][1] if results and next(iter(results.values())) else 0
    print(f"checkpoint: {size_bytes / 1e6:.1f} MB in {max(args.files, 9)} files (4 shards of "
          f"{args.size_mb * 3 / 16:.1f} MB), "
          f"{args.rounds} rounds per destination after {args.warmup} warm-up; load average (1/5/15 min) "
          f"{'/'.join(f'{x:.1f}' for x in load_before)} before, {'/'.join(f'{x:.1f}' for x in load_after)} after, "
          f"{os.cpu_count()} cores")
    check_s = statistics.median(t for t, _ in checks)
    print(f"weights check alone (part of every push): {checks[0][1] / 1e6:.1f} MB of safetensors in {check_s:.3f}s "
          f"median (min {min(t for t, _ in checks):.3f}, max {max(t for t, _ in checks):.3f}): "
          f"{checks[0][1] / 1e6 / check_s:.0f} MB/s")
    print()
    print("| destination | verified push, median s | min s | max s | MB/s (median) |")
    print("|---|---:|---:|---:|---:|")
    for name, runs in results.items():
        times = [t for t, _ in runs]
        median = statistics.median(times)
        print(f"| {name} | {median:.2f} | {min(times):.2f} | {max(times):.2f} | {runs[0][1] / 1e6 / median:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
