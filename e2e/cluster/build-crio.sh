#!/usr/bin/env bash
# Builds CRI-O, the second runtime a real node of the e2e harness can run (`--real-nodes` with
# `--runtime crio`), from its pinned Go module (node/crio) into a cache outside the repo (see
# cached-build.sh): the crio daemon and copyimg (the image copier of CRI-O's own test suite,
# which puts the node's locally made images into CRI-O's storage: there is no registry), both
# without cgo, with the build tags that drop what needs C libraries (gpgme, btrfs, ostree); and
# pinns, CRI-O's namespace pinning helper, which is C, compiled statically from the same
# module's sources. conmon and runc come from Debian (install-deps.sh). Prints the binary
# directory on stdout.
set -euo pipefail

# Bump when the build commands below change, so cached binaries are rebuilt.
RECIPE=1

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$here/cached-build.sh"
module="$here/node/crio"
crio_version=$(pinned_version "$module/go.mod" github.com/cri-o/cri-o)
out_dir=$(cache_entry crio "$crio_version" "$RECIPE" "$module"/go.{mod,sum})
outputs=(crio copyimg pinns)

complete() {
  all_present "$out_dir" "${outputs[@]}"
}

lock_cache build-crio.lock
if complete; then
  echo "$out_dir"
  exit 0
fi

echo "build-crio: building CRI-O $crio_version into $out_dir (cold build: about 1.5 minutes on 2 cores, with its modules downloaded)" >&2
staging=$(staging_for "$out_dir")
export CGO_ENABLED=0 GOFLAGS=-mod=readonly
(
  cd "$module"
  nice go build -trimpath -tags "containers_image_openpgp containers_image_ostree_stub exclude_graphdriver_btrfs" \
    -ldflags "-s -w" -o "$staging/" \
    github.com/cri-o/cri-o/cmd/crio \
    github.com/cri-o/cri-o/test/copyimg
  go mod download github.com/cri-o/cri-o
  source_dir=$(go list -m -f '{{.Dir}}' github.com/cri-o/cri-o)
  nice gcc -std=c99 -O2 -Wall -Wextra -static -o "$staging/pinns" "$source_dir"/pinns/src/*.c
)
publish "$staging" "$out_dir"
complete || { echo "build-crio: build finished but $out_dir is incomplete" >&2; exit 1; }
echo "build-crio: done: $out_dir" >&2
echo "$out_dir"
