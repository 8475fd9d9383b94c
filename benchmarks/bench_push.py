"""Cost of a verified push: ``Securer.push_checkpoint`` (upload + verify) against a bare ``HfApi.upload_folder``.

Run from the repository root: ``python benchmarks/bench_push.py [--rounds 3] [--size-mb 200]``.

Starts the local Hub test server (``tests/hubserver.py``) in this process, writes a checkpoint folder of random bytes
(one ``model.safetensors`` of 3/4 of the size, an optimizer, a few small files), then runs, alternating, N rounds of
(a) ``HfApi.upload_folder`` into a fresh repo created beforehand (creation not timed) and (b)
``Securer.push_checkpoint`` into a fresh repo it creates itself (creation, upload and verification timed).
Prints a Markdown table of the medians and the ratio b/a (target: at most 1.15).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from tests.hubserver import TOKENS, HubServer, client_env  # noqa: E402


def make_checkpoint(root: Path, size_mb: int) -> Path:
    folder = root / "checkpoint-100"
    folder.mkdir(parents=True)
    mb = 1_000_000
    weights_mb = size_mb * 3 // 4
    sizes = {"model.safetensors": weights_mb * mb, "optimizer.pt": (size_mb - weights_mb - 2) * mb,
             "rng_state.pth": 1 * mb, "scheduler.pt": 1 * mb - 4096}
    for name, size in sizes.items():
        with open(folder / name, "wb") as out:
            for offset in range(0, size, 16 * mb):
                out.write(os.urandom(min(16 * mb, size - offset)))
    (folder / "config.json").write_text('{"model_type": "gpt2", "n_layer": 12}')
    (folder / "trainer_state.json").write_text('{"global_step": 100, "log_history": []}' + " " * 3000)
    return folder


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each variant (default 3)")
    parser.add_argument("--size-mb", type=int, default=200, help="checkpoint size in MB of 10^6 bytes (default 200)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds of each variant first (default 1)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-push-") as tmp, HubServer() as hub:
        # Xet off (plain LFS): every round pushes the same checkpoint, and hf_xet's chunk cache would send nothing
        # after the first round (a 40 MB round took 0.25 s with it); bench_destinations.py has the Xet row, with a
        # new checkpoint each round.
        os.environ.update({**client_env(hub.url, xet=False), "HF_HOME": str(Path(tmp) / "hf")})
        from huggingface_hub import HfApi  # after HF_ENDPOINT is set

        from guard.secure.hubhttp import install_request_bounds
        from guard.secure.securer import Securer

        # Both variants share the process's HTTP client: install the guard's bounded one (it also turns progress
        # bars off) before the first round, so (a) and (b) differ only by what Securer does on top of the upload.
        install_request_bounds()
        api = HfApi(endpoint=hub.url, token=TOKENS["write"])
        folder = make_checkpoint(Path(tmp), args.size_mb)
        file_sizes = {p.name: p.stat().st_size for p in folder.iterdir()}
        size_bytes = sum(file_sizes.values())
        bare_s: list[float] = []
        secured_s: list[float] = []
        for round_no in range(-args.warmup, args.rounds):  # negative rounds: warm-up, not counted
            repo_a = f"alice/bench-bare-{round_no + args.warmup}"
            api.create_repo(repo_a, private=True)
            start = time.perf_counter()
            api.upload_folder(repo_id=repo_a, folder_path=folder, path_in_repo="last-checkpoint")
            elapsed_a = time.perf_counter() - start
            api.delete_repo(repo_a)

            repo_b = f"alice/bench-secured-{round_no + args.warmup}"
            start = time.perf_counter()
            result = Securer(repo_b, api=api).push_checkpoint(folder, step=100, deadline=time.monotonic() + 600)
            elapsed_b = time.perf_counter() - start
            assert result.attempts == 1 and result.size_bytes == size_bytes
            api.delete_repo(repo_b)
            label = "warm-up" if round_no < 0 else f"round {round_no + 1}"
            print(f"{label}: bare {elapsed_a:.3f}s, secured {elapsed_b:.3f}s", file=sys.stderr)
            if round_no >= 0:
                bare_s.append(elapsed_a)
                secured_s.append(elapsed_b)

    bare, secured = statistics.median(bare_s), statistics.median(secured_s)
    mb = size_bytes / 1e6
    print(f"checkpoint: {mb:.0f} MB in {len(file_sizes)} files (largest {max(file_sizes.values()) / 1e6:.0f} MB), "
          f"{args.rounds} rounds each, alternating, after {args.warmup} warm-up round(s)")
    print()
    print("| variant | median s | min s | max s | MB/s (median) |")
    print("|---|---:|---:|---:|---:|")
    variants = (("(a) HfApi.upload_folder", bare_s), ("(b) Securer.push_checkpoint (upload + verify)", secured_s))
    for name, runs in variants:
        median = statistics.median(runs)
        print(f"| {name} | {median:.3f} | {min(runs):.3f} | {max(runs):.3f} | {mb / median:.0f} |")
    print()
    ratio = secured / bare
    print(f"ratio b/a = {ratio:.3f} (target <= 1.15: {'met' if ratio <= 1.15 else 'NOT met'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
