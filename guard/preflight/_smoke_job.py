"""The launch smoke's rank script: run by the job's launcher (torchrun, accelerate launch), one copy per rank.

Each rank initialises the process group (NCCL when CUDA is available, else gloo), all-reduces a one-hot tensor of
the world's size (every rank present exactly once gives all ones) and compares the world size with the one the
launcher's arguments promise. It writes its progress to ``RESULT_DIR/rank-<RANK>.json`` (``stage``: ``started``,
``init``, ``all_reduce``, ``done`` or ``error``) so that the guard can say what did not form when it has to kill
the smoke. Standard library and torch only; never imports the guard.

Source: torchrun gives each worker ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` (torch.distributed.elastic).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--result-dir", required=True)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--expect-world", type=int, default=0)
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    note_path = Path(args.result_dir) / f"rank-{rank}.json"
    facts: dict[str, object] = {"rank": rank, "local_rank": local_rank, "host": socket.gethostname(),
                                "world_size": int(os.environ.get("WORLD_SIZE", "0") or 0)}

    def note(stage: str, **more: object) -> None:
        facts.update(more, stage=stage)
        tmp = note_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(facts), encoding="utf-8")
        os.replace(tmp, note_path)

    note("started")
    try:
        import torch
        import torch.distributed as dist

        backend = "nccl" if torch.cuda.is_available() else "gloo"
        device = torch.device("cpu")
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
            device = torch.device("cuda", local_rank)
        note("init", backend=backend)
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=max(1.0, args.timeout_s)))
        world, got_rank = dist.get_world_size(), dist.get_rank()
        note("all_reduce", world_size=world)
        ones = torch.zeros(world, device=device)
        ones[got_rank] = 1.0
        dist.all_reduce(ones)
        counts = [int(v) for v in ones.cpu().tolist()]
        dist.destroy_process_group()
        missing = [r for r, c in enumerate(counts) if c == 0]
        doubled = [r for r, c in enumerate(counts) if c > 1]
        if missing or doubled:
            note("error", error=f"all_reduce: ranks missing {missing}, ranks twice {doubled}")
            return 1
        if args.expect_world and world != args.expect_world:
            note("error", error=f"world size {world}, the launcher's arguments promise {args.expect_world}")
            return 1
        note("done")
        return 0
    except Exception as exc:  # noqa: BLE001 - reported to the guard, which names it
        note("error", error=f"{type(exc).__name__}: {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
