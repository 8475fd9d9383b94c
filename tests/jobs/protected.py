"""A script that puts itself under the guard with guard.protect(), then fails with a NaN at step 2."""

import guard

guard.protect("--sanity-steps", "3")

import sys  # noqa: E402

for step, loss in enumerate([1.0, float("nan"), 0.5], start=1):
    guard.report(step=step, loss=loss)
    print(f"step {step} argv={sys.argv[1:]}", flush=True)
