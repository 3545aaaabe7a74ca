#!/bin/bash
# A one-node Slurm on this machine for `nox -s slurm`: munged + slurmctld + slurmd from Debian's
# slurm-wlm (apt-get install slurm-wlm), as root (munged and slurmd need it). Prints the
# SLURM_CONF to export; stop with: kill $(cat $DIR/*.pid)
set -euo pipefail
DIR=${1:-/tmp/shardforge-slurm}
[ "$(id -u)" = 0 ] || { echo "start_local_slurm.sh: needs root (munged, slurmd)" >&2; exit 1; }
command -v slurmctld >/dev/null || { echo "start_local_slurm.sh: apt-get install slurm-wlm first" >&2; exit 1; }
mkdir -p "$DIR"/{state,spool,log} /run/munge
HOST=$(hostname -s)
cat > "$DIR/slurm.conf" <<CONF
ClusterName=local
SlurmctldHost=$HOST
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldPort=16817
SlurmdPort=16818
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
NodeName=$HOST CPUs=$(nproc) State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
[ -f /etc/munge/munge.key ] || /usr/sbin/mungekey --create
chown munge:munge /run/munge
pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged
export SLURM_CONF=$DIR/slurm.conf
/usr/sbin/slurmctld -f "$SLURM_CONF"
/usr/sbin/slurmd -f "$SLURM_CONF"
for _ in $(seq 30); do sinfo -h -o %T 2>/dev/null | grep -q idle && break; sleep 1; done
sinfo >&2
echo "$SLURM_CONF"
