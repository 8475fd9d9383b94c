#!/usr/bin/env bash
# Run the guard's real preflight checks on this machine (NVML included) and print the table and a VERDICT line.
#
#   scripts/gpu-check.sh [--require-gpus N] [--gpu-type NAME] [--skip-check NAME=REASON]... [SCRIPT.py]
#
# Defaults: --require-gpus 1 (this is the check for a GPU machine). Exit code: 0 when no check fails, 3 when one
# does (the contract's `preflight` code), 2 on a usage error. Calls guard.preflight directly (the table on stdout,
# then the VERDICT line), so it works whether or not the CLI is wired; GPU_CHECK_VIA_CLI=1 runs
# `python -m guard preflight --require-gpus 1 ARGS` instead (the table in the [guard] log on stderr).
# GPU_CHECK_CUDA_GRAPHS=1 first runs the CUDA-graph NaN case (see below).
# The Python used is $PYTHON, else the repo's .venv, else python3.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
  if [[ -x "$repo/.venv/bin/python" ]]; then python="$repo/.venv/bin/python"; else python="python3"; fi
fi
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"

# GPU_CHECK_CUDA_GRAPHS=1: also run a torch.compile(mode="reduce-overhead") loop with a NaN at step 37 under the
# guard (CUDA-graph trees overwrite each step's loss tensor on the next replay): the VERDICT must be
# non_finite_loss at step 37, which shows the loss watch survived the overwritten tensors.
if [[ "${GPU_CHECK_CUDA_GRAPHS:-0}" == "1" ]]; then
  verdict="$("$python" -m guard --no-preflight "$repo/tests/jobs/compiled_nan.py" --nan-at 37 | tail -n 1)" || true
  echo "$verdict"
  [[ "$verdict" == *"reason=non_finite_loss"* && "$verdict" == *"step=37"* ]] || {
    echo "[guard] gpu-check: the CUDA-graph loop's NaN at step 37 was not caught" >&2; exit 1; }
fi

if [[ "${GPU_CHECK_VIA_CLI:-0}" == "1" ]]; then
  exec "$python" -m guard preflight --require-gpus 1 "$@"
fi

exec "$python" - "$@" <<'PY'
import argparse
import sys
import time
from pathlib import Path

started = time.monotonic()
from guard.run.config import parse_size  # noqa: E402
from guard.errors import UsageError  # noqa: E402
from guard.preflight import PreflightOptions, render_table, run_preflight  # noqa: E402
from guard.contract import RunResult, render_line  # noqa: E402

parser = argparse.ArgumentParser(prog="gpu-check.sh", description="the guard's preflight checks on this machine")
parser.add_argument("--require-gpus", type=int, default=1)
parser.add_argument("--gpu-type")
parser.add_argument("--min-free-disk", type=parse_size)
parser.add_argument("--output-dir", type=Path)
parser.add_argument("--skip-check", action="append", default=[], metavar="NAME=REASON")
parser.add_argument("script", nargs="?", type=Path)
args = parser.parse_args(sys.argv[1:])
skips = dict(item.split("=", 1) for item in args.skip_check if "=" in item)
try:
    report = run_preflight(PreflightOptions(
        script=args.script, require_gpus=args.require_gpus, gpu_type=args.gpu_type,
        min_free_disk_bytes=args.min_free_disk, output_dir=args.output_dir, skip_checks=skips))
except UsageError as exc:
    print(f"[guard] {exc.message}", file=sys.stderr)
    print(render_line(RunResult("FAIL", "usage", 2, time.monotonic() - started, hint=exc.hint)))
    sys.exit(2)
print(render_table(report))
print(f"[guard] preflight took {report.elapsed_s:.2f} s", file=sys.stderr)
failed = report.failed
if failed is None:
    result = RunResult("PASS", "ok", 0, time.monotonic() - started)
else:
    result = RunResult("FAIL", "preflight", 3, time.monotonic() - started, hint=failed.hint,
                       extra={"check": failed.name})
print(render_line(result))
sys.exit(result.exit_code)
PY
