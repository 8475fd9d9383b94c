#!/usr/bin/env bash
# Bring up a one-node Slurm cluster on this machine for the tests marked `slurm` (Debian's slurm-wlm and munge).
#
# Idempotent: packages, the munge key and slurm.conf are made only when missing (a slurm.conf this script did not
# write is left as it is), and a daemon is started only when it is not already answering. What this script starts
# is recorded in $STATE (one daemon name a line) so that tests/slurm/down.sh stops exactly that and nothing else.
# Needs root and apt; otherwise it says why and exits 1 (the slurm tests then skip with the reason, and fail
# under CI=true).
#
# slurm.conf: the settings of shared/reference/slurm-local.md (KillWait=30 between the limit's SIGTERM and SIGKILL,
# MinJobAge=300 so `scontrol show job` still shows a finished job, JobRequeue=1) plus AuthInfo=cred_expire=30: a
# requeued job waits cred_expire seconds before it may start again (slurm.conf(5), default 120), and
# SchedulerParameters=sched_interval=5,bf_interval=5 (defaults 60 and 30) start it soon after: the requeue test
# stays short.
set -euo pipefail

STATE=${JOBGUARD_SLURM_STATE:-/run/jobguard-slurm/started}
CONF=/etc/slurm/slurm.conf
MARK="# written by jobguard tests/slurm/up.sh"

say() { echo "[slurm-up] $*"; }
fail() { say "$*"; exit 1; }

[ "$(id -u)" = 0 ] || fail "not root: cannot install or start Slurm"
mkdir -p "$(dirname "$STATE")"
touch "$STATE"

# the packages and munge (shared by every cluster here: started only when it does not answer)
. "$(dirname "$0")/common.sh"

# slurm.conf for this host, unless someone else's is there.
HOST=$(hostname)
if [ ! -f "$CONF" ] || head -n1 "$CONF" | grep -qF "$MARK"; then
    CPUS=$(nproc)
    MEM_MB=$(free -m | awk '/^Mem:/ {print int($2 * 0.9)}')
    mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
    cat > "$CONF.new" <<CONF
$MARK
ClusterName=jobguard
SlurmctldHost=$HOST
$(common_conf)
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
KillWait=30
NodeName=$HOST CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
    if ! cmp -s "$CONF.new" "$CONF"; then
        mv "$CONF.new" "$CONF"
        say "wrote $CONF"
        # a controller already running on an older version of our file re-reads it
        scontrol ping 2>/dev/null | grep -q UP && scontrol reconfigure || true
    else
        rm -f "$CONF.new"
    fi
else
    say "$CONF was not written by this script: using it as it is"
fi

if ! scontrol ping 2>/dev/null | grep -q "is UP"; then
    say "starting slurmctld"
    slurmctld
    echo slurmctld >> "$STATE"
    for _ in $(seq 100); do scontrol ping 2>/dev/null | grep -q "is UP" && break; sleep 0.2; done
fi
scontrol ping | grep -q "is UP" || fail "slurmctld does not answer (see /var/log/slurm/slurmctld.log)"
if ! { [ -s /run/slurmd.pid ] && kill -0 "$(cat /run/slurmd.pid)" 2>/dev/null; }; then  # its own (up2.sh's differ)
    say "starting slurmd"
    slurmd
    echo slurmd >> "$STATE"
fi

NODE=$(sinfo -h -N -o '%N' | head -n1)
[ -n "$NODE" ] || fail "sinfo shows no node"
for i in $(seq 60); do
    STATE_NOW=$(sinfo -h -N -n "$NODE" -o '%T' | head -n1)
    case "$STATE_NOW" in
        idle*|mixed*|allocated*) say "node $NODE is $STATE_NOW ($(sinfo -V))"; exit 0 ;;
        down*|drain*|unk*) [ "$i" -gt 5 ] && scontrol update nodename="$NODE" state=resume 2>/dev/null || true ;;
    esac
    sleep 0.5
done
fail "node $NODE is ${STATE_NOW:-unknown}, not idle (sinfo -R; /var/log/slurm/slurmd.log)"
