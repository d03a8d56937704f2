#!/usr/bin/env bash
# Builds the pinned Kubernetes control plane (kube-apiserver, kube-controller-manager,
# kube-scheduler, kubectl) and etcd from their Go modules into a cache outside the repo.
# The cache key is a hash of the pin (go.mod, go.sum) and of RECIPE, so a second run reuses
# the binaries and a changed pin or recipe rebuilds them. Prints the binary directory on stdout.
set -euo pipefail

# Bump when the build commands below change, so cached binaries are rebuilt.
RECIPE=1

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
module="$here/controlplane"
k8s_version=$(awk '$1 == "k8s.io/kubernetes" { print $2; exit }' "$module/go.mod")
if [[ -z "$k8s_version" ]]; then
  echo "build-controlplane: no k8s.io/kubernetes requirement in $module/go.mod" >&2
  exit 1
fi
pin_hash=$({ cat "$module/go.mod" "$module/go.sum"; echo "recipe $RECIPE"; } | sha256sum | cut -c1-12)
cache_root=${IPWARDEN_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/ipwarden}
bin_dir="$cache_root/k8s-$k8s_version-$pin_hash"
commands=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl)

complete() {
  local c
  for c in "${commands[@]}"; do [[ -x "$bin_dir/$c" ]] || return 1; done
}

mkdir -p "$cache_root"
exec 9>"$cache_root/build.lock"
flock 9
if complete; then
  echo "$bin_dir"
  exit 0
fi

echo "build-controlplane: building Kubernetes $k8s_version and etcd into $bin_dir (cold build: tens of minutes on 2 cores)" >&2
minor=$(echo "$k8s_version" | cut -d. -f2)
build_date=$(date -u +%Y-%m-%dT%H:%M:%SZ)
version_flags=""
for pkg in k8s.io/client-go/pkg/version k8s.io/component-base/version; do
  version_flags+=" -X '$pkg.gitVersion=$k8s_version' -X '$pkg.gitMajor=1' -X '$pkg.gitMinor=$minor'"
  version_flags+=" -X '$pkg.gitTreeState=clean' -X '$pkg.buildDate=$build_date'"
done

staging="$bin_dir.partial"
rm -rf "$staging"
mkdir -p "$staging"
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
rm -rf "$bin_dir"
mv "$staging" "$bin_dir"
complete || { echo "build-controlplane: build finished but $bin_dir is incomplete" >&2; exit 1; }
echo "build-controlplane: done: $bin_dir" >&2
echo "$bin_dir"
