#!/usr/bin/env bash
# A one-node SLURM cluster on localhost, for tests and for trying the SLURM launcher:
#
#   scripts/slurm_local.sh up       # install slurm-wlm + munge if missing (root), start them
#   eval "$(scripts/slurm_local.sh env)"   # SLURM_CONF for sinfo, sbatch, srun, submitit
#   scripts/slurm_local.sh status   # exit 0 when the node is up
#   scripts/slurm_local.sh down     # cancel every job, stop the daemons it started
#
# Real scheduler software (munged, slurmctld, slurmd) in a state folder
# ($SYNCBN_LAB_SLURM_DIR, default /tmp/syncbn-lab-slurm), without cgroups
# (proctrack/linuxproc, task/none), bound to 127.0.0.1 on free ports, one node named
# localhost with this machine's cores and memory, one partition `local`. No accounting
# database: sacct does not work, squeue and scontrol do. `up` twice is fine; `down` when
# nothing runs is fine. Exit status 3 with one line: the cluster cannot run here.
set -euo pipefail

STATE=${SYNCBN_LAB_SLURM_DIR:-/tmp/syncbn-lab-slurm}
CONF=$STATE/slurm.conf
DAEMONS=(munged slurmctld slurmd)

cannot() { echo "slurm_local: cannot run a local SLURM cluster here: $*" >&2; exit 3; }
log() { echo "slurm_local: $*" >&2; }

pid_of() { cat "$STATE/pids/$1" 2>/dev/null || true; }

running() {  # running NAME: the recorded process is alive and still that program
  local pid; pid=$(pid_of "$1")
  [[ -n $pid && -e /proc/$pid ]] && [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$1"* ]]
}

node_idle() {
  [[ $(SLURM_CONF=$CONF sinfo -h -N -n localhost -o %t 2>/dev/null) =~ ^(idle|mix|alloc) ]]
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

install_if_missing() {
  local missing=0 tool
  for tool in munged slurmctld slurmd sinfo sbatch srun scancel squeue; do
    command -v "$tool" >/dev/null || missing=1
  done
  ((missing)) || return 0
  [[ $(id -u) == 0 ]] || cannot "slurm-wlm and munge are not installed and installing them needs root"
  command -v apt-get >/dev/null || cannot "slurm-wlm and munge are not installed and there is no apt-get"
  log "installing slurm-wlm and munge with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq slurm-wlm munge >/dev/null 2>&1 \
    || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq slurm-wlm munge >/dev/null; } \
    || cannot "apt-get install slurm-wlm munge failed"
}

write_conf() {
  # This machine's real topology and memory, as slurmd itself detects them.
  local detected cpus sockets cores threads memory
  detected=$(slurmd -C | head -n 1)
  cpus=$(sed -n 's/.* CPUs=\([0-9]*\).*/\1/p' <<<"$detected")
  sockets=$(sed -n 's/.* SocketsPerBoard=\([0-9]*\).*/\1/p' <<<"$detected")
  cores=$(sed -n 's/.* CoresPerSocket=\([0-9]*\).*/\1/p' <<<"$detected")
  threads=$(sed -n 's/.* ThreadsPerCore=\([0-9]*\).*/\1/p' <<<"$detected")
  memory=$(sed -n 's/.* RealMemory=\([0-9]*\).*/\1/p' <<<"$detected")
  cat >"$CONF" <<EOF
# Written by scripts/slurm_local.sh: a one-node cluster on 127.0.0.1.
ClusterName=syncbnlab
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
SrunPortRange=$(python3 -c 'import random; p = random.randrange(40000, 59000, 100); print(f"{p}-{p + 99}")')
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$STATE/munge/munge.socket
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/slurmd
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
SlurmdTimeout=60
KillWait=5
InactiveLimit=0
MinJobAge=600
NodeName=localhost NodeAddr=127.0.0.1 NodeHostname=localhost CPUs=$cpus SocketsPerBoard=$sockets CoresPerSocket=$cores ThreadsPerCore=$threads RealMemory=$memory State=UNKNOWN
PartitionName=local Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
}

start() {  # start NAME COMMAND...: in its own session, output to the log folder, pid recorded
  local name=$1; shift
  setsid "$@" >>"$STATE/log/$name.out" 2>&1 </dev/null &
  echo $! >"$STATE/pids/$name"
}

up() {
  if running slurmctld && running slurmd && node_idle; then
    log "already up ($CONF)"
    return 0
  fi
  install_if_missing
  [[ $(id -u) == 0 ]] || cannot "slurmd must run as root to start jobs"
  down_quiet
  rm -rf "$STATE/ctld" "$STATE/slurmd"
  mkdir -p "$STATE"/{pids,log,ctld,slurmd,munge}
  chmod 755 "$STATE"
  chown munge:munge "$STATE/munge" && chmod 755 "$STATE/munge"  # munged: clients need x
  if [[ ! -s /etc/munge/munge.key ]]; then
    mungekey --create --keyfile=/etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key && chmod 600 /etc/munge/munge.key
  fi
  write_conf
  start munged setpriv --reuid=munge --regid=munge --init-groups \
    munged --foreground --socket="$STATE/munge/munge.socket" \
    --pid-file="$STATE/munge/munged.pid" --seed-file="$STATE/munge/munged.seed" \
    --log-file="$STATE/munge/munged.log"
  wait_for munged "munged's socket" test -S "$STATE/munge/munge.socket"
  start slurmctld slurmctld -D -f "$CONF"
  wait_for slurmctld "slurmctld" env SLURM_CONF="$CONF" scontrol ping
  start slurmd slurmd -D -f "$CONF" -N localhost
  wait_for slurmd "the node to be idle (sinfo)" node_idle
  log "up: one node, $(SLURM_CONF=$CONF sinfo -h -N -o '%c CPUs, %m MB') ($CONF)"
}

wait_for() {  # wait_for DAEMON WHAT COMMAND...: up to 60 s while DAEMON lives, else fail
  local daemon=$1 what=$2; shift 2
  for _ in $(seq 1 120); do
    "$@" >/dev/null 2>&1 && return 0
    running "$daemon" || { what="$what: $daemon exited"; break; }
    sleep 0.5
  done
  local logs; logs=$(tail -n 5 "$STATE"/log/*.out "$STATE"/log/*.log 2>/dev/null || true)
  down_quiet
  echo "$logs" >&2
  cannot "timed out waiting for $what (logs above, in $STATE/log)"
}

down_quiet() {
  if running slurmctld; then  # cancel every job first, so no job step outlives slurmd
    SLURM_CONF=$CONF scancel --full --user=root --quiet 2>/dev/null || true
    for _ in $(seq 1 40); do
      [[ -z $(SLURM_CONF=$CONF squeue -h -o %i 2>/dev/null) ]] && break
      sleep 0.5
    done
  fi
  local name pid i
  for ((i = ${#DAEMONS[@]} - 1; i >= 0; i--)); do
    name=${DAEMONS[i]}
    if running "$name"; then
      pid=$(pid_of "$name")
      kill -TERM "$pid" 2>/dev/null || true
      for _ in $(seq 1 40); do [[ -e /proc/$pid ]] || break; sleep 0.25; done
      [[ -e /proc/$pid ]] && kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$STATE/pids/$name"
  done
}

case ${1:-} in
  up) up ;;
  down) down_quiet; log "down" ;;
  status) running slurmctld && running slurmd && node_idle ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) echo "usage: $0 up|down|status|env" >&2; exit 2 ;;
esac
