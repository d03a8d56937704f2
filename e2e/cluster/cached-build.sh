# Sourced by the build-*.sh scripts, which build something from a pinned Go module (go.mod and
# go.sum committed) into a cache outside the repo. The cache directory's name holds the pinned
# version and a hash of the pin, of the script's other inputs and of its RECIPE, so a second
# run returns at once and a changed pin or recipe builds again. A build goes into a staging
# directory that replaces the cached one only when complete, under a lock, so an interrupted
# or concurrent run never leaves a half-built cache entry behind.

# The name the messages start with: the sourcing script's, without ".sh".
build_name=$(basename "$0" .sh)
cache_root=${IPWARDEN_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/ipwarden}

# pinned_version GO_MOD MODULE: the version GO_MOD requires MODULE at, on a require line of
# its own or inside a require block. Exits naming both when there is none.
pinned_version() {
  local version
  version=$(awk -v m="$2" '$1 == "require" && $2 == m { print $3; exit } $1 == m { print $2; exit }' "$1")
  if [[ -z "$version" ]]; then
    echo "$build_name: no $2 requirement in $1" >&2
    exit 1
  fi
  echo "$version"
}

# cache_entry NAME VERSION RECIPE FILE...: the cache directory of this build,
# NAME-VERSION-<first 12 hex digits of the sha256 of the FILEs and the recipe>.
cache_entry() {
  local name=$1 version=$2 recipe=$3 hash
  shift 3
  hash=$({ cat "$@"; echo "recipe $recipe"; } | sha256sum | cut -c1-12)
  echo "$cache_root/$name-$version-$hash"
}

# all_present DIR FILE...: whether every FILE is a non-empty file in DIR (a build's outputs).
all_present() {
  local dir=$1 file
  shift
  for file in "$@"; do [[ -s "$dir/$file" ]] || return 1; done
}

# lock_cache LOCK: holds "$cache_root/LOCK" until the script exits, so concurrent runs build
# once and the others then find the result.
lock_cache() {
  mkdir -p "$cache_root"
  exec 9>"$cache_root/$1"
  flock 9
}

# staging_for ENTRY: an empty staging directory for ENTRY, printed.
staging_for() {
  rm -rf "$1.partial"
  mkdir -p "$1.partial"
  echo "$1.partial"
}

# publish STAGING ENTRY: the finished build becomes the cache entry.
publish() {
  rm -rf "$2"
  mv "$1" "$2"
}

# k8s_version_flags VERSION: the -ldflags -X settings that make a Kubernetes command built from
# its module report VERSION (`kubectl version`, the apiserver's /version, kubelet's Node status),
# as the release build's would.
k8s_version_flags() {
  local minor build_date pkg flags=""
  minor=$(echo "$1" | cut -d. -f2)
  build_date=$(date -u +%Y-%m-%dT%H:%M:%SZ)
  for pkg in k8s.io/client-go/pkg/version k8s.io/component-base/version; do
    flags+=" -X '$pkg.gitVersion=$1' -X '$pkg.gitMajor=1' -X '$pkg.gitMinor=$minor'"
    flags+=" -X '$pkg.gitTreeState=clean' -X '$pkg.buildDate=$build_date'"
  done
  echo "$flags"
}
