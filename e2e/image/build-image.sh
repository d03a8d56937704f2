#!/usr/bin/env bash
# Builds the chart's image from the repository's Dockerfile with podman, without pulling
# anything from a container registry, then checks it by running it (docs/install.md, "Building
# the image"; docs/decisions/0012-image-from-debian-packages.md):
#
#   1. a Debian bookworm base built from Debian's packages with debootstrap (build-base.sh:
#      minbase, security updates applied, documentation left out, from Debian's mirror as this
#      machine's apt is configured, cached outside the repo), imported as localhost/ipwarden-base;
#   2. a Rust builder image on that base: gcc, libc6-dev and protobuf-compiler (protoc, for
#      the CRI client's generated code) from Debian plus the Rust toolchain
#      the Dockerfile names, copied from this machine's rustup (localhost/ipwarden-rust);
#   3. the Dockerfile, built with those two as RUST_IMAGE and BASE_IMAGE (crates come from the
#      crates registry this machine's cargo uses, over the host's network);
#   4. checks inside the image: `ipwarden --version`, the CNI VERSION call through the
#      `ipwarden-cni` name, the user, the linked libraries and what the chart's init container
#      runs.
#
# Needs root (debootstrap, chroot and rootful podman); installs podman and runc from Debian when
# missing (build-base.sh installs debootstrap). Idempotent: the base and the builder are built
# once per recipe, and podman's layer cache skips the Dockerfile's steps whose inputs did not
# change. Environment: IMAGE (the tag to build, default localhost/ipwarden:<crate version>);
# DEBIAN_MIRROR and DEBIAN_SECURITY_MIRROR (see build-base.sh, which builds the base). Exits
# non-zero when a step or a check fails.
set -euo pipefail

# Bump when the builder's recipe below changes, so it is built again.
RECIPE=2

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
source "$repo/e2e/cluster/cached-build.sh"

version=$(awk -F'"' '/^\[package\]/ { p = 1 } p && $1 ~ /^version *= */ { print $2; exit }' "$repo/Cargo.toml")
image=${IMAGE:-localhost/ipwarden:$version}

say() { echo "build-image: $*" >&2; }
die() {
  say "$*"
  exit 1
}

[[ $(id -u) -eq 0 ]] || die "needs root (debootstrap, chroot and rootful podman): run it with sudo"

