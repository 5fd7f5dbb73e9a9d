#!/usr/bin/env bash
# Runs a command on a second KVM: kvm_amd (an ordinary, hardware-style KVM
# with nested paging) in a Debian 6.1 VM ("L1") under QEMU's TCG, which
# emulates an AMD CPU with SVM. The command sees this machine's whole file
# system read-only (9p) under a writable tmpfs overlay, at the same paths,
# with the same environment and working directory, and /dev/kvm served by
# kvm_amd: the same binaries that run on this host's KVM run there unchanged.
# L1 has no network device at all, and one vCPU: with two, QEMU's TCG
# emulation of SVM goes wrong around VMRUN now and then (L1's kernel took a
# reschedule IPI right after VMRUN, before the host's GS was back, and
# panicked; nested guests that had run for seconds triple-faulted or stopped
# answering). Measured with tests/second-kvm/stress.sh and its kind (4
# workers): two vCPUs, L1 panicked in 5 of 12 runs, 2 of 16 clones running
# 1426 commands died (triple faults) and 3 of about 760 restored clones (a
# triple fault, or the VMM gone under an exec); one vCPU, no panic in 6 runs,
# none of 16 clones in 2400 commands nor of 480 restores (HUSK_L1_SMP sets
# another count). Its TSC is declared reliable, as a hardware host's invariant
# TSC is: TCG's TSC is the host's, but L1's boot-time check across its CPUs
# failed with two vCPUs, and without a stable TSC kvm_amd has no master clock
# and a guest's kvmclock steps against its TSC.
#
#   tests/second-kvm/run.sh [--timeout S] -- COMMAND [ARG]...
#
# Exits with the command's status; 124 when L1 ran out of time, 125 when it
# powered off without a status (its kernel died or init gave up: the console
# above says which). Needs root
# (apt for QEMU >= 8.2 and Debian's kernel, both kept under
# ~/.cache/husk/second-kvm). Why QEMU >= 8.2: older TCG never delivers the
# SVM intercept of XSETBV, and the nested guest then loses AVX without a
# word (shared/notes/second-kvm.md).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache="${HUSK_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/husk}/second-kvm"
timeout_s=3000
while (($#)); do
    case "$1" in
        --timeout) timeout_s="$2"; shift 2 ;;
        --) shift; break ;;
        *) echo "usage: $0 [--timeout S] -- COMMAND [ARG]..." >&2; exit 2 ;;
    esac
