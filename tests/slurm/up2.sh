#!/usr/bin/env bash
# Bring up a two-node Slurm cluster on this machine for the tests marked `slurm2` (tests/test_slurm2_e2e.py), beside
# the one-node cluster of tests/slurm/up.sh: its own slurm.conf, state and ports (slurmctld 16817, the nodes n1 and
# n2 on 17001 and 17002), so neither disturbs the other. Debian 12's slurm-wlm runs several slurmd on one host
# (`slurmd -N NAME`; `%n` in the spool, pid and log paths is the node's name), and each node's slurmd runs in a
# mount namespace of its own where $DIR/scratch is that node's own folder ($DIR/local/n1, $DIR/local/n2): the job
# steps of each node see their own disk at one path, as node-local NVMe (shared/reference/multinode.md).
#
# Clients reach it with SLURM_CONF=$DIR/slurm.conf (printed last). munged is shared by every cluster here: it is
# started only when not running, and then recorded so that down2.sh stops it, and only then. What this script
# starts is recorded in $DIR/started. Needs root, apt (when slurm-wlm is missing) and unshare; otherwise it says why
# and exits 1 (the slurm2 tests then skip with the reason, and fail under CI=true).
set -euo pipefail

DIR=${JOBGUARD_SLURM2_DIR:-/run/jobguard-slurm2}
CONF=$DIR/slurm.conf
STATE=$DIR/started

say() { echo "[slurm2-up] $*"; }
fail() { say "$*"; exit 1; }

[ "$(id -u)" = 0 ] || fail "not root: cannot install or start Slurm"
command -v unshare >/dev/null || fail "no unshare (util-linux): cannot give each node its own disk"
mkdir -p "$DIR/state" "$DIR/spool" "$DIR/local/n1" "$DIR/local/n2" "$DIR/scratch" "$DIR/shared"
touch "$STATE"

# the packages and munge (shared by every cluster here: started only when it does not answer)
. "$(dirname "$0")/common.sh"

HOST=$(hostname)
cat > "$CONF" <<CONF
# written by jobguard tests/slurm/up2.sh: two nodes on one host, each slurmd in its own mount namespace
ClusterName=jobguard2
SlurmctldHost=$HOST
SlurmctldPort=16817
$(common_conf)
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.%n.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.%n.log
SlurmdParameters=config_overrides
KillWait=10
NodeName=n1 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=17001 CPUs=1 RealMemory=400 State=UNKNOWN
NodeName=n2 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=17002 CPUs=1 RealMemory=400 State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
export SLURM_CONF=$CONF

alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

if ! alive "$DIR/slurmctld.pid"; then
    say "starting slurmctld (port 16817)"
    slurmctld -f "$CONF"
    echo slurmctld >> "$STATE"
    for _ in $(seq 100); do scontrol ping 2>/dev/null | grep -q "is UP" && break; sleep 0.2; done
fi
scontrol ping | grep -q "is UP" || fail "slurmctld does not answer (see $DIR/slurmctld.log)"
for node in n1 n2; do
    if ! alive "$DIR/slurmd.$node.pid"; then
        say "starting slurmd -N $node in its own mount namespace ($DIR/scratch is $DIR/local/$node there)"
        unshare --mount --propagation private sh -c \
            "mount --bind '$DIR/local/$node' '$DIR/scratch' && exec slurmd -f '$CONF' -N $node"
        echo "slurmd:$node" >> "$STATE"
    fi
done

for i in $(seq 60); do
    states=$(sinfo -h -N -o '%N %T' | sort -u)
    if [ "$(echo "$states" | grep -cE ' (idle|mixed|allocated)')" -ge 2 ]; then
        say "nodes up: $(echo "$states" | tr '\n' ' ')($(sinfo -V)); clients: SLURM_CONF=$CONF"
        exit 0
    fi
    if [ "$i" -gt 5 ] && echo "$states" | grep -qE ' (down|drain|unk)'; then
        scontrol update nodename=n1,n2 state=resume 2>/dev/null || true
    fi
    sleep 0.5
done
fail "the nodes are not idle: $(sinfo -h -N -o '%N %T' | tr '\n' ' ') (sinfo -R; $DIR/slurmd.n1.log)"
