#!/usr/bin/env bash
# Stops the cluster make cluster-up started (SIGTERM, then waits up to 60 s for the harness
# to stop its components and remove its run directory).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

pidfile=.e2e/cluster.pid
if [[ ! -f $pidfile ]]; then
  echo "cluster-down: no cluster is running (no $pidfile)"
  exit 0
fi
pid=$(cat "$pidfile")
if kill -TERM "$pid" 2>/dev/null; then
  for _ in $(seq 1 60); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 1
  done
  if kill -0 "$pid" 2>/dev/null; then
    echo "cluster-down: harness $pid still running after 60 s; killing it" >&2
    kill -KILL "$pid"
  fi
fi
rm -f "$pidfile" .e2e/kubeconfig
echo "cluster-down: stopped"