missing=()
command -v podman >/dev/null || missing+=(podman)
command -v runc >/dev/null || missing+=(runc)
if ((${#missing[@]} > 0)); then
  say "installing ${missing[*]} from Debian"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The Rust the Dockerfile's default builder image names (rust:1.95-...) must be the host's, whose
# toolchain goes into the builder image.
wanted_rust=$(sed -n 's/^ARG RUST_IMAGE=rust:\([0-9.]*\)-.*/\1/p' "$repo/Dockerfile")
host_rust=$(rustc --version | awk '{ print $2 }')
[[ -n "$wanted_rust" ]] || die "no 'ARG RUST_IMAGE=rust:<version>-...' line in $repo/Dockerfile"
[[ "$host_rust" == "$wanted_rust" || "$host_rust" == "$wanted_rust".* ]] ||
  die "the Dockerfile builds with Rust $wanted_rust but rustc here is $host_rust"

# Podman's flags for this machine. crun refuses to start containers when the cgroup v2
# hierarchy of a hybrid cgroup layout has controllers ("cgroups in hybrid mode not
# supported"); runc starts them. Podman defaults a container's open-file limit to 1048576 and
# takes its process limit down to 32768 itself; without CAP_SYS_RESOURCE neither can go above
# the host's hard limits, so the limits are set to what the host allows.
podman=(podman)
unified=/sys/fs/cgroup/unified/cgroup.controllers
if [[ -r $unified && -n $(cat "$unified") && $(podman info --format '{{.Host.OCIRuntime.Name}}') == crun ]]; then
  say "hybrid cgroups with controllers on the v2 hierarchy ($(cat "$unified")): running containers with runc"
  podman+=(--runtime runc)
fi
nofile=$(ulimit -Hn)
[[ $nofile == unlimited || $nofile -gt 1048576 ]] && nofile=1048576
nproc=$(ulimit -Hu)
[[ $nproc == unlimited || $nproc -gt 32768 ]] && nproc=32768
limits=(--ulimit "nofile=$nofile:$nofile" --ulimit "nproc=$nproc:$nproc")

lock_cache build-image.lock

# drop_others REPOSITORY KEEP: removes REPOSITORY's other tags (older recipes or toolchains),
# so podman's store keeps one base and one builder.
drop_others() {
  local others
  mapfile -t others < <(podman images --filter "reference=$1" --format '{{.Repository}}:{{.Tag}}' | grep -vxF "$2")
  ((${#others[@]} == 0)) || podman rmi "${others[@]}" >/dev/null || say "could not remove ${others[*]}"
}

# 1. The base (build-base.sh, cached).
base_tar=$(bash "$here/build-base.sh")
base_dir=$(dirname "$base_tar")
base_image=localhost/ipwarden-base:bookworm-${base_dir##*-}
if ! podman image exists "$base_image"; then
  podman import --quiet --change 'CMD ["bash"]' "$base_tar" "$base_image" >/dev/null
  drop_others localhost/ipwarden-base "$base_image"
fi
say "base: $base_image"

# cargo_registry_config CONFIG: the tables of the cargo configuration file CONFIG that say where
# crates come from ([source.*], the registries' [registries.*], [registry], [net]), without
# token lines; nothing when CONFIG does not exist. Keys written dotted outside these tables
# (source.crates-io.replace-with = ...) are not seen.
cargo_registry_config() {
  [[ -f $1 ]] || return 0
  awk '
    /^[ \t]*\[/ {
      table = $0
      gsub(/[ \t"]/, "", table)
      keep = table ~ /^\[(source|registries)\./ || table ~ /^\[(registry|net)\]/
    }
    keep && $0 !~ /^[ \t]*token[ \t]*=/
  ' "$1"
}

# 2. The builder.
sysroot=$(rustc --print sysroot)
# Certificate authorities this machine trusts beyond Debian's (a TLS-inspecting proxy's, say):
# the builder trusts them too, so cargo reaches the crates registry as the host does. Only the
# builder image carries them, never the image the Dockerfile builds.
local_ca=/usr/local/share/ca-certificates
local_ca_id=$(find "$local_ca" -type f -name '*.crt' 2>/dev/null | sort | xargs -r cat | sha256sum | cut -c1-12)
# Where this machine's cargo takes crates from: the registry and source-replacement tables of
# its configuration ($CARGO_HOME/config.toml, or the older config), so the builder's cargo uses
# the same registry or mirror. Without them cargo uses its default registry, here and in the
# builder alike. Sources on this machine's disk (directory, local-registry) cannot be reached
# from the builder, so a configuration naming them is not carried over.
cargo_home=${CARGO_HOME:-$HOME/.cargo}
cargo_config_file=$cargo_home/config.toml
[[ -f $cargo_config_file ]] || cargo_config_file=$cargo_home/config
cargo_config=$(cargo_registry_config "$cargo_config_file")
if grep -Eq '^[[:space:]]*(directory|local-registry)[[:space:]]*=' <<<"$cargo_config"; then
  say "$cargo_config_file names sources on this machine's disk, which the builder cannot reach: the builder's cargo uses its default registry"
  cargo_config=
fi
[[ -z $cargo_config ]] || say "the builder's cargo takes crates as $cargo_config_file says"
rust_id=$(rustc -vV | sha256sum | cut -c1-12)
# The builder's name changes with its inputs; a host without a cargo configuration adds none.
builder_inputs="$base_image $rust_id $local_ca_id recipe $RECIPE"
[[ -z $cargo_config ]] || builder_inputs+=" cargo $(sha256sum <<<"$cargo_config" | cut -c1-12)"
rust_image=localhost/ipwarden-rust:$host_rust-bookworm-$(echo "$builder_inputs" | sha256sum | cut -c1-12)
if ! podman image exists "$rust_image"; then
  say "building the Rust $host_rust builder image $rust_image from $sysroot"
  start=$SECONDS
  context=$(mktemp -d "$cache_root/image-rust-context.XXXXXX")
  trap 'rm -rf "$context"' EXIT
  mkdir -p "$context/rust/bin"
  # Hard links where the toolchain is on the cache's file system, so nothing is copied twice.
  cp -al "$sysroot/bin/cargo" "$sysroot/bin/rustc" "$sysroot/lib" "$context/rust/bin/" 2>/dev/null ||
    cp -a "$sysroot/bin/cargo" "$sysroot/bin/rustc" "$sysroot/lib" "$context/rust/bin/"
  mv "$context/rust/bin/lib" "$context/rust/lib"
  mkdir -p "$context/local-ca"
  [[ ! -d $local_ca ]] || cp -a "$local_ca/." "$context/local-ca/"
  cat >"$context/Containerfile" <<'EOF'
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
COPY local-ca/ /usr/local/share/ca-certificates/
RUN apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends ca-certificates gcc libc6-dev protobuf-compiler \
    && rm -rf /var/lib/apt/lists/*
COPY rust /usr/local/rust
ENV PATH=/usr/local/rust/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
EOF
  if [[ -n $cargo_config ]]; then
    printf '%s\n' "$cargo_config" >"$context/cargo-config.toml"
    cat >>"$context/Containerfile" <<'EOF'
ENV CARGO_HOME=/usr/local/cargo
COPY cargo-config.toml /usr/local/cargo/config.toml
EOF
  fi
  "${podman[@]}" build --pull=never --network=host "${limits[@]}" --build-arg "BASE_IMAGE=$base_image" \
    -t "$rust_image" "$context" >&2
  rm -rf "$context"
  trap - EXIT
  drop_others localhost/ipwarden-rust "$rust_image"
  say "builder built in $((SECONDS - start))s"
fi
say "builder: $rust_image"

# 3. The image, from the Dockerfile users run.
say "building $image from $repo/Dockerfile (a release build: several minutes the first time)"
start=$SECONDS
"${podman[@]}" build --pull=never --network=host "${limits[@]}" \
  --build-arg "RUST_IMAGE=$rust_image" --build-arg "BASE_IMAGE=$base_image" --build-arg "VERSION=$version" \
  -t "$image" -f "$repo/Dockerfile" "$repo" >&2
say "image built in $((SECONDS - start))s: $image, $(podman images --format '{{.Size}}' "$image")"

# 4. Checks, each a real run of the image.
failed=0
# check WHAT EXPECTED ACTUAL: EXPECTED is a grep -E pattern ACTUAL must match.
check() {
  if grep -Eq -- "$2" <<<"$3"; then
    say "ok: $1"
  else
    say "FAILED: $1: expected /$2/, got: $3"
    failed=1
  fi
}
run() { "${podman[@]}" run --rm -i --network=none "${limits[@]}" "$@" 2>&1 || true; }

check "ipwarden --version" "^ipwarden $version\$" "$(run "$image" --version)"
chart_cni=$(awk '$1 == "cniVersion:" { print $2; exit }' "$repo/charts/ipwarden/values.yaml")
cni_out=$(run -e CNI_COMMAND=VERSION --entrypoint /usr/local/bin/ipwarden-cni "$image" <<<'{"cniVersion":"1.0.0"}')
check "ipwarden-cni VERSION answers for 1.0.0" '^\{"cniVersion":"1\.0\.0","supportedVersions":\[' "$cni_out"
check "ipwarden-cni supports the chart's cniVersion $chart_cni" "\"supportedVersions\":\[[^]]*\"$chart_cni\"" "$cni_out"
check "ipwarden-cni is a link to ipwarden" '^ipwarden$' "$(run --entrypoint readlink "$image" /usr/local/bin/ipwarden-cni)"
# shellcheck disable=SC2016 # expanded by the container's shell
check "runs as 65532:65532" '^65532:65532$' "$(run --entrypoint /bin/sh "$image" -c 'echo "$(id -u):$(id -g)"')"
check "image config: user and entrypoint" '^65532:65532 \[/usr/local/bin/ipwarden\]$' \
  "$(podman image inspect --format '{{.Config.User}} {{.Config.Entrypoint}}' "$image")"
ldd_out=$(run --entrypoint ldd "$image" /usr/local/bin/ipwarden)
check "every library ipwarden links resolves in the image" 'libc\.so\.6 => /' "$ldd_out"
if grep -q 'not found' <<<"$ldd_out"; then
  say "FAILED: unresolved libraries: $ldd_out"
  failed=1
fi
# shellcheck disable=SC2016 # expanded by the container's shell
check "the agent's init container has /bin/sh, cmp, cp, sync and mv" '^(/usr)?/bin/cmp (/usr)?/bin/cp (/usr)?/bin/sync (/usr)?/bin/mv$' \
  "$(run --entrypoint /bin/sh "$image" -c 'echo $(command -v cmp) $(command -v cp) $(command -v sync) $(command -v mv)')"

if ((failed)); then
  die "image $image failed its checks"
fi
say "done: $image"
