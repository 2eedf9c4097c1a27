#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, from Debian's slurm-wlm: munged, slurmctld and
# slurmd, all as root, with no systemd and no cgroups (containers and small VMs have
# neither to spare). Idempotent: run it again and it starts only what is not running.
#
#   sudo tests/scripts/slurm_single_node.sh          # then: srun -n 4 hostname
#   SLURM_CPUS=8 sudo tests/scripts/slurm_single_node.sh
#
# The node declares SLURM_CPUS CPUs (default 4, at least the machine's) whatever the
# machine has, and the partition shares them (OverSubscribe=FORCE), so that `srun -n 4`
# fits on a 2-core machine; ranks then take turns on the cores, which is what the tests
# want. Not a production set-up: no accounting, no authentication beyond munge's key.
set -euo pipefail

if [[ $(id -u) -ne 0 ]]; then
    echo "$0: run as root (it installs packages and starts daemons)" >&2
    exit 1
fi

host=$(hostname -s)
cpus=${SLURM_CPUS:-4}
if (( cpus < $(nproc) )); then cpus=$(nproc); fi
conf=/etc/slurm/slurm.conf

# 1. Packages (only when missing: apt is slow and needs the network).
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
        || ! command -v munged >/dev/null || ! command -v srun >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
fi

# 2. munge: a key, its folders, the daemon (as the munge user, which it insists on).
install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
install -d -o munge -g munge -m 0755 /run/munge
if [[ ! -s /etc/munge/munge.key ]]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown munge:munge /etc/munge/munge.key
chmod 0400 /etc/munge/munge.key
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    runuser -u munge -- /usr/sbin/munged
    for _ in $(seq 50); do
        munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break
        sleep 0.1
    done
fi

# 3. The configuration (rewritten only when it changes; daemons then reconfigure).
install -d -m 0755 /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
new=$(cat <<CONF
# Written by tests/scripts/slurm_single_node.sh: a one-node cluster for tests.
ClusterName=collectives
SlurmctldHost=$host
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# The node's CPUs come from this file, not from the machine (see the header).
SlurmdParameters=config_overrides
ReturnToService=2
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
SlurmctldTimeout=30
SlurmdTimeout=60
InactiveLimit=0
KillWait=5
NodeName=$host CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
)
changed=0
if [[ ! -f $conf ]] || [[ "$(cat "$conf")" != "$new" ]]; then
    printf '%s\n' "$new" > "$conf"
    changed=1
fi

# 4. The daemons.
alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }
if ! alive /run/slurmctld.pid; then
    /usr/sbin/slurmctld
elif (( changed )); then
    scontrol reconfigure
fi
for _ in $(seq 100); do scontrol ping >/dev/null 2>&1 && break; sleep 0.2; done
if ! alive /run/slurmd.pid; then
    /usr/sbin/slurmd
fi

# 5. Wait for the node to take jobs; a node left down or drained by an earlier run is resumed.
for _ in $(seq 150); do
    state=$(sinfo -h -n "$host" -o %T 2>/dev/null | head -1)
    case $state in
        idle*|mixed*|allocated*) echo "slurm: node $host is $state ($cpus CPUs)"; exit 0 ;;
        down*|drain*|fail*) scontrol update NodeName="$host" State=RESUME 2>/dev/null || true ;;
    esac
    sleep 0.2
done
echo "$0: node $host did not become ready (state: ${state:-unknown}); see" \
     "/var/log/slurm/slurmctld.log and /var/log/slurm/slurmd.log" >&2
exit 1
