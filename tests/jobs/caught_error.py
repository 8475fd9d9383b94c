"""A job that catches an exception itself (a missing optional file), prints its traceback, and succeeds."""

import traceback

try:
    with open("/nonexistent/optional-config.json") as handle:
        handle.read()
except OSError:
    traceback.print_exc()
    print("no optional config, using defaults", flush=True)
print("done", flush=True)
