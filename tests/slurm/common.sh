# Sourced by tests/slurm/up.sh and up2.sh (which define `say`, `fail` and $STATE): the slurm.conf settings both
# clusters share (`common_conf`), the packages when missing, then munge with a key, its folders owned by munge, the
# daemon running as munge. munged is shared by every cluster on the machine: it is started only when it does not
# answer, and then recorded in $STATE, so that only the script that started it stops it.
common_conf() {
    cat <<'CONF'
AuthType=auth/munge
AuthInfo=cred_expire=30
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SlurmUser=root
SlurmdUser=root
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=5,bf_interval=5
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
JobRequeue=1
MinJobAge=300
CONF
}

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null \
        || ! command -v sbatch >/dev/null; then
    command -v apt-get >/dev/null || fail "no apt-get: install slurm-wlm and munge by hand"
    say "installing slurm-wlm munge"
    DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null || fail "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null \
        || fail "apt-get install slurm-wlm munge failed"
fi

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
