"""What a save's checks cost the job (issue 33, items 1 and 2), through the shipped code: ``torch.save`` of a state
dict alone against the weights witness the guard's save hook adds (``guard.inside.agent._torch.first_non_finite``:
one ``aminmax`` per floating tensor) and the read point (one read of the pending loss window: here a
window of --window one-element loss tensors, summed and read once, as the agent's flush does).

    python benchmarks/bench_save_checks.py [--params-m 50] [--tensors 200] [--rounds 5] [--window 100]

Prints a Markdown table of medians (seconds) over --rounds; the save goes to a temporary folder on this disk."""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from guard.inside.agent._torch import first_non_finite


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params-m", type=float, default=50.0, help="parameters, millions (float32)")
    parser.add_argument("--tensors", type=int, default=200, help="tensors the parameters are split into")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--window", type=int, default=100, help="losses pending in the check window")
    args = parser.parse_args()
    per = int(args.params_m * 1e6 / args.tensors)
    state = {f"layer{i}.weight": torch.randn(per) for i in range(args.tensors)}
    losses = [torch.rand(()) for _ in range(args.window)]
    saves, witness, reads = [], [], []
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "ckpt.pt")
        for _ in range(args.rounds):
            started = time.perf_counter()
            torch.save(state, path)
            saves.append(time.perf_counter() - started)
            started = time.perf_counter()
            assert first_non_finite(torch, state) is None
            witness.append(time.perf_counter() - started)
            started = time.perf_counter()
            float(torch.stack(losses).sum().item())
            reads.append(time.perf_counter() - started)
    save_s, witness_s, read_s = (statistics.median(v) for v in (saves, witness, reads))
    size_mb = sum(t.numel() * t.element_size() for t in state.values()) / 1e6
    print("| state dict | torch.save (s) | weights witness (s) | read point (s) | checks / save |")
    print("|---|---|---|---|---|")
    print(f"| {size_mb:.0f} MB, {args.tensors} tensors | {save_s:.3f} | {witness_s:.4f} | {read_s:.5f} | "
          f"{(witness_s + read_s) / save_s:.1%} |")


if __name__ == "__main__":
    main()
