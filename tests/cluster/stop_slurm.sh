#!/usr/bin/env bash
# Stops what tests/cluster/start_slurm.sh started: slurmd, slurmctld and munged, each by the pid it recorded.
# The packages, the munge key and slurm.conf stay (the next start is quick). One line per daemon.
set -uo pipefail

say() { echo "stop_slurm: $*"; }

for pidfile in /run/slurmd.pid /run/slurmctld.pid /run/munge/munged.pid; do
    name=$(basename "$pidfile" .pid)
    if [[ -s $pidfile ]] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
        pid=$(cat "$pidfile")
        kill "$pid"
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        if kill -0 "$pid" 2>/dev/null; then say "$name: still running (pid $pid) after 10s"; else say "$name: stopped"; fi
    else
        say "$name: not running"
    fi
done
