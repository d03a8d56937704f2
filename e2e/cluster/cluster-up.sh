#!/usr/bin/env bash
# Starts a test cluster in the background for a human (make cluster-up): the control plane,
# simulated nodes and ipwarden (its CNI plugin, an agent per node, two controller replicas and
# the default pool), built fresh with cargo so it never runs a stale binary. With --bare, the
# nodes use Debian's host-local and no ipwarden runs. Other arguments go to `ipwarden-e2e up`
# (e.g. --controller-arg=--full-scan-interval-seconds=5, --agent-arg=..., --demo, --nodes 4).
# The admin kubeconfig lands in .e2e/kubeconfig once everything is ready; the harness's output
# goes to .e2e/cluster.log and its PID to .e2e/cluster.pid. make cluster-down stops it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

bare=false
args=()
for arg in "$@"; do
  if [[ $arg == --bare ]]; then bare=true; else args+=("$arg"); fi
done

state=.e2e
target=${CARGO_TARGET_DIR:-target}
mkdir -p "$state"
if [[ -f $state/cluster.pid ]] && kill -0 "$(cat "$state/cluster.pid")" 2>/dev/null; then
  echo "cluster-up: a cluster is already running (pid $(cat "$state/cluster.pid")); make cluster-down first" >&2
  exit 1
fi
bash e2e/cluster/install-deps.sh
bash e2e/cluster/build-controlplane.sh >/dev/null
if $bare; then
  echo "cluster-up: building the harness (cargo build; a few minutes the first time)"
  cargo build --quiet --locked -p ipwarden-e2e --bin ipwarden-e2e
else
  echo "cluster-up: building ipwarden and the harness (cargo build; a few minutes the first time)"
  cargo build --quiet --locked --workspace --bins
  args=(--ipwarden "$target/debug/ipwarden" "${args[@]}")
fi
rm -f "$state/kubeconfig"
nohup "$target/debug/ipwarden-e2e" up --kubeconfig "$state/kubeconfig" "${args[@]}" >"$state/cluster.log" 2>&1 &
echo $! >"$state/cluster.pid"

# Show the harness's progress as it comes, until it says it is ready.
shown=0
show_new_lines() {
  local lines
  lines=$(wc -l <"$state/cluster.log")
  if ((lines > shown)); then
    sed -n "$((shown + 1)),${lines}p" "$state/cluster.log" | grep -v '^press Ctrl-C to stop' || true
    shown=$lines
  fi
}
for _ in $(seq 1 300); do
  show_new_lines
  if grep -q '^press Ctrl-C to stop' "$state/cluster.log"; then
    echo "cluster-up: running in the background (pid $(cat "$state/cluster.pid"), output in $state/cluster.log); make cluster-down stops it"
    exit 0
  fi
  if ! kill -0 "$(cat "$state/cluster.pid")" 2>/dev/null; then
    show_new_lines
    echo "cluster-up: the harness exited (its output is above and in $state/cluster.log)" >&2
    rm -f "$state/cluster.pid"
    exit 1
  fi
  sleep 1
done
echo "cluster-up: not ready after 300 s; see $state/cluster.log; stopping" >&2
bash e2e/cluster/cluster-down.sh
exit 1
