#!/usr/bin/env bash
# Builds the Whereabouts peer for the churn benchmark (docs/benchmarks.md, "Peers") from its
# pinned Go module (e2e/cluster/peers/whereabouts, go.mod and go.sum committed) into a cache
# outside the repo (see cached-build.sh): the `whereabouts` CNI IPAM plugin and node slice
# controller as Whereabouts builds them, `whereabouts-controller` (peers/whereabouts/main.go:
# its ip-control-loop and reconciler run with a kubeconfig), and the CRDs of the same module
# versions. Prints the cache directory on stdout. Not part of `make test`.
set -euo pipefail

# Bump when the build commands below change, so a cached build is redone.
RECIPE=1

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$here/cached-build.sh"
module="$here/peers/whereabouts"
version=$(pinned_version "$module/go.mod" github.com/k8snetworkplumbingwg/whereabouts)
out_dir=$(cache_entry whereabouts "$version" "$RECIPE" "$module/go.mod" "$module/go.sum" "$module/main.go")
outputs=(whereabouts whereabouts-controller nodeslicecontroller crds.yaml)

complete() {
  all_present "$out_dir" "${outputs[@]}"
}

lock_cache build-whereabouts.lock
if complete; then
  echo "$out_dir"
  exit 0
fi

echo "build-whereabouts: building Whereabouts $version into $out_dir (a few minutes on 2 cores)" >&2
staging=$(staging_for "$out_dir")
(
  cd "$module"
  export CGO_ENABLED=0 GOFLAGS=-mod=readonly
  ldflags="-s -w -X github.com/k8snetworkplumbingwg/whereabouts/pkg/version.Version=$version"
  nice go build -trimpath -ldflags "$ldflags" -o "$staging/whereabouts" github.com/k8snetworkplumbingwg/whereabouts/cmd
  nice go build -trimpath -ldflags "$ldflags" -o "$staging/nodeslicecontroller" \
    github.com/k8snetworkplumbingwg/whereabouts/cmd/nodeslicecontroller
  nice go build -trimpath -ldflags "-s -w" -o "$staging/whereabouts-controller" .
  # The CRDs ship in the modules themselves: Whereabouts' own and the NetworkAttachmentDefinition
  # its ip-control-loop watches, at the versions the build used.
  wb_dir=$(go list -m -f '{{.Dir}}' github.com/k8snetworkplumbingwg/whereabouts)
  nad_dir=$(go list -m -f '{{.Dir}}' github.com/k8snetworkplumbingwg/network-attachment-definition-client)
  for crd in "$wb_dir"/doc/crds/whereabouts.cni.cncf.io_*.yaml "$nad_dir/artifacts/networks-crd.yaml"; do
    echo "---"
    cat "$crd"
  done >"$staging/crds.yaml"
)
publish "$staging" "$out_dir"
complete || { echo "build-whereabouts: build finished but $out_dir is incomplete" >&2; exit 1; }
echo "build-whereabouts: done: $out_dir" >&2
echo "$out_dir"
