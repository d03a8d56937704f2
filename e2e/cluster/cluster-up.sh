#!/usr/bin/env bash
# Starts a test cluster in the background for a human (make cluster-up): the admin
# kubeconfig lands in .e2e/kubeconfig once the simulated nodes are Ready; the harness's
# output goes to .e2e/cluster.log and its PID to .e2e/cluster.pid. make cluster-down stops it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

state=.e2e
mkdir -p "$state"
if [[ -f $state/cluster.pid ]] && kill -0 "$(cat "$state/cluster.pid")" 2>/dev/null; then
  echo "cluster-up: a cluster is already running (pid $(cat "$state/cluster.pid")); make cluster-down first" >&2
  exit 1
fi
bash e2e/cluster/install-deps.sh
bash e2e/cluster/build-controlplane.sh >/dev/null
cargo build --quiet -p ipwarden-e2e --bin ipwarden-e2e
rm -f "$state/kubeconfig"
nohup target/debug/ipwarden-e2e up --kubeconfig "$state/kubeconfig" "$@" >"$state/cluster.log" 2>&1 &
echo $! >"$state/cluster.pid"

for _ in $(seq 1 300); do
  if [[ -f $state/kubeconfig ]]; then
    sed -n '/^cluster ready/,$p' "$state/cluster.log"
    exit 0
  fi
  if ! kill -0 "$(cat "$state/cluster.pid")" 2>/dev/null; then
    echo "cluster-up: the harness exited; its output:" >&2
    cat "$state/cluster.log" >&2
    rm -f "$state/cluster.pid"
    exit 1
  fi
  sleep 1
done
echo "cluster-up: no kubeconfig after 300 s; see $state/cluster.log; stopping" >&2
bash e2e/cluster/cluster-down.sh
exit 1
