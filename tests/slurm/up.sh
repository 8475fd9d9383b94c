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

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null \
        || ! command -v sbatch >/dev/null; then
    command -v apt-get >/dev/null || fail "no apt-get: install slurm-wlm and munge by hand"
    say "installing slurm-wlm munge"
    DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null || fail "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null \
        || fail "apt-get install slurm-wlm munge failed"
fi

# munge: a key, its folders owned by munge, the daemon running as munge.
mkdir -p /etc/munge /var/lib/munge /var/log/munge /run/munge
if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown munge:munge /etc/munge /etc/munge/munge.key /var/lib/munge /var/log/munge /run/munge
chmod 0400 /etc/munge/munge.key
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    say "starting munged"
    su -s /bin/sh munge -c /usr/sbin/munged
    echo munged >> "$STATE"
    for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
fi
munge -n | unmunge | grep -q "STATUS: *Success" || fail "munge does not work (munge -n | unmunge)"

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
AuthType=auth/munge
AuthInfo=cred_expire=30
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=5,bf_interval=5
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
JobRequeue=1
KillWait=30
MinJobAge=300
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
if ! pgrep -x slurmd >/dev/null; then
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
