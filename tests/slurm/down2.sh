#!/usr/bin/env bash
# Stop what tests/slurm/up2.sh started (recorded in $DIR/started), newest first; nothing else (munged only when
# up2.sh started it: another cluster may use it).
set -uo pipefail
DIR=${JOBGUARD_SLURM2_DIR:-/run/jobguard-slurm2}
STATE=$DIR/started
[ -s "$STATE" ] || exit 0
for name in $(tac "$STATE"); do
    case "$name" in
        slurmd:*) pid=$(cat "$DIR/slurmd.${name#slurmd:}.pid" 2>/dev/null) ;;
        slurmctld) pid=$(cat "$DIR/slurmctld.pid" 2>/dev/null) ;;
        munged) pid=$(cat /run/munge/munged.pid 2>/dev/null) ;;
        *) continue ;;
    esac
    if [ -n "${pid:-}" ] && kill "$pid" 2>/dev/null; then echo "[slurm2-down] stopped $name ($pid)"; fi
done
: > "$STATE"
