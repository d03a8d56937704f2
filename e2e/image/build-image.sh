#!/usr/bin/env bash
# Builds the chart's image from the repository's Dockerfile with podman, without pulling
# anything from a container registry, then checks it by running it (docs/install.md, "Building
# the image"; docs/decisions/0012-image-from-debian-packages.md):
#
#   1. a Debian bookworm base built from Debian's packages with debootstrap (minbase, security
#      updates applied, documentation left out) from Debian's mirror as this machine's apt is
#      configured, cached outside the repo and imported as localhost/ipwarden-base;
#   2. a Rust builder image on that base: gcc, libc6-dev and protobuf-compiler (protoc, for
#      the CRI client's generated code) from Debian plus the Rust toolchain
#      the Dockerfile names, copied from this machine's rustup (localhost/ipwarden-rust);
#   3. the Dockerfile, built with those two as RUST_IMAGE and BASE_IMAGE (crates come from the
#      crates registry this machine's cargo uses, over the host's network);
#   4. checks inside the image: `ipwarden --version`, the CNI VERSION call through the
#      `ipwarden-cni` name, the user, the linked libraries and what the chart's init container
#      runs.
#
# Needs root (debootstrap, chroot and rootful podman); installs debootstrap, podman and runc
# from Debian when missing. Idempotent: the base and the builder are built once per recipe,
# and podman's layer cache skips the Dockerfile's steps whose inputs did not change.
# Environment: IMAGE (the tag to build, default localhost/ipwarden:<crate version>);
# DEBIAN_MIRROR and DEBIAN_SECURITY_MIRROR (the URIs of Debian's archive and of its security
# archive; by default the ones this machine's apt sources name for bookworm and
# bookworm-security, see apt_mirror below).
# Exits non-zero when a step or a check fails.
set -euo pipefail

# Bump when the base's or the builder's recipe below changes, so they are built again.
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

# apt_source_files ROOT: the apt source files under ROOT (/ for this machine) in the order apt
# reads them, one a line: etc/apt/sources.list, then etc/apt/sources.list.d's *.list (one-line
# format) and *.sources (deb822) by name. Files apt ignores (*.disabled-by-..., other endings)
# are left out.
apt_source_files() {
  local f
  for f in "${1%/}"/etc/apt/sources.list "${1%/}"/etc/apt/sources.list.d/*; do
    if [[ -f $f && ($f == */sources.list || $f == *.list || $f == *.sources) ]]; then
      echo "$f"
    fi
  done
}

