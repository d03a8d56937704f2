# Sourced by build-node.sh: the real nodes' two container images, made locally as OCI image
# archives (there is no image registry to pull from) from Debian's static busybox, for
# `ctr images import`. Both run the same one-layer image; only their names and commands differ.

# The pause image's command: a sandbox's process does nothing until it is killed. containerd
# stops a sandbox's container with SIGKILL, so it needs no signal handling.
PAUSE_IMAGE=localhost/ipwarden-e2e/pause:1
PAUSE_COMMAND='["/bin/sleep","2147483647"]'
# The workload image: a shell and the usual tools (sleep, ip, cat); pods give their command.
BUSYBOX_IMAGE=localhost/ipwarden-e2e/busybox:1
BUSYBOX_COMMAND='["/bin/sh"]'

# blob DIR FILE: moves FILE into DIR's blob store under its digest; prints "sha256:HEX SIZE".
blob() {
  local hex size
  hex=$(sha256sum "$2" | cut -d' ' -f1)
  size=$(stat -c %s "$2")
  mkdir -p "$1/blobs/sha256"
  mv "$2" "$1/blobs/sha256/$hex"
  echo "sha256:$hex $size"
}

# oci_image OUT NAME COMMAND: writes the OCI image archive OUT of image NAME running COMMAND
# (a JSON array), whose one layer holds /bin/busybox and its applet links.
oci_image() {
  local out=$1 name=$2 command=$3 work
  work=$(mktemp -d)
  mkdir -p "$work/rootfs/bin" "$work/rootfs/proc" "$work/rootfs/sys" "$work/rootfs/dev" \
    "$work/rootfs/etc" "$work/rootfs/tmp" "$work/layout"
  cp /bin/busybox "$work/rootfs/bin/busybox"
  local applet
  for applet in sh sleep ip cat ls hostname wget nc; do ln -s busybox "$work/rootfs/bin/$applet"; done
  tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$work/rootfs" -cf "$work/layer.tar" .
  local layer diff_id layer_size
  read -r layer layer_size < <(blob "$work/layout" "$work/layer.tar")
  diff_id=$layer
  printf '{"architecture":"amd64","os":"linux","config":{"Entrypoint":%s,"Env":["PATH=/bin"]},"rootfs":{"type":"layers","diff_ids":["%s"]}}' \
    "$command" "$diff_id" >"$work/config.json"
  local config config_size
  read -r config config_size < <(blob "$work/layout" "$work/config.json")
  printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"%s","size":%s},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar","digest":"%s","size":%s}]}' \
    "$config" "$config_size" "$layer" "$layer_size" >"$work/manifest.json"
  local manifest manifest_size
  read -r manifest manifest_size < <(blob "$work/layout" "$work/manifest.json")
  printf '{"schemaVersion":2,"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"%s","size":%s,"platform":{"architecture":"amd64","os":"linux"},"annotations":{"io.containerd.image.name":"%s","org.opencontainers.image.ref.name":"%s"}}]}' \
    "$manifest" "$manifest_size" "$name" "${name##*:}" >"$work/layout/index.json"
  echo '{"imageLayoutVersion":"1.0.0"}' >"$work/layout/oci-layout"
  tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$work/layout" -cf "$out" .
  rm -rf "$work"
}
