#!/usr/bin/env bash
# Builds Helm from its Go module (pinned in e2e/cluster/helm/go.mod, go.sum committed) into a
# cache outside the repo, the same way build-controlplane.sh builds the control plane. The
# cache key is a hash of the pin and of RECIPE; a second run returns at once. Prints the path
# of the helm binary on stdout.
set -euo pipefail

# Bump when the build command below changes, so a cached binary is rebuilt.
RECIPE=1

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
module="$here/helm"
helm_version=$(awk '$1 == "require" && $2 == "helm.sh/helm/v4" { print $3; exit }' "$module/go.mod")
if [[ -z "$helm_version" ]]; then
  echo "build-helm: no helm.sh/helm/v4 requirement in $module/go.mod" >&2
  exit 1
fi
pin_hash=$({ cat "$module/go.mod" "$module/go.sum"; echo "recipe $RECIPE"; } | sha256sum | cut -c1-12)
cache_root=${IPWARDEN_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/ipwarden}
bin_dir="$cache_root/helm-$helm_version-$pin_hash"

mkdir -p "$cache_root"
exec 9>"$cache_root/build-helm.lock"
flock 9
if [[ -x "$bin_dir/helm" ]]; then
  echo "$bin_dir/helm"
  exit 0
fi

echo "build-helm: building Helm $helm_version into $bin_dir (about a minute on 2 cores)" >&2
staging="$bin_dir.partial"
rm -rf "$staging"
mkdir -p "$staging"
(
  cd "$module"
  export CGO_ENABLED=0 GOFLAGS=-mod=readonly
  go build -trimpath \
    -ldflags "-s -w -X helm.sh/helm/v4/internal/version.version=$helm_version -X helm.sh/helm/v4/internal/version.gitTreeState=clean" \
    -o "$staging/helm" helm.sh/helm/v4/cmd/helm
)
rm -rf "$bin_dir"
mv "$staging" "$bin_dir"
[[ -x "$bin_dir/helm" ]] || { echo "build-helm: build finished but $bin_dir/helm is missing" >&2; exit 1; }
echo "build-helm: done: $bin_dir/helm" >&2
echo "$bin_dir/helm"
