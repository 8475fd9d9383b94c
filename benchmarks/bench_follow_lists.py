"""How often the nodes list an S3 destination while they follow node 0's parts (issue 34; ``guard.secure.follow``).

Run from the repository root: ``python benchmarks/bench_follow_lists.py [--seconds 180] [--save-every 1200]``.

Two torchrun nodes on 127.0.0.1 (``tests/jobs/dcp_loop.py``, one rank each, a step every 0.05 s, a
``torch.distributed.checkpoint`` save every ``--save-every`` steps), each in its own folder under its own guard,
secure to one bucket of a local S3 server (moto, ``tests/s3server.py``), each node through a counting proxy of its
own (``FaultProxy`` with no fault). The guards' deadline is far (``--seconds`` + 120 s), so the window measured is
training with background securing only. From 30 s after the start to ``--seconds``, it counts each node's LIST
requests (``GET ?list-type=2``) and prints them per hour, with the saves the nodes made, node 1's secured steps
and the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "tests"))

from tests.multinode import Nodes  # noqa: E402
from tests.s3server import FaultProxy, MotoServer  # noqa: E402
from tests.s3server import env as s3_env  # noqa: E402

WARM_S = 30.0


def lists(proxy: FaultProxy) -> int:
    return sum(1 for method, path, _ in list(proxy.requests) if method == "GET" and "list-type=2" in path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=180.0, help="the run's length before the guards are ended")
    parser.add_argument("--save-every", type=int, default=1200, help="steps between saves (0.05 s a step)")
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as tmp, MotoServer(Path(tmp)) as moto:
        bucket = moto.bucket()
        proxies = [FaultProxy(moto.url) for _ in range(2)]
        try:
            nodes = Nodes(Path(tmp), 2, REPO_ROOT / "tests" / "jobs" / "dcp_loop.py", env=s3_env(moto.url),
                          guard_args=["--no-preflight", "--grace", "8s", "--sanity-steps", "2", "--output-dir",
                                      "{out}", "--push-to", f"s3://{bucket}/run", "--timeout",
                                      f"{int(args.seconds + 120)}s"],
                          job_args=["{out}", "--every", str(args.save_every), "--step-s", "0.05"],
                          node_env={k: {"AWS_ENDPOINT_URL": proxy.url} for k, proxy in enumerate(proxies)})
            started = time.monotonic()
            with nodes:
                time.sleep(WARM_S)
                first = [lists(proxy) for proxy in proxies]
                time.sleep(max(0.0, args.seconds - WARM_S))
                last = [lists(proxy) for proxy in proxies]
                window_s = time.monotonic() - started - WARM_S
                saves = [len(list(nodes.out(k).glob("step_*"))) for k in range(2)]
                secured = nodes.stderr(1).count("secured and verified")
        finally:
            for proxy in proxies:
                proxy.close()
    for node in range(2):
        count = last[node] - first[node]
        print(f"node {node}: {count} LISTs in {window_s:.0f}s = {count * 3600 / window_s:.0f} per hour "
              f"({saves[node]} saves in the run)")
    print(f"node 1 secured {secured} parts; load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
