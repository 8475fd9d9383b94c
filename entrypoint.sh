#!/bin/sh
# Container entrypoint: the guard becomes PID 1 (it handles SIGTERM and reaps orphans), the job its child.
exec python -m guard "$@"
