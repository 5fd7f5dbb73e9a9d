#!/usr/bin/env bash
# Builds the husk guest kernel (an uncompressed vmlinux ELF) from Debian's
# linux-source-6.1, our config fragment and our patches, and caches it outside
# the checkout under a key derived from all of them. Prints the vmlinux path as
# the last line of stdout. A second run with nothing changed takes seconds.
#
#   kernel-config/build.sh            build (or reuse) and print the path
#   HUSK_CACHE=/some/dir build.sh     cache somewhere else (default ~/.cache/husk)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache="${HUSK_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/husk}"
packages=(linux-source-6.1 flex bison bc libelf-dev make gcc xz-utils)

log() { echo "kernel-config: $*" >&2; }

missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    if [[ $(id -u) -ne 0 ]]; then
        log "missing packages: ${missing[*]}; run: sudo apt-get install ${missing[*]}"
        exit 1
    fi
    log "installing ${missing[*]}"
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi

tarball=/usr/src/linux-source-6.1.tar.xz
version="$(dpkg-query -W -f='${Version}' linux-source-6.1)"
key="$({
    echo "$version"
    cat "$here/build.sh" "$here/husk.config"
    cat "$here"/patches/*.patch
} | sha256sum | cut -c1-16)"
out="$cache/kernel/$key"

cached() {
    [[ -f "$out/vmlinux" ]] || return 1
    log "cached: $out/vmlinux"
    echo "$out/vmlinux"
}
cached && exit 0

# One build of a key at a time: a second caller (`make run` beside `make test`)
# waits for the first and takes its result, instead of both sharing one build
# directory. The lock is released when this script exits.
mkdir -p "$cache/kernel"
exec 9>"$cache/kernel/$key.lock"
if ! flock -n 9; then
    log "another build of this kernel is running; waiting for it"
    flock 9
fi
cached && exit 0

work="$cache/kernel/build-$key"
rm -rf "$work"
mkdir -p "$work"
log "extracting linux-source $version"
tar -C "$work" -xf "$tarball"
src="$work/linux-source-6.1"

for p in "$here"/patches/*.patch; do
    log "applying $(basename "$p")"
    patch -d "$src" -p1 --forward --quiet <"$p"
done

cd "$src"
export KBUILD_BUILD_TIMESTAMP="1970-01-01" KBUILD_BUILD_USER=husk KBUILD_BUILD_HOST=husk
make -s tinyconfig >&2
scripts/kconfig/merge_config.sh -m -O . .config "$here/husk.config" >/dev/null
make -s olddefconfig >&2

# Every line of the fragment must have survived dependency resolution; a silently
# dropped option is how a guest ends up without its console or root device.
bad=0
while IFS= read -r line; do
    if [[ $line =~ ^(CONFIG_[A-Z0-9_]+)=(.*)$ ]]; then
        grep -qxF "$line" .config || { log "config lost: $line (got: $(grep "^${BASH_REMATCH[1]}=" .config || echo unset))"; bad=1; }
    elif [[ $line =~ ^#\ (CONFIG_[A-Z0-9_]+)\ is\ not\ set$ ]]; then
        ! grep -q "^${BASH_REMATCH[1]}=" .config || { log "config should be off: ${BASH_REMATCH[1]}"; bad=1; }
    fi
done <"$here/husk.config"
((bad == 0)) || exit 1

log "building vmlinux with $(nproc) jobs"
make -s -j"$(nproc)" vmlinux >&2

mkdir -p "$out.tmp"
cp vmlinux "$out.tmp/vmlinux"
cp .config "$out.tmp/config"
rm -rf "$out"
mv "$out.tmp" "$out"
cd /
rm -rf "$work"
log "built: $out/vmlinux"
echo "$out/vmlinux"
