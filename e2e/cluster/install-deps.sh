#!/usr/bin/env bash
# Installs the machine packages the tests need and the project cannot build itself:
# Debian's containernetworking-plugins (the real host-local CNI plugin for the harness
# self-test) and prometheus (the real Prometheus server and promtool for the scrape test; the
# test runs its own server process, never the package's service). Idempotent; does nothing
# when everything is present.
set -euo pipefail

packages=()
[[ -x /usr/lib/cni/host-local || -x /opt/cni/bin/host-local ]] || packages+=(containernetworking-plugins)
[[ -x /usr/bin/prometheus && -x /usr/bin/promtool ]] || packages+=(prometheus)

if ((${#packages[@]} == 0)); then
  exit 0
fi
sudo=()
[[ $(id -u) -eq 0 ]] || sudo=(sudo)
echo "install-deps: installing ${packages[*]}" >&2
"${sudo[@]}" apt-get update -qq
DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${packages[@]}"
