#!/usr/bin/env bash
# A one-node SLURM cluster on localhost, for tests and for trying the SLURM launcher:
#
#   scripts/slurm_local.sh up       # install what is missing with apt-get (root), start it
#   eval "$(scripts/slurm_local.sh env)"   # SLURM_CONF for sinfo, sbatch, srun, submitit
#   scripts/slurm_local.sh status   # exit 0 when the node is up
#   scripts/slurm_local.sh down     # cancel every job, stop the daemons it started
#
# Real scheduler software, Debian's slurm-wlm, munge, slurmdbd and mariadb-server: munged,
# mariadbd (the accounting database, so that sacct answers as submitit needs), slurmdbd,
# slurmctld and slurmd, in a state folder ($SYNCBN_LAB_SLURM_DIR, default
# /tmp/syncbn-lab-slurm), without cgroups (proctrack/linuxproc, task/none), bound to
# 127.0.0.1 on free ports, one node named localhost with this machine's cores and memory,
# one partition `local`. `up` twice is fine; `down` when nothing runs is fine. Exit status 3
# with one line: the cluster cannot run here (no root, no apt-get); 1: it failed to start.
set -euo pipefail

STATE=${SYNCBN_LAB_SLURM_DIR:-/tmp/syncbn-lab-slurm}
CONF=$STATE/slurm.conf
DAEMONS=(munged mariadbd slurmdbd slurmctld slurmd)  # in start order
PACKAGES=(slurm-wlm munge slurmdbd mariadb-server)
SQL=(mariadb --no-defaults --socket="$STATE/db/mariadb.sock" -uroot)

cannot() { echo "slurm_local: cannot run a local SLURM cluster here: $*" >&2; exit 3; }
fail() { echo "slurm_local: error: $*" >&2; exit 1; }  # it should run here, but did not
log() { echo "slurm_local: $*" >&2; }

pid_of() { cat "$STATE/pids/$1" 2>/dev/null || true; }

running() {  # running NAME: the recorded process is alive and that program (or the setpriv
  local pid comm; pid=$(pid_of "$1")   # or env about to exec it), not a reused PID
  [[ -n $pid && -e /proc/$pid ]] || return 1
  comm=$(cat "/proc/$pid/comm" 2>/dev/null) || return 1
  [[ $comm == "$1"* || $comm == setpriv || $comm == env ]] && ! grep -q '^State:.*Z' "/proc/$pid/status"
}

node_idle() {
  [[ $(SLURM_CONF=$CONF sinfo -h -N -n localhost -o %t 2>/dev/null) =~ ^(idle|mix|alloc) ]]
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

install_if_missing() {
  local missing=0 tool
  for tool in munged slurmctld slurmd slurmdbd sinfo sbatch srun scancel squeue sacct \
    sacctmgr mariadbd mariadb mariadb-install-db; do
    command -v "$tool" >/dev/null || missing=1
  done
  ((missing)) || return 0
  local what="${PACKAGES[*]} are not all installed"
  [[ $(id -u) == 0 ]] || cannot "$what and installing them needs root"
  command -v apt-get >/dev/null || cannot "$what and there is no apt-get"
  log "installing ${PACKAGES[*]} with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq "${PACKAGES[@]}" >/dev/null 2>&1 \
    || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq "${PACKAGES[@]}" >/dev/null; } \
    || cannot "apt-get install ${PACKAGES[*]} failed"
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
  local dbd_port; dbd_port=$(free_port)
  free_port >"$STATE/db/port"
  cat >"$STATE/slurmdbd.conf" <<EOF
# Written by scripts/slurm_local.sh: job accounting into the local mariadbd.
AuthType=auth/munge
AuthInfo=socket=$STATE/munge/munge.socket
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$dbd_port
SlurmUser=root
LogFile=$STATE/log/slurmdbd.log
PidFile=$STATE/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$(cat "$STATE/db/port")
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
EOF
  chmod 600 "$STATE/slurmdbd.conf"
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
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$dbd_port
AccountingStoragePass=$STATE/munge/munge.socket
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
  rm -rf "$STATE/ctld" "$STATE/slurmd" "$STATE/db"
  mkdir -p "$STATE"/{pids,log,ctld,slurmd,munge,db}
  chmod 755 "$STATE"
  chown munge:munge "$STATE/munge" && chmod 755 "$STATE/munge"  # munged: clients need x
  chown mysql:mysql "$STATE/db"
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
  mariadb-install-db --datadir="$STATE/db" --user=mysql --skip-test-db \
    --auth-root-authentication-method=socket >"$STATE/log/mariadb-install-db.out" 2>&1 \
    || fail "mariadb-install-db failed (see $STATE/log/mariadb-install-db.out)"
  start mariadbd mariadbd --no-defaults --datadir="$STATE/db" \
    --socket="$STATE/db/mariadb.sock" --port="$(cat "$STATE/db/port")" \
    --bind-address=127.0.0.1 --skip-name-resolve --user=mysql \
    --pid-file="$STATE/db/mariadbd.pid" --log-error="$STATE/log/mariadbd.log"
  wait_for mariadbd "the accounting database" "${SQL[@]}" -e "SELECT 1"
  "${SQL[@]}" -e "CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"
  start slurmdbd env SLURM_CONF="$CONF" slurmdbd -D
  wait_for slurmdbd "slurmdbd" env SLURM_CONF="$CONF" sacctmgr -n list cluster
  SLURM_CONF=$CONF sacctmgr -i add cluster syncbnlab >/dev/null
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
  fail "timed out waiting for $what (logs above, in $STATE/log)"
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
