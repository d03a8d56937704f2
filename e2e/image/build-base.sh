#!/usr/bin/env bash
# Builds the Debian bookworm base of ipwarden's image from Debian's packages with debootstrap
# (minbase, security updates applied, documentation left out), from Debian's mirror as this
# machine's apt is configured, without pulling anything from a container registry
# (docs/decisions/0012-image-from-debian-packages.md). Cached outside the repo: a second run
# prints the cached file at once. Prints the path of the base's root file system as a tar.
#
# `make image` (build-image.sh) builds the release image's stages on it; the real nodes' test
# image (test-image.sh) is this base with a binary built on the host on top.
#
# Needs root (debootstrap and chroot); installs debootstrap from Debian when missing.
# Environment: DEBIAN_MIRROR and DEBIAN_SECURITY_MIRROR (the URIs of Debian's archive and of its
# security archive; by default the ones this machine's apt sources name for bookworm and
# bookworm-security, see apt_mirror below). Exits non-zero when a step fails.
set -euo pipefail

# Bump when the recipe below changes, so the base is built again.
RECIPE=2

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
source "$repo/e2e/cluster/cached-build.sh"

say() { echo "build-base: $*" >&2; }
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

lock_cache build-base.lock
base_dir=$(cache_entry image-base bookworm "$RECIPE" /dev/null)
if [[ -s "$base_dir/rootfs.tar" ]]; then
  echo "$base_dir/rootfs.tar"
  exit 0
fi

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

[[ $(id -u) -eq 0 ]] || die "needs root (debootstrap and chroot): run it with sudo"
if ! command -v debootstrap >/dev/null; then
  say "installing debootstrap from Debian"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap
fi

if [[ ! -s "$base_dir/rootfs.tar" ]]; then
  say "building a Debian bookworm base with debootstrap from $mirror into $base_dir (half a minute to a few, by the mirror)"
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
echo "$base_dir/rootfs.tar"
