#!/usr/bin/env bash
# bash scripts/slurm/local_cluster.sh start DIR | stop DIR | env DIR
# A single-node Slurm cluster on this machine, for trying the templates in scripts/slurm/ (and for
# tests/test_slurm.py). Everything lives under DIR (config, munge key and socket, state, logs, PID
# files); the system's /etc/slurm and /etc/munge are not touched.
#   start DIR  installs Debian's slurm-wlm and munge when missing (needs root and apt-get), writes
#              DIR/slurm.conf (one node with this machine's CPUs, no GRES, JobRequeue=1,
#              ReturnToService=2), starts munged, slurmctld and slurmd and waits for the node to be idle.
#   stop DIR   cancels this cluster's jobs, then stops the daemons by the PIDs recorded in DIR.
#   env DIR    prints `export SLURM_CONF=DIR/slurm.conf`: eval "$(bash scripts/slurm/local_cluster.sh env DIR)"
# Exit codes: 0 ok, 1 usage or a daemon failed, 3 Slurm cannot be installed or started here (tests skip).
set -euo pipefail

UNAVAILABLE=3

die() { echo "local_cluster: $1" >&2; exit "${2:-1}"; }

[ $# -eq 2 ] || die "usage: $0 start|stop|env DIR"
cmd="$1"
dir="$2"
mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"
conf="$dir/slurm.conf"
export SLURM_CONF="$conf"

install_packages() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null && return 0
  [ "$(id -u)" -eq 0 ] || die "slurmctld/slurmd/munged not installed and not root (apt-get install slurm-wlm munge)" $UNAVAILABLE
  command -v apt-get >/dev/null || die "slurmctld/slurmd/munged not installed and no apt-get" $UNAVAILABLE
  echo "local_cluster: installing slurm-wlm and munge with apt-get"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge; } \
    >"$dir/apt.log" 2>&1 </dev/null || die "apt-get install slurm-wlm munge failed (see $dir/apt.log)" $UNAVAILABLE
}

free_port() {  # a TCP port nobody listens on (from a random start, so two clusters do not collide)
  local port=$((20000 + RANDOM % 20000)) tries
  for tries in $(seq 50); do
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then echo "$port"; return; fi
    port=$((port + 7))
  done
  die "no free TCP port found" $UNAVAILABLE
}

write_config() {
  local node ctld_port slurmd_port
  node="$(hostname -s)"
  ctld_port="$(free_port)"
  slurmd_port="$(free_port)"
  [ "$slurmd_port" != "$ctld_port" ] || slurmd_port=$((ctld_port + 1))
  mkdir -p "$dir/state" "$dir/spool" "$dir/munge"
  chmod 700 "$dir/munge"
  cat >"$conf" <<EOF
# bash scripts/slurm/local_cluster.sh start $dir   (written by it; one node, no GRES)
ClusterName=pardec-local
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=$(id -un)
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=5,bf_interval=5
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobRequeue=1
ReturnToService=2
MinJobAge=600
NodeName=$node NodeAddr=127.0.0.1 CPUs=$(nproc) State=UNKNOWN
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

start_daemon() {  # name, command...: run in the background, record its PID in DIR/name.daemon.pid
  local name="$1"
  shift
  "$@" >>"$dir/$name.out" 2>&1 </dev/null &
  echo $! >"$dir/$name.daemon.pid"
}

alive() { [ -f "$dir/$1.daemon.pid" ] && kill -0 "$(cat "$dir/$1.daemon.pid")" 2>/dev/null; }

start() {
  install_packages
  for name in munged slurmctld slurmd; do
    alive "$name" && die "$name already running from $dir (stop it first: $0 stop $dir)"
  done
  write_config
  trap 'stop >/dev/null 2>&1' EXIT  # a failed start leaves nothing running
  [ -f "$dir/munge/munge.key" ] || {
    dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
    chmod 400 "$dir/munge/munge.key"
  }
  start_daemon munged munged --foreground --force --socket="$dir/munge/munge.socket" \
    --key-file="$dir/munge/munge.key" --pid-file="$dir/munge/munged.pid" --log-file="$dir/munge/munged.log" \
    --seed-file="$dir/munge/munged.seed"
  for _ in $(seq 50); do [ -S "$dir/munge/munge.socket" ] && break; sleep 0.2; done
  [ -S "$dir/munge/munge.socket" ] || die "munged did not start (see $dir/munged.out)" $UNAVAILABLE
  start_daemon slurmctld slurmctld -D -f "$conf"
  start_daemon slurmd slurmd -D -f "$conf" -N "$(hostname -s)"
  local state=""
  for _ in $(seq 120); do
    alive slurmctld || die "slurmctld exited (see $dir/slurmctld.out, $dir/slurmctld.log)" $UNAVAILABLE
    alive slurmd || die "slurmd exited (see $dir/slurmd.out, $dir/slurmd.log)" $UNAVAILABLE
    state="$(sinfo -h -o %T 2>/dev/null || true)"
    [ "$state" = "idle" ] && { trap - EXIT; echo "local_cluster: up ($conf)"; return 0; }
    sleep 0.5
  done
  die "node not idle after 60 s (state '${state}'; see $dir/*.log)" $UNAVAILABLE
}

stop_pid() {  # name: SIGTERM the recorded PID, wait up to 10 s, then SIGKILL
  local name="$1" pid
  [ -f "$dir/$name.daemon.pid" ] || return 0
  pid="$(cat "$dir/$name.daemon.pid")"
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null
  fi
  rm -f "$dir/$name.daemon.pid"
}

stop() {
  if alive slurmctld; then
    scancel --full --signal=KILL --state=RUNNING "--user=$(id -un)" 2>/dev/null || true
    scancel "--user=$(id -un)" 2>/dev/null || true
    for _ in $(seq 60); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.5; done
  fi
  stop_pid slurmd
  stop_pid slurmctld
  stop_pid munged
  echo "local_cluster: stopped ($dir)"
}

case "$cmd" in
  start) start ;;
  stop) stop ;;
  env) echo "export SLURM_CONF=$conf" ;;
  *) die "usage: $0 start|stop|env DIR" ;;
esac
