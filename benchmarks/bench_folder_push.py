"""Background pushes to a folder destination: unchanged files linked from the previous copy against copied again.

Run from the repository root: ``python benchmarks/bench_folder_push.py [--rounds 5] [--size-mb 200] [--dest DIR]``.

Writes a checkpoint folder of random bytes (``model.safetensors`` 3/4 of the size, ``optimizer.pt`` the rest but
2 MB, a 1 MB ``rng_state.pth``, a small ``scheduler.pt``, ``config.json``, ``trainer_state.json``), pushes it once to
a folder destination (``Securer.push_checkpoint``), then N rounds in which only ``rng_state.pth`` (1 MB) and
``trainer_state.json`` change before the next push, as between two saves of a job whose weights are frozen in part.
The same rounds run twice: with the previous copy's unchanged files hard-linked (the shipped code) and with every
file copied (the code before, by disabling the link). Prints a Markdown table of the median push time and the bytes
the push process wrote (``wchar`` of ``/proc/self/io``, Linux: bytes passed to ``write(2)``), and what
``Securer.last_copy`` says was copied.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from guard.secure.dest import folder as guard_folder  # noqa: E402
from guard.secure.securer import Securer  # noqa: E402

MB = 1_000_000


def write_random(path: Path, size: int) -> None:
    with open(path, "wb") as out:
        for offset in range(0, size, 16 * MB):
            out.write(os.urandom(min(16 * MB, size - offset)))


def make_checkpoint(root: Path, size_mb: int) -> Path:
    folder = root / "checkpoint-100"
    folder.mkdir(parents=True)
    weights_mb = size_mb * 3 // 4
    write_random(folder / "model.safetensors", weights_mb * MB)
    write_random(folder / "optimizer.pt", (size_mb - weights_mb - 2) * MB)
    write_random(folder / "rng_state.pth", 1 * MB)
    write_random(folder / "scheduler.pt", 1 * MB - 4096)
    (folder / "config.json").write_text('{"model_type": "gpt2", "n_layer": 12}')
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 100}))
    return folder


def wchar() -> int:
    with open("/proc/self/io") as io:
        for line in io:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    return 0


def run(rounds: int, ckpt: Path, dest: Path, reuse: bool) -> dict[str, Any]:
    securer = Securer(str(dest))
    original: Callable[..., Any] = guard_folder._reuse_unchanged
    if not reuse:
        guard_folder._reuse_unchanged = lambda *args, **kwargs: None
    try:
        securer.push_checkpoint(ckpt, step=0, deadline=time.monotonic() + 600)  # the first push copies everything
        times, written, copied = [], [], []
        for step in range(1, rounds + 1):
            write_random(ckpt / "rng_state.pth", 1 * MB)
            (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 100 + step}))
            before_w, start = wchar(), time.perf_counter()
            securer.push_checkpoint(ckpt, step=step, deadline=time.monotonic() + 600)
            times.append(time.perf_counter() - start)
            written.append(wchar() - before_w)
            assert securer.last_copy is not None
            copied.append(securer.last_copy.copied_bytes)
    finally:
        guard_folder._reuse_unchanged = original
    return {"time_s": statistics.median(times), "written": statistics.median(written),
            "copied": statistics.median(copied)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--size-mb", type=int, default=200)
    parser.add_argument("--dest", help="a folder on the disk to measure (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-folder-push-", dir=args.dest) as tmp:
        root = Path(tmp)
        ckpt = make_checkpoint(root / "out", args.size_mb)
        before = run(args.rounds, ckpt, root / "dest-copy", reuse=False)
        after = run(args.rounds, ckpt, root / "dest-link", reuse=True)
    print(f"{args.size_mb} MB checkpoint, 1 MB file (and trainer_state.json) changed between pushes, median of "
          f"{args.rounds} pushes after the first\n")
    print("| push | time | bytes written (wchar) | copied (last_copy) |")
    print("|---|---|---|---|")
    for name, row in (("every file copied (before)", before), ("unchanged files linked (after)", after)):
        print(f"| {name} | {row['time_s']:.2f} s | {row['written'] / MB:.1f} MB | {row['copied'] / MB:.1f} MB |")
    print(f"\nratio after/before: time {after['time_s'] / before['time_s']:.2f}, bytes written "
          f"{after['written'] / max(before['written'], 1):.3f}")


if __name__ == "__main__":
    main()
