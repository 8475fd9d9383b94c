"""Imports torch, as a training script does first, then prints one line (flushed) and exits, for ``bench_run.py``'s
start-up of a guarded job with preflight on (the import check of torch included).

Run: ``python benchmarks/jobs/torch_first_line.py``
"""

import torch

print("ready", torch.__version__, flush=True)
