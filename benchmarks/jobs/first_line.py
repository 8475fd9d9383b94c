"""Prints one line at once (flushed) and exits, for ``bench_run.py``'s time to the first output line.

Run: ``python benchmarks/jobs/first_line.py``
"""

print("ready", flush=True)
