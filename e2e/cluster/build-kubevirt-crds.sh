#!/usr/bin/env bash
# Builds KubeVirt's CRDs (VirtualMachine, VirtualMachineInstance,
# VirtualMachineInstanceMigration) from the pinned kubevirt.io/kubevirt Go module
# (e2e/cluster/kubevirt, go.mod and go.sum committed): a tiny program calls KubeVirt's own CRD
# constructors and prints the YAML. Cached outside the repo like build-controlplane.sh: the
# key is a hash of the pin, the program and RECIPE; a second run returns at once. Prints the
# path of the CRD YAML on stdout.
set -euo pipefail

# Bump when the build commands below change, so a cached build is redone.
RECIPE=1

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
module="$here/kubevirt"
kubevirt_version=$(awk '$1 == "kubevirt.io/kubevirt" { print $2; exit }' "$module/go.mod")
if [[ -z "$kubevirt_version" ]]; then
  echo "build-kubevirt-crds: no kubevirt.io/kubevirt requirement in $module/go.mod" >&2
  exit 1
fi
pin_hash=$({ cat "$module/go.mod" "$module/go.sum" "$module/main.go"; echo "recipe $RECIPE"; } | sha256sum | cut -c1-12)
cache_root=${IPWARDEN_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/ipwarden}
out_dir="$cache_root/kubevirt-crds-$kubevirt_version-$pin_hash"

mkdir -p "$cache_root"
exec 9>"$cache_root/build-kubevirt-crds.lock"
flock 9
if [[ -s "$out_dir/crds.yaml" ]]; then
  echo "$out_dir/crds.yaml"
  exit 0
fi

echo "build-kubevirt-crds: building KubeVirt $kubevirt_version's CRDs into $out_dir (about 2 minutes on 2 cores)" >&2
staging="$out_dir.partial"
rm -rf "$staging"
mkdir -p "$staging"
(
  cd "$module"
  export CGO_ENABLED=0 GOFLAGS=-mod=readonly
  go build -trimpath -ldflags "-s -w" -o "$staging/kubevirt-crds" .
)
"$staging/kubevirt-crds" >"$staging/crds.yaml"
rm -rf "$out_dir"
mv "$staging" "$out_dir"
[[ -s "$out_dir/crds.yaml" ]] || { echo "build-kubevirt-crds: build finished but $out_dir/crds.yaml is empty" >&2; exit 1; }
echo "build-kubevirt-crds: done: $out_dir/crds.yaml" >&2
echo "$out_dir/crds.yaml"
