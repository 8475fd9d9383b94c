"""Wall time of ``run_preflight``: without network checks (target < 1 s) and with Hub checks (target < 3 s).

Run from the repository root: ``python benchmarks/bench_preflight.py [--rounds 5]``.

Cases, each run ``--rounds`` times in this process (median, min, max; "first" is the first round, which pays the
lazy imports of ``pynvml`` and ``huggingface_hub``):

1. ``no network``: a small training script (TrainingArguments literals, a PEP 723 block, one light third-party
   import), an output folder, every local check (GPU through the real NVML or its absence, storage, python with
   its import child process, budget, trainer-config, distributed, tracking); no Hub destination, no Hub id.
2. ``hub``: the same plus ``--push-to hf://acme/bench-run`` (whoami) and four repo checks against the local Hub
   server (``tests/hubserver.py``), one of them missing (its "did you mean" lookup included).
3. ``torch import`` (for information, no target): the script imports torch and transformers; the import check's
   child process then dominates the total.

Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from tests.hubserver import TOKENS, HubServer, client_env  # noqa: E402

SCRIPT = '''
# /// script
# dependencies = ["packaging>=23"]
# ///
import packaging
from transformers import Trainer, TrainingArguments

args = TrainingArguments(output_dir="out", eval_strategy="no", save_strategy="steps", bf16=False, max_steps=50)
Trainer(model=model, args=args, train_dataset=train)
'''


def measure(fn: Callable[[], Any], rounds: int) -> tuple[list[float], Any]:
    times, result = [], None
    for _ in range(rounds):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return times, result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="runs of each case (default 5)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-preflight-") as tmp, HubServer() as hub:
        root = Path(tmp)
        os.environ.update({**client_env(hub.url), "HF_HOME": str(root / "hf")})
        os.environ.pop("HF_HUB_OFFLINE", None)
        from guard.preflight import PreflightOptions, run_preflight  # after HF_ENDPOINT is set

        light = root / "light" / "train.py"
        light.parent.mkdir()
        # The light script must not import transformers at top level for real: keep only the literals the
        # static analysis reads, and a light import for the child process.
        light.write_text(textwrap.dedent(SCRIPT).replace("from transformers import Trainer, TrainingArguments\n", ""))
        heavy = root / "heavy" / "train.py"
        heavy.parent.mkdir()
        heavy.write_text(textwrap.dedent(SCRIPT).replace("import packaging\n", "import torch\nimport transformers\n"))
        base_env = {**os.environ}
        hub_env = {**base_env, "HF_TOKEN": TOKENS["write"]}
        common = {"output_dir": root / "out", "timeout_s": 3600.0, "timeout_source": "--timeout"}

        cases = [
            ("no network", "< 1 s", lambda: run_preflight(PreflightOptions(script=light, **common), environ=base_env)),
            ("hub (whoami + 4 repos, 1 missing)", "< 3 s", lambda: run_preflight(PreflightOptions(
                script=light, push_to="hf://acme/bench-run", require_models=("acme/tiny-gpt2", "acme/tiny-gtp2"),
                require_datasets=("acme/tiny-text", "acme/wikitext-mini"), **common), environ=hub_env)),
            ("torch + transformers imports (info)", "-", lambda: run_preflight(
                PreflightOptions(script=heavy, **common), environ=base_env)),
        ]
        rows = []
        for name, target, fn in cases:
            times, report = measure(fn, args.rounds)
            statuses = {}
            for row in report.results:
                statuses[row.status] = statuses.get(row.status, 0) + 1
            rows.append((name, target, times, statuses, report.failed))

    print("| case | target | median (s) | min (s) | max (s) | first (s) | rows |")
    print("|---|---|---|---|---|---|---|")
    for name, target, times, statuses, _failed in rows:
        counts = ", ".join(f"{n} {s}" for s, n in sorted(statuses.items()))
        print(f"| {name} | {target} | {statistics.median(times):.3f} | {min(times):.3f} | {max(times):.3f} | "
              f"{times[0]:.3f} | {counts} |")
    print(f"\n{args.rounds} rounds each; 'first' is the first round (lazy imports); Python {sys.version.split()[0]}, "
          f"{os.cpu_count()} CPUs.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
