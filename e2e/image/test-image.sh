#!/usr/bin/env bash
# Writes the real nodes' test image of ipwarden as an OCI image archive for `ctr images import`
# (there is no image registry), from the runtime stage of the repository's Dockerfile done by
# hand: the Debian base `make image` builds on (build-base.sh, cached), then one layer with the
# given binary as /usr/local/bin/ipwarden and the `ipwarden-cni` link to it, run as 65532:65532
# with ipwarden as its entry point (docs/testing.md, "The chart on a real node", says how this
# differs from the release image).
#
#   test-image.sh BINARY NAME OUT
#
# BINARY: an ipwarden built on this host (a Debian bookworm, as the base, so the glibc it links
# is the base's); its debug information is left out of the image. NAME: the image's name, e.g.
# localhost/ipwarden:e2e. OUT: the archive to write. Needs root only when the base is not
# cached yet (build-base.sh).
set -euo pipefail

[[ $# -eq 3 ]] || {
  echo "usage: test-image.sh BINARY NAME OUT" >&2
  exit 2
}
binary=$1 name=$2 out=$3
[[ -x $binary ]] || {
  echo "test-image: $binary is not an executable" >&2
  exit 1
}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
base_tar=$(bash "$here/build-base.sh")

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/layout/blobs/sha256" "$work/rootfs/usr/local/bin"
strip --strip-debug -o "$work/rootfs/usr/local/bin/ipwarden" "$binary"
ln -s ipwarden "$work/rootfs/usr/local/bin/ipwarden-cni"
# The layer's directories replace the base's: the base's modes, whatever this shell's umask.
chmod 0755 "$work/rootfs" "$work/rootfs/usr" "$work/rootfs/usr/local" "$work/rootfs/usr/local/bin"
chmod 0755 "$work/rootfs/usr/local/bin/ipwarden"
# The image's architecture is this host's (Debian's names are OCI's for amd64 and arm64).
arch=$(dpkg --print-architecture)

# blob FILE: copies FILE into the layout's blob store under its digest; prints "sha256:HEX SIZE".
blob() {
  local hex size
  hex=$(sha256sum "$1" | cut -d' ' -f1)
  size=$(stat -c %s "$1")
  cp "$1" "$work/layout/blobs/sha256/$hex"
  echo "sha256:$hex $size"
}

tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$work/rootfs" -cf "$work/binary.tar" .
read -r base base_size < <(blob "$base_tar")
read -r layer layer_size < <(blob "$work/binary.tar")
cat >"$work/config.json" <<JSON
{"architecture":"$arch","os":"linux",
 "config":{"User":"65532:65532","Entrypoint":["/usr/local/bin/ipwarden"],
           "Env":["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
           "Labels":{"org.opencontainers.image.title":"ipwarden","org.opencontainers.image.description":"ipwarden test image (e2e/image/test-image.sh)"}},
 "rootfs":{"type":"layers","diff_ids":["$base","$layer"]}}
JSON
read -r config config_size < <(blob "$work/config.json")
layer_type=application/vnd.oci.image.layer.v1.tar
cat >"$work/manifest.json" <<JSON
{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json",
 "config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"$config","size":$config_size},
 "layers":[{"mediaType":"$layer_type","digest":"$base","size":$base_size},
           {"mediaType":"$layer_type","digest":"$layer","size":$layer_size}]}
JSON
read -r manifest manifest_size < <(blob "$work/manifest.json")
cat >"$work/layout/index.json" <<JSON
{"schemaVersion":2,"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"$manifest","size":$manifest_size,
 "platform":{"architecture":"$arch","os":"linux"},
 "annotations":{"io.containerd.image.name":"$name","org.opencontainers.image.ref.name":"${name##*:}"}}]}
JSON
echo '{"imageLayoutVersion":"1.0.0"}' >"$work/layout/oci-layout"
mkdir -p "$(dirname "$out")"
tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$work/layout" -cf "$out.partial" .
mv "$out.partial" "$out"
