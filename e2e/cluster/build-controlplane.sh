#!/usr/bin/env bash
# Builds the pinned Kubernetes control plane (kube-apiserver, kube-controller-manager,
# kube-scheduler, kubectl) and etcd from their Go modules into a cache outside the repo (see
# cached-build.sh). Prints the binary directory on stdout.
set -euo pipefail

# Bump when the build commands below change, so cached binaries are rebuilt.
RECIPE=1

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$here/cached-build.sh"
module="$here/controlplane"
k8s_version=$(pinned_version "$module/go.mod" k8s.io/kubernetes)
bin_dir=$(cache_entry k8s "$k8s_version" "$RECIPE" "$module/go.mod" "$module/go.sum")
commands=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl)

complete() {
  all_present "$bin_dir" "${commands[@]}"
}

lock_cache build.lock
if complete; then
  echo "$bin_dir"
  exit 0
fi

echo "build-controlplane: building Kubernetes $k8s_version and etcd into $bin_dir (cold build: tens of minutes on 2 cores)" >&2
version_flags=$(k8s_version_flags "$k8s_version")

staging=$(staging_for "$bin_dir")
(
  cd "$module"
  export CGO_ENABLED=0 GOFLAGS=-mod=readonly
  go build -trimpath -o "$staging/etcd" go.etcd.io/etcd/server/v3
  go build -trimpath -ldflags "-s -w $version_flags" -o "$staging/" \
    k8s.io/kubernetes/cmd/kube-apiserver \
    k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler \
    k8s.io/kubernetes/cmd/kubectl
)
publish "$staging" "$bin_dir"
complete || { echo "build-controlplane: build finished but $bin_dir is incomplete" >&2; exit 1; }
echo "build-controlplane: done: $bin_dir" >&2
echo "$bin_dir"
