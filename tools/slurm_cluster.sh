#!/usr/bin/env bash
# A single-node Slurm cluster on this machine, for launch/slurm.py's tests and for trying
# the Slurm launcher without a real cluster.
#
#   tools/slurm_cluster.sh start    install slurm-wlm + munge if missing, write the munge key
#                                   and slurm.conf, start munged, slurmctld and slurmd, and
#                                   wait until sinfo shows the node idle
#   tools/slurm_cluster.sh stop     cancel running jobs, kill the daemons by their pid files
#                                   and remove the controller's job state (next start is clean)
#   tools/slurm_cluster.sh status   the daemons' pids and sinfo; exit 0 only if all run
#
# Needs root (packages, /etc, daemons) and works without systemd: every daemon is started
# and stopped here by hand. This host is the controller and the only compute node; its CPUs
# and memory are read from the machine (CPUs: at least 4, see write_conf). The cgroup-free plugins (proctrack/linuxproc,
# task/none, no cgroup.conf) are what make slurmd run in a container without systemd.
set -euo pipefail

CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
MARK="# written by tools/slurm_cluster.sh"
STATE_DIR=/var/lib/slurm
LOG_DIR=/var/log/slurm
RUN_DIR=/run/slurm
MUNGE_PID=/run/munge/munged.pid
CTLD_PID=$RUN_DIR/slurmctld.pid
SLURMD_PID=$RUN_DIR/slurmd.pid

log() { echo "[slurm_cluster] $*" >&2; }

pid_alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

install_packages() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then
    return
  fi
  log "installing slurm-wlm and munge"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq slurm-wlm munge >/dev/null
}

start_munge() {
  install -d -o munge -g munge -m 0755 /run/munge
  install -d -o munge -g munge -m 0700 /var/log/munge /var/lib/munge /etc/munge
  if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  fi
  chown munge:munge /etc/munge/munge.key
  chmod 0400 /etc/munge/munge.key
  if ! pid_alive "$MUNGE_PID"; then
    runuser -u munge -- /usr/sbin/munged
  fi
  for _ in $(seq 50); do
    munge -n | unmunge >/dev/null 2>&1 && return
    sleep 0.1
  done
  log "munge does not answer (munge -n | unmunge)"
  exit 1
}

write_conf() {
  if [ -e "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
    log "$CONF exists and was not written by this script; leaving it (and this cluster) alone"
    exit 1
  fi
  local host cpus mem_mb
  host=$(hostname -s)
  # At least 4 CPUs are declared, more than a 2-core machine has (tasks are not bound, so
  # steps share the cores as the local launcher's processes do): a run's buffer, generator
  # and trainer steps leave a slot free, which is what a generator step that joins the
  # running job (scale-out, tests/test_slurm.py) needs on a one-node cluster.
  cpus=$(( $(nproc) > 4 ? $(nproc) : 4 ))
  # 80% of the machine for jobs; the rest stays with the OS and the daemons.
  mem_mb=$(awk '/^MemTotal:/ {printf "%d", $2 / 1024 * 0.8}' /proc/meminfo)
  install -d "$CONF_DIR" "$LOG_DIR" "$RUN_DIR" "$STATE_DIR/slurmctld" "$STATE_DIR/slurmd"
  cat >"$CONF" <<EOF
$MARK
ClusterName=local
SlurmctldHost=$host
AuthType=auth/munge
CredType=cred/munge
SlurmUser=root
# No cgroup setup in a container: processes are tracked through /proc, tasks are not bound.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# The node's declared CPUs stand, even where the machine has fewer.
SlurmdParameters=config_overrides
# Without a default a job takes all of the node's memory and every other job pends.
DefMemPerCPU=$((mem_mb / cpus))
StateSaveLocation=$STATE_DIR/slurmctld
SlurmdSpoolDir=$STATE_DIR/slurmd
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$SLURMD_PID
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
# Seconds between a job's SIGTERM and its SIGKILL when it is cancelled or runs out of time.
KillWait=15
NodeName=$host CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
}

wait_idle() {
  local state=""
  for _ in $(seq 60); do
    state=$(sinfo -h -N -o %T 2>/dev/null | head -n1 || true)
    case "$state" in
      idle | mixed | allocated) log "node $(hostname -s) is $state"; return ;;
      down* | drain*) scontrol update NodeName="$(hostname -s)" State=RESUME 2>/dev/null || true ;;
    esac
    sleep 0.5
  done
  log "the node did not become idle (last state: '${state:-none}'); see $LOG_DIR/"
  exit 1
}

start() {
  [ "$(id -u)" -eq 0 ] || { log "needs root"; exit 1; }
  install_packages
  start_munge
  write_conf
  pid_alive "$CTLD_PID" || slurmctld
  pid_alive "$SLURMD_PID" || slurmd
  wait_idle
}

kill_pidfile() {
  local file=$1 pid
  pid_alive "$file" || { rm -f "$file"; return 0; }
  pid=$(cat "$file")
  kill "$pid"
  for _ in $(seq 50); do
    kill -0 "$pid" 2>/dev/null || { rm -f "$file"; return 0; }
    sleep 0.1
  done
  kill -9 "$pid" 2>/dev/null || true
  rm -f "$file"
}

stop() {
  if pid_alive "$CTLD_PID" && command -v squeue >/dev/null; then
    # Jobs first, so no step outlives the daemons that would have killed it.
    local jobs
    jobs=$(squeue -h -o %i 2>/dev/null || true)
    if [ -n "$jobs" ]; then
      # shellcheck disable=SC2086  # one argument per job id
      scancel $jobs 2>/dev/null || true
      for _ in $(seq 60); do
        [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break
        sleep 0.5
      done
    fi
  fi
  kill_pidfile "$SLURMD_PID"
  kill_pidfile "$CTLD_PID"
  kill_pidfile "$MUNGE_PID"
  rm -rf "${STATE_DIR:?}/slurmctld/"* "${STATE_DIR:?}/slurmd/"*
  log "stopped"
}

status() {
  local ok=0 name file
  for name in munged slurmctld slurmd; do
    case $name in
      munged) file=$MUNGE_PID ;;
      slurmctld) file=$CTLD_PID ;;
      slurmd) file=$SLURMD_PID ;;
    esac
    if pid_alive "$file"; then
      echo "$name: running (pid $(cat "$file"))"
    else
      echo "$name: stopped"
      ok=1
    fi
  done
  [ "$ok" -eq 0 ] && sinfo
  return "$ok"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
