"""Prints its own command line (as scripts that log their config do) and exits."""

import sys

print("args:", " ".join(sys.argv[1:]), flush=True)
print("config:", {a.lstrip("-").split("=")[0]: a.split("=", 1)[-1] for a in sys.argv[1:] if "=" in a}, flush=True)
