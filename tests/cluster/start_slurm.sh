#!/usr/bin/env bash
# A single-node SLURM cluster on this machine (controller and compute node both here), for the slow tests of sweeps
# through hydra/launcher=submitit_slurm. Needs root and Debian's packages. Idempotent: with the daemons up it changes
# nothing. One line per step; exit status 0 once `sinfo` shows the node idle.
#
#   sudo bash tests/cluster/start_slurm.sh     # then: sbatch --wrap hostname
#   sudo bash tests/cluster/stop_slurm.sh      # stops the daemons
set -euo pipefail

CONF=/etc/slurm/slurm.conf
MARK="# single-node test cluster written by tests/cluster/start_slurm.sh"
SPOOL=/var/spool/slurm-single
LOGS=/var/log/slurm
WAIT_S=${SLURM_START_WAIT_S:-60}

say() { echo "start_slurm: $*"; }
fail() { echo "start_slurm: error: $*" >&2; exit 1; }
alive() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

[[ $(id -u) -eq 0 ]] || fail "needs root (it installs packages and starts system daemons)"

# 1. packages
if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then
    say "packages: slurm-wlm and munge already installed"
else
    command -v apt-get >/dev/null || fail "slurm-wlm and munge are not installed and there is no apt-get to install them"
    say "packages: installing slurm-wlm and munge"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null && apt-get install -y -qq slurm-wlm munge >/dev/null \
        || fail "apt-get install slurm-wlm munge failed"
fi

# 2. munge key
if [[ -s /etc/munge/munge.key ]]; then
    say "munge key: /etc/munge/munge.key exists"
else
    install -d -o munge -g munge -m 0700 /etc/munge
    mungekey --create --keyfile /etc/munge/munge.key 2>/dev/null \
        || dd if=/dev/urandom of=/etc/munge/munge.key bs=128 count=1 status=none
    chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
    say "munge key: created /etc/munge/munge.key"
fi

# 3. munged
if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    say "munged: already running"
else
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o munge -g munge -m 0700 /var/log/munge /var/lib/munge
    runuser -u munge -- /usr/sbin/munged || fail "munged did not start (see /var/log/munge/munged.log)"
    munge -n | unmunge >/dev/null || fail "munged started but a credential does not decode"
    say "munged: started"
fi

# 4. slurm.conf: this machine's name, CPUs, topology and memory as slurmd reads them
host=$(hostname -s)
node=$(slurmd -C | head -n 1)  # NodeName=<host> CPUs=.. Boards=.. SocketsPerBoard=.. ... RealMemory=..
[[ $node == "NodeName=$host "* ]] || fail "unexpected \`slurmd -C\` output: $node"
summary=$(grep -oE '(CPUs|RealMemory)=[0-9]+' <<<"$node" | paste -sd ' ')
conf="$MARK
ClusterName=single
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
KillWait=2
StateSaveLocation=$SPOOL/ctld
SlurmdSpoolDir=$SPOOL/d
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
$node NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP"
if [[ -f $CONF ]] && ! grep -qxF "$MARK" "$CONF"; then
    fail "$CONF exists and was not written by this script: not overwriting a real cluster's configuration"
fi
if [[ -f $CONF ]] && [[ $(cat "$CONF") == "$conf" ]]; then
    say "slurm.conf: $CONF up to date (node $host: $summary)"
    changed=0
else
    install -d /etc/slurm
    printf '%s\n' "$conf" >"$CONF"
    say "slurm.conf: wrote $CONF (node $host: $summary)"
    changed=1
fi
install -d "$SPOOL/ctld" "$SPOOL/d" "$LOGS"

# 5. slurmctld and slurmd (a changed slurm.conf restarts the ones running)
for daemon in slurmctld slurmd; do
    pidfile=/run/$daemon.pid
    if alive "$pidfile" && [[ $changed -eq 1 ]]; then
        kill "$(cat "$pidfile")"
        for _ in $(seq 50); do alive "$pidfile" || break; sleep 0.1; done
        say "$daemon: stopped to take the new slurm.conf"
    fi
    if alive "$pidfile"; then
        say "$daemon: already running (pid $(cat "$pidfile"))"
    else
        "/usr/sbin/$daemon" || fail "$daemon did not start (see $LOGS/$daemon.log)"
        say "$daemon: started"
    fi
done

# 6. the node idle
state=""
for _ in $(seq $((WAIT_S * 2))); do
    state=$(sinfo -h -N -n "$host" -o %t 2>/dev/null || true)
    case $state in
        idle*) break ;;
        down* | drain* | drng*) scontrol update NodeName="$host" State=RESUME >/dev/null 2>&1 || true ;;
    esac
    sleep 0.5
done
[[ $state == idle* ]] || fail "node $host is '${state:-not reported}' after ${WAIT_S}s (see $LOGS/slurmd.log, $LOGS/slurmctld.log)"
say "ready: node $host idle in partition debug"
