# /// script
# dependencies = ["tinydep-jobguard==1.0"]
# ///
"""Needs a package that is not installed here (the tests build its wheel): uv installs it, pip users don't."""

import sys

import tinydep_jobguard

import guard

print(f"tinydep {tinydep_jobguard.VALUE} python={sys.executable}", flush=True)
for step in range(1, 8):
    guard.report(step=step, loss=1.0 / step)
print("done", flush=True)
