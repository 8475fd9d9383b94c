#!/usr/bin/env bash
# Stop the Slurm daemons tests/slurm/up.sh started (recorded in its state file), newest first; nothing else.
set -uo pipefail
STATE=${JOBGUARD_SLURM_STATE:-/run/jobguard-slurm/started}
[ -s "$STATE" ] || exit 0
for name in $(tac "$STATE"); do
    case "$name" in
        slurmd) pid=$(cat /run/slurmd.pid 2>/dev/null) ;;
        slurmctld) pid=$(cat /run/slurmctld.pid 2>/dev/null) ;;
        munged) pid=$(cat /run/munge/munged.pid 2>/dev/null) ;;
        *) continue ;;
    esac
    if [ -n "${pid:-}" ] && kill "$pid" 2>/dev/null; then echo "[slurm-down] stopped $name ($pid)"; fi
done
: > "$STATE"
