#!/usr/bin/env bash
# Builds the guest root file system in two forms from the same tree:
# guest-init (static, musl) as /init plus Debian's static busybox.
#   initramfs.cpio  uncompressed newc initramfs (the guest kernel has no
#                   decompressors: decompressing in an emulated guest is slow)
#   rootfs.ext4     ext4 image for a virtio-block root (root=/dev/vda), made
#                   with mkfs.ext4 -d and debugfs: no root privileges needed
# Prints the path of the one asked for (default: initramfs) as its last line.
#
#   guest-init/build-rootfs.sh [initramfs|ext4]
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out_dir="${HUSK_OUT:-$root/target/husk}"
target=x86_64-unknown-linux-musl
want="${1:-initramfs}"
ext4_size=64M

log() { echo "rootfs: $*" >&2; }

missing=()
for p in busybox-static bash-static e2fsprogs; do
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

# rust-toolchain.toml names the musl target, but rustup adds it only when it
# installs the toolchain: a machine that already had 1.95.0 lacks it.
if command -v rustup >/dev/null &&
    ! (cd "$root" && rustup target list --installed) | grep -qx "$target"; then
    log "adding the Rust target $target (guest-init is a static binary)"
    (cd "$root" && rustup target add "$target") >&2
fi

# The `guest` profile is release with panic=unwind: a bug in one agent
# request must end that request, not PID 1 (and with it the guest).
cargo build --quiet --profile guest --locked --manifest-path "$root/Cargo.toml" \
    -p guest-init --target "$target" >&2
bin="$root/target/$target/guest"
mkdir -p "$out_dir"
exec 9>"$out_dir/.lock"
flock 9

# bash (static) as /bin/bash: what E2B-style clients run commands with.
bash=/bin/bash-static
"$bin/husk-mkrootfs" "$bin/guest-init" /bin/busybox cpio "$out_dir/initramfs.cpio" "$bash"

stage="$out_dir/rootfs.stage"
"$bin/husk-mkrootfs" "$bin/guest-init" /bin/busybox dir "$stage" "$bash"
rm -f "$out_dir/rootfs.ext4.tmp"
mkfs.ext4 -q -F -L husk-root -E root_owner=0:0 -d "$stage" "$out_dir/rootfs.ext4.tmp" "$ext4_size" >/dev/null
printf '%s\n' "cd /dev" "mknod console c 5 1" "sif console mode 020600" \
    "mknod null c 1 3" "sif null mode 020666" |
    debugfs -w -f - "$out_dir/rootfs.ext4.tmp" >/dev/null 2>&1
for node in /dev/console /dev/null; do
    debugfs -R "stat $node" "$out_dir/rootfs.ext4.tmp" 2>/dev/null | grep -q "character special" \
        || { log "debugfs could not create $node"; exit 1; }
done
mv "$out_dir/rootfs.ext4.tmp" "$out_dir/rootfs.ext4"
rm -rf "$stage"
log "built: $out_dir/initramfs.cpio ($(stat -c %s "$out_dir/initramfs.cpio") bytes), $out_dir/rootfs.ext4 ($ext4_size)"

case "$want" in
    initramfs) echo "$out_dir/initramfs.cpio" ;;
    ext4) echo "$out_dir/rootfs.ext4" ;;
    *) log "unknown artifact $want (initramfs or ext4)"; exit 2 ;;
esac
