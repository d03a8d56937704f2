#!/usr/bin/env bash
# Builds Helm from its Go module (pinned in e2e/cluster/helm/go.mod, go.sum committed) into a
# cache outside the repo (see cached-build.sh). Prints the path of the helm binary on stdout.
set -euo pipefail

# Bump when the build command below changes, so a cached binary is rebuilt.
RECIPE=1

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$here/cached-build.sh"
module="$here/helm"
helm_version=$(pinned_version "$module/go.mod" helm.sh/helm/v4)
bin_dir=$(cache_entry helm "$helm_version" "$RECIPE" "$module/go.mod" "$module/go.sum")

lock_cache build-helm.lock
if [[ -x "$bin_dir/helm" ]]; then
  echo "$bin_dir/helm"
  exit 0
fi

echo "build-helm: building Helm $helm_version into $bin_dir (about a minute on 2 cores)" >&2
staging=$(staging_for "$bin_dir")
(
  cd "$module"
  export CGO_ENABLED=0 GOFLAGS=-mod=readonly
  go build -trimpath \
    -ldflags "-s -w -X helm.sh/helm/v4/internal/version.version=$helm_version -X helm.sh/helm/v4/internal/version.gitTreeState=clean" \
    -o "$staging/helm" helm.sh/helm/v4/cmd/helm
)
publish "$staging" "$bin_dir"
[[ -x "$bin_dir/helm" ]] || { echo "build-helm: build finished but $bin_dir/helm is missing" >&2; exit 1; }
echo "build-helm: done: $bin_dir/helm" >&2
echo "$bin_dir/helm"
