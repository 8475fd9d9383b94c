#!/bin/sh
# Container entrypoint: the guard becomes PID 1 (it handles SIGTERM and reaps orphans), the job its child.
# The console script, not `python -m guard`: the working folder (/workspace) holds the user's code, and a guard.py
# there would be imported in place of the guard (`python -m` puts the working folder first on sys.path).
exec jobguard "$@"