done
(($#)) || { echo "usage: $0 [--timeout S] -- COMMAND [ARG]..." >&2; exit 2; }

log() { echo "second-kvm: $*" >&2; }
mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9

# Debian's packages, unpacked (not installed: the host keeps its own QEMU).
backports=/etc/apt/sources.list.d/husk-backports.sources
apt_ready=
apt_prepare() {
    [[ -n $apt_ready ]] && return
    if [[ ! -f $backports ]]; then
        [[ $(id -u) -eq 0 ]] || { log "needs root to add bookworm-backports to apt's sources"; exit 1; }
        printf '%s\n' "Types: deb" "URIs: http://deb.debian.org/debian" \
            "Suites: bookworm-backports" "Components: main" \
            "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg" >"$backports"
    fi
    apt-get update -qq >&2
    apt_ready=1
}
unpack() { # DIR PACKAGE...
    local dir="$1" tmp
    shift
    tmp="$(mktemp -d "$cache/.download.XXXXXX")"
    chmod 755 "$tmp"
    (cd "$tmp" && apt-get download -qq "$@" 2>/dev/null >&2)
    mkdir -p "$dir.tmp"
    for deb in "$tmp"/*.deb; do dpkg-deb -x "$deb" "$dir.tmp"; done
    rm -rf "$tmp" "$dir"
    mv "$dir.tmp" "$dir"
}

qemu_version=10.0.2+ds-2+deb13u1~bpo12+1
qemu_dir="$cache/qemu-$qemu_version"
if [[ ! -x $qemu_dir/usr/bin/qemu-system-x86_64 ]]; then
    log "fetching QEMU $qemu_version (bookworm-backports)"
    apt_prepare
    unpack "$qemu_dir" "qemu-system-x86=1:$qemu_version" "qemu-system-data=1:$qemu_version" \
        "qemu-system-common=1:$qemu_version"
fi
for p in seabios ipxe-qemu busybox-static; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || {
        apt_prepare
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$p" >&2
    }
done

kpkg=$(cat "$cache/kernel-package" 2>/dev/null || true)
if [[ -z $kpkg || ! -d $cache/$kpkg ]]; then
    apt_prepare
    kpkg=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
    log "fetching $kpkg"
    unpack "$cache/$kpkg" "$kpkg"
    kver=${kpkg#linux-image-}
    busybox depmod -b "$cache/$kpkg" "$kver"
    echo "$kpkg" >"$cache/kernel-package"
fi
kver=${kpkg#linux-image-}
kroot="$cache/$kpkg"
modules="$kroot/lib/modules/$kver"

# L1's initramfs: busybox, the modules that reach the host's tree, /init.
boot_modules=(virtio_ring virtio virtio_pci_legacy_dev virtio_pci_modern_dev virtio_pci
    netfs fscache 9pnet 9pnet_virtio 9p overlay)
key=$( { echo "$kver"; cat "$here/init"; } | sha256sum | cut -c1-16)
cpio="$cache/l1-$key.cpio"
if [[ ! -f $cpio ]]; then
    stage="$(mktemp -d)"
    mkdir -p "$stage"/{bin,sbin,dev,proc,sys,host,root,out,modules,lib/modules}
    cp /bin/busybox "$stage/bin/busybox"
    ln -s ../bin/busybox "$stage/sbin/modprobe"
    for m in "${boot_modules[@]}"; do
        find "$modules/kernel" -name "$m.ko*" -exec cp {} "$stage/modules/" \;
    done
    cp "$here/init" "$stage/init"
    chmod 755 "$stage/init"
    (cd "$stage" && find . | busybox cpio -o -H newc) >"$cpio.tmp" 2>/dev/null
    mv "$cpio.tmp" "$cpio"
    rm -rf "$stage"
fi

# What L1 runs: the command, in this directory, with this environment.
out="$(mktemp -d /tmp/husk-second-kvm.XXXXXX)"
trap 'rm -rf "$out"' EXIT
{
    export -p | grep -vE '^declare -x (PWD|OLDPWD|SHLVL|_|TERM)='
    printf 'cd %q\n' "$PWD"
    printf 'export HUSK_L1_MODULES=%q\n' "$modules"
    printf '%q ' "$@"
    echo
} >"$out/command"

log "L1: $kpkg, kvm_amd, under QEMU $qemu_version TCG; running: $*"
started=$SECONDS
set +e
QEMU_MODULE_DIR="$qemu_dir/usr/lib/x86_64-linux-gnu/qemu" \
    timeout --kill-after=10 "$timeout_s" "$qemu_dir/usr/bin/qemu-system-x86_64" \
    -L "$qemu_dir/usr/share/qemu" -L /usr/share/seabios -L /usr/lib/ipxe/qemu \
    -accel tcg,thread=multi -smp "${HUSK_L1_SMP:-1}" -m 8192 -cpu max -nic none \
    -kernel "$kroot/boot/vmlinuz-$kver" -initrd "$cpio" \
    -append "console=ttyS0 quiet mitigations=off panic=-1 tsc=reliable HUSK_OUT=$out" \
    -virtfs "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap" \
    -virtfs "local,path=$out,mount_tag=out,security_model=none" \
    -display none -audio none -serial stdio -monitor none -no-reboot </dev/null
qemu_rc=$?
set -e
if [[ ! -f $out/rc ]]; then
    log "L1 ended after $((SECONDS - started)) s without the command's status (QEMU: $qemu_rc)"
    exit $((qemu_rc == 124 ? 124 : qemu_rc == 0 ? 125 : 1))
fi
rc=$(cat "$out/rc")
log "L1 ran the command in $((SECONDS - started)) s: status $rc"
exit "$rc"
