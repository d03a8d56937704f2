#!/usr/bin/env bash
# Installs the machine packages the tests need and the project cannot build itself:
# Debian's containernetworking-plugins (the real host-local CNI plugin for the harness
# self-test), prometheus (the real Prometheus server and promtool for the scrape test; the
# test runs its own server process, never the package's service), and for the real nodes runc
# (the OCI runtime of containerd and CRI-O), conmon (CRI-O's container monitor), gcc and
# libc6-dev (CRI-O's pinns helper is C, linked statically), busybox-static (the one binary of
# the node's pause and workload images, built locally: there is no image registry) and
# iptables (kubelet's and portmap's rules), and protobuf-compiler (protoc: the CRI client's
# code is generated from the CRI api.proto when ipwarden is built,
# docs/decisions/0020-cri-client.md). Idempotent; does nothing when everything is present.
set -euo pipefail

packages=()
[[ -x /usr/lib/cni/host-local || -x /opt/cni/bin/host-local ]] || packages+=(containernetworking-plugins)
[[ -x /usr/bin/prometheus && -x /usr/bin/promtool ]] || packages+=(prometheus)
[[ -x /usr/sbin/runc ]] || packages+=(runc)
[[ -x /usr/bin/conmon ]] || packages+=(conmon)
[[ -x /usr/bin/gcc ]] || packages+=(gcc)
dpkg-query -W -f='${Status}' libc6-dev 2>/dev/null | grep -q "ok installed" || packages+=(libc6-dev)
[[ -x /bin/busybox ]] || packages+=(busybox-static)
[[ -x /usr/sbin/iptables ]] || packages+=(iptables)
[[ -x /usr/bin/protoc ]] || packages+=(protobuf-compiler)

if ((${#packages[@]} == 0)); then
  exit 0
fi
sudo=()
[[ $(id -u) -eq 0 ]] || sudo=(sudo)
echo "install-deps: installing ${packages[*]}" >&2
"${sudo[@]}" apt-get update -qq
DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${packages[@]}"
