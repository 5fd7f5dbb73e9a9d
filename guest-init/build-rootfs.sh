#!/usr/bin/env bash
# Builds the guest root file system: guest-init (static, musl) as /init plus
# Debian's static busybox, packed into an uncompressed initramfs (the guest
# kernel has no decompressors: decompressing in an emulated guest is slow).
# Prints the path of the archive as the last line of stdout.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out_dir="${HUSK_OUT:-$root/target/husk}"
target=x86_64-unknown-linux-musl

log() { echo "rootfs: $*" >&2; }

if ! dpkg-query -W -f='${Status}' busybox-static 2>/dev/null | grep -q "ok installed"; then
    if [[ $(id -u) -ne 0 ]]; then
        log "missing package busybox-static; run: sudo apt-get install busybox-static"
        exit 1
    fi
    log "installing busybox-static"
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends busybox-static >&2
fi

cargo build --quiet --release --locked --manifest-path "$root/Cargo.toml" \
    -p guest-init --target "$target" >&2
bin="$root/target/$target/release"
mkdir -p "$out_dir"
"$bin/husk-mkinitramfs" "$bin/guest-init" /bin/busybox "$out_dir/initramfs.cpio"
log "built: $out_dir/initramfs.cpio ($(stat -c %s "$out_dir/initramfs.cpio") bytes)"
echo "$out_dir/initramfs.cpio"
