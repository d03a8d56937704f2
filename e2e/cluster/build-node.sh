#!/usr/bin/env bash
# Builds what a real node of the e2e harness runs besides ipwarden, from pinned Go modules into
# a cache outside the repo (see cached-build.sh): kubelet from the control plane's Kubernetes
# release (node/kubelet), containerd with its runc shim and ctr (node/containerd), and the
# reference CNI plugins the chart's conflist chains with ipwarden-cni (node/cni-plugins); and
# the node's pause and workload images, made locally (node/images.sh: there is no registry) from
# Debian's static busybox. runc and busybox come from Debian (install-deps.sh). Prints the
# binary directory on stdout; the CNI plugins are in its cni/ subdirectory, the image archives
# in images/.
set -euo pipefail

# Bump when the build commands below change, so cached binaries are rebuilt.
RECIPE=1

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$here/cached-build.sh"
node="$here/node"
source "$node/images.sh"
k8s_version=$(pinned_version "$node/kubelet/go.mod" k8s.io/kubernetes)
containerd_version=$(pinned_version "$node/containerd/go.mod" github.com/containerd/containerd/v2)
plugins_version=$(pinned_version "$node/cni-plugins/go.mod" github.com/containernetworking/plugins)
out_dir=$(cache_entry node "$k8s_version" "$RECIPE" \
  "$node"/kubelet/go.{mod,sum} "$node"/containerd/go.{mod,sum} "$node"/cni-plugins/go.{mod,sum})
outputs=(kubelet containerd containerd-shim-runc-v2 ctr cni/ptp cni/bridge cni/portmap cni/loopback)
# The images are made apart from the binaries (in seconds), so a change of images.sh does not
# rebuild the binaries: their stamp holds the hash of images.sh and of the busybox they hold.
images_stamp=$(cat "$node/images.sh" /bin/busybox | sha256sum | cut -c1-12)

complete() {
  all_present "$out_dir" "${outputs[@]}"
}

images_complete() {
  [[ -s "$out_dir/images/pause.tar" && -s "$out_dir/images/busybox.tar" ]] &&
    [[ "$(cat "$out_dir/images/stamp" 2>/dev/null)" == "$images_stamp" ]]
}

make_images() {
  rm -rf "$out_dir/images.partial"
  mkdir -p "$out_dir/images.partial"
  oci_image "$out_dir/images.partial/pause.tar" "$PAUSE_IMAGE" "$PAUSE_COMMAND"
  oci_image "$out_dir/images.partial/busybox.tar" "$BUSYBOX_IMAGE" "$BUSYBOX_COMMAND"
  echo "$images_stamp" >"$out_dir/images.partial/stamp"
  rm -rf "$out_dir/images"
  mv "$out_dir/images.partial" "$out_dir/images"
}

lock_cache build-node.lock
if complete; then
  images_complete || make_images
  echo "$out_dir"
  exit 0
fi

echo "build-node: building kubelet $k8s_version, containerd $containerd_version and CNI plugins $plugins_version into $out_dir (cold build: about 5 minutes on 2 cores)" >&2
staging=$(staging_for "$out_dir")
export CGO_ENABLED=0 GOFLAGS=-mod=readonly
(
  cd "$node/kubelet"
  nice go build -trimpath -ldflags "-s -w $(k8s_version_flags "$k8s_version")" -o "$staging/" \
    k8s.io/kubernetes/cmd/kubelet
)
(
  cd "$node/containerd"
  ldflags="-s -w -X github.com/containerd/containerd/v2/version.Version=$containerd_version"
  nice go build -trimpath -tags no_btrfs,no_devmapper,no_zfs -ldflags "$ldflags" -o "$staging/" \
    github.com/containerd/containerd/v2/cmd/containerd \
    github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2 \
    github.com/containerd/containerd/v2/cmd/ctr
)
(
  cd "$node/cni-plugins"
  mkdir -p "$staging/cni"
  ldflags="-s -w -X github.com/containernetworking/plugins/pkg/utils/buildversion.BuildVersion=$plugins_version"
  nice go build -trimpath -ldflags "$ldflags" -o "$staging/cni/" \
    github.com/containernetworking/plugins/plugins/main/ptp \
    github.com/containernetworking/plugins/plugins/main/bridge \
    github.com/containernetworking/plugins/plugins/main/loopback \
    github.com/containernetworking/plugins/plugins/meta/portmap
)
publish "$staging" "$out_dir"
make_images
complete || { echo "build-node: build finished but $out_dir is incomplete" >&2; exit 1; }
echo "build-node: done: $out_dir" >&2
echo "$out_dir"