# apt_mirror ROOT SUITE ARCHIVE: the URI of the first enabled `deb` entry of ROOT's apt sources
# whose suites include SUITE (bookworm, bookworm-security) and whose components include main,
# and that is Debian's own ARCHIVE (debian, debian-security): signed by
# debian-archive-keyring, or, without that, with a URI path ending in /ARCHIVE (or in
# /ARCHIVE/<date>T<time>Z, a dated snapshot). Other repositories (other distributions', a
# vendor's for bookworm) fail these tests. A mirror+file: URI is replaced by the first URI of
# its list. Prints nothing when no entry fits.
apt_mirror() {
  local root=${1%/} files
  mapfile -t files < <(apt_source_files "$root")
  ((${#files[@]} > 0)) || return 0
  awk -v root="$root" -v suite="$2" -v archive="$3" '
    function has(list, word,   n, a, i) {
      n = split(list, a, " ")
      for (i = 1; i <= n; i++) if (a[i] == word) return 1
      return 0
    }
    function resolve(uri,   list, line, a) {
      if (uri !~ /^mirror\+file:/) return uri
      list = uri
      sub(/^mirror\+file:(\/\/)?/, "", list)
      while ((getline line < (root list)) > 0) {
        if (line ~ /^[ \t]*(#|$)/) continue
        split(line, a, " ")
        close(root list)
        return a[1]
      }
      close(root list)
      return ""
    }
    function debian(uri, signed,   path) {
      if (signed ~ /debian-archive-keyring/) return 1
      path = uri
      sub(/^[a-z]+:\/\/[^\/]*/, "", path)
      return path ~ ("/" archive "$") || path ~ ("/" archive "/[0-9]+T[0-9]+Z$")
    }
    function consider(types, uris, suites, components, signed, enabled,   u, uri) {
      if (found || tolower(enabled) == "no" || !has(types, "deb") || !has(suites, suite) || !has(components, "main")) return
      split(uris, u, " ")
      uri = resolve(u[1])
      sub(/\/+$/, "", uri)
      if (uri ~ /^https?:\/\// && debian(uri, signed)) {
        print uri
        found = 1
      }
    }
    # The end of a deb822 stanza.
    function stanza() {
      if (fields) consider(f["types"], f["uris"], f["suites"], f["components"], f["signed-by"], f["enabled"])
      delete f
      fields = 0
    }
    FNR == 1 {
      stanza()
      deb822 = FILENAME ~ /\.sources$/
    }
    deb822 {
      if ($0 ~ /^[ \t]*#/) next
      if ($0 ~ /^[ \t]*$/) {
        stanza()
        next
      }
      if ($0 ~ /^[ \t]/ || !index($0, ":")) next # a continuation line (an inline key, say)
      i = index($0, ":")
      key = tolower(substr($0, 1, i - 1))
      gsub(/[ \t]/, "", key)
      f[key] = substr($0, i + 1)
      gsub(/^[ \t]+|[ \t]+$/, "", f[key])
      fields++
      next
    }
    # One-line format: deb [OPTION=VALUE ...] URI SUITE COMPONENT...
    {
      sub(/#.*/, "")
      if ($1 != "deb") next
      options = ""
      i = 2
      if ($2 ~ /^\[/) {
        for (; i <= NF; i++) {
          options = options " " $i
          if ($i ~ /\]$/) break
        }
        i++
      }
      components = ""
      for (j = i + 2; j <= NF; j++) components = components " " $j
      consider("deb", $i, $(i + 1), components, options, "")
    }
    END { stanza() }
  ' "${files[@]}"
}

# Debian's archive and its security archive: from the environment, else as this machine's apt
# is configured. The base built from them keeps them in its apt sources, so the builder's
# packages come from there too; a cached base keeps the ones it was built with.
apt_sources=$(apt_source_files /)
if [[ -n $apt_sources ]]; then
  apt_read="read: ${apt_sources//$'\n'/, }"
else
  apt_read="none of /etc/apt/sources.list, /etc/apt/sources.list.d/*.list, /etc/apt/sources.list.d/*.sources exists"
fi
mirror=${DEBIAN_MIRROR:-$(apt_mirror / bookworm debian)}
[[ -n $mirror ]] ||
  die "no Debian archive for bookworm (suite bookworm, component main) in this machine's apt sources ($apt_read): set DEBIAN_MIRROR to the URI of a Debian mirror"
security_mirror=${DEBIAN_SECURITY_MIRROR:-$(apt_mirror / bookworm-security debian-security)}
[[ -n $security_mirror ]] ||
  die "no Debian security archive (suite bookworm-security, component main) in this machine's apt sources ($apt_read): set DEBIAN_SECURITY_MIRROR to the URI of Debian's security archive or a mirror of it"

[[ $(id -u) -eq 0 ]] || die "needs root (debootstrap, chroot and rootful podman): run it with sudo"

missing=()
command -v debootstrap >/dev/null || missing+=(debootstrap)
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

# 1. The base.
base_dir=$(cache_entry image-base bookworm "$RECIPE" /dev/null)
base_image=localhost/ipwarden-base:bookworm-${base_dir##*-}
if [[ ! -s "$base_dir/rootfs.tar" ]]; then
  say "building a Debian bookworm base with debootstrap from $mirror into $base_dir (about 2 minutes)"
  start=$SECONDS
  staging=$(staging_for "$base_dir")
  rootfs=$staging/rootfs
  debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >"$staging/debootstrap.log" 2>&1 ||
    die "debootstrap failed, see $staging/debootstrap.log"
  rm -f "$rootfs/etc/apt/sources.list"
  cat >"$rootfs/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $mirror
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: $security_mirror
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  # Packages installed later (the builder's) leave out documentation too; copyright files stay.
  cat >"$rootfs/etc/dpkg/dpkg.cfg.d/no-docs" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
EOF
  {
    chroot "$rootfs" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive chroot "$rootfs" apt-get upgrade -y -qq
    chroot "$rootfs" apt-get clean
  } >"$staging/upgrade.log" 2>&1 || die "apt-get upgrade in the base failed, see $staging/upgrade.log"
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* \
    "$rootfs"/usr/share/locale/*
  find "$rootfs/usr/share/doc" -mindepth 1 ! -type d ! -name copyright -delete
  tar -C "$rootfs" --numeric-owner -cf "$staging/rootfs.tar" .
  rm -rf "$rootfs"
  publish "$staging" "$base_dir"
  say "base built in $((SECONDS - start))s"
fi
if ! podman image exists "$base_image"; then
  podman import --quiet --change 'CMD ["bash"]' "$base_dir/rootfs.tar" "$base_image" >/dev/null
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
