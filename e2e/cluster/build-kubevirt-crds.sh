#!/usr/bin/env bash
# Builds KubeVirt's CRDs (VirtualMachine, VirtualMachineInstance,
# VirtualMachineInstanceMigration) from the pinned kubevirt.io/kubevirt Go module
# (e2e/cluster/kubevirt, go.mod and go.sum committed): a tiny program calls KubeVirt's own CRD
# constructors and prints the YAML. Cached outside the repo (see cached-build.sh; the program
# is part of the key). Prints the path of the CRD YAML on stdout.
set -euo pipefail

# Bump when the build commands below change, so a cached build is redone.
RECIPE=1

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$here/cached-build.sh"
module="$here/kubevirt"
kubevirt_version=$(pinned_version "$module/go.mod" kubevirt.io/kubevirt)
out_dir=$(cache_entry kubevirt-crds "$kubevirt_version" "$RECIPE" "$module/go.mod" "$module/go.sum" "$module/main.go")

lock_cache build-kubevirt-crds.lock
if [[ -s "$out_dir/crds.yaml" ]]; then
  echo "$out_dir/crds.yaml"
  exit 0
fi

echo "build-kubevirt-crds: building KubeVirt $kubevirt_version's CRDs into $out_dir (about 2 minutes on 2 cores)" >&2
staging=$(staging_for "$out_dir")
(
  cd "$module"
  export CGO_ENABLED=0 GOFLAGS=-mod=readonly
  go build -trimpath -ldflags "-s -w" -o "$staging/kubevirt-crds" .
)
"$staging/kubevirt-crds" >"$staging/crds.yaml"
publish "$staging" "$out_dir"
[[ -s "$out_dir/crds.yaml" ]] || { echo "build-kubevirt-crds: build finished but $out_dir/crds.yaml is empty" >&2; exit 1; }
echo "build-kubevirt-crds: done: $out_dir/crds.yaml" >&2
echo "$out_dir/crds.yaml"
