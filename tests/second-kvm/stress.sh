#!/usr/bin/env bash
# Keeps a KVM busy with clones and says which of them died: a daemon (its
# own state directory under /tmp), the base template, then WORKERS workers
# at once. Each worker either runs COUNT commands in one clone of its own
# (the default: guests that run for minutes), or with --restores creates
# COUNT clones one after another and runs one command in each (restores).
# A failure prints the clone's VMM log and console and the daemon's lines
# for it; the exit status is 1 if any failed. Built for the second KVM,
# where it measured how often L1's emulation kills nested guests
# (tests/second-kvm/run.sh's header):
#
#   HUSK_KERNEL=$(kernel-config/build.sh) HUSK_INITRAMFS=$(guest-init/build-rootfs.sh) \
#     tests/second-kvm/run.sh -- tests/second-kvm/stress.sh [--restores] WORKERS COUNT
#
# Uses target/debug's husk and husk-vmm (cargo build -p husk-cli -p husk-vmm
# -p husk-jailer first) and the jail where it runs as root.
set -uo pipefail

restores=
if [[ ${1:-} == --restores ]]; then
    restores=1
    shift
fi
(($# == 2)) || { echo "usage: $0 [--restores] WORKERS COUNT" >&2; exit 2; }
workers="$1"
count="$2"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
bin="$repo/target/debug"
state="$(mktemp -d /tmp/husk-stress.XXXXXX)"
export HUSK_HOST="$state/husk.sock"
jail=()
(($(id -u) == 0)) || jail=(--no-jail)

HUSK_LOG=husk_vmm=debug RUST_LOG=husk_core=debug,info "$bin/husk" serve --state-dir "$state" \
    --kernel "${HUSK_KERNEL:?}" --initramfs "${HUSK_INITRAMFS:?}" \
    --guest-init "$repo/target/x86_64-unknown-linux-musl/guest/guest-init" \
    --vmm "$bin/husk-vmm" "${jail[@]}" 2>"$state.log" &
daemon=$!
trap 'kill $daemon 2>/dev/null; wait $daemon 2>/dev/null; rm -rf "$state" "$state.log"' EXIT
for _ in $(seq 120); do
    [[ -S $HUSK_HOST ]] && break
    sleep 1
done
"$bin/husk" template build base >/dev/null || { tail -50 "$state.log"; exit 1; }

# What is known of a clone that failed.
post_mortem() { # ID
    [[ -n $1 ]] || return
    grep -F "$1" "$state.log" | tail -20
    echo "--- $1: husk-vmm log"
    cat "$state/sandboxes/$1/vmm.log" 2>/dev/null
    echo "--- $1: console (its end)"
    tail -c 3000 "$state/sandboxes/$1/console" 2>/dev/null
}


# A command with some work in it; prints the guest's uptime.
work() { # ID
    timeout 400 "$bin/husk" exec "$1" -- /bin/sh -c \
        'i=0; while [ $i -lt 200 ]; do i=$((i+1)); done; cat /proc/uptime' 2>&1
}

worker() { # N
    local id="" out rc i
    for ((i = 1; i <= count; i++)); do
        if [[ -n $restores || -z $id ]]; then
            out="$(timeout 400 "$bin/husk" run base 2>&1)"
            id="$(grep -o 'sb-[0-9a-f]*' <<<"$out" | head -1)"
            if [[ -z $id || $out != *created* ]]; then
                echo "FAILED: worker $1 #$i: the create: $out"
                post_mortem "$id"
                return 1
            fi
        fi
        out="$(work "$id")"
        rc=$?
        echo "worker $1 #$i: $id: status $rc: $out"
        if ((rc != 0)); then
            echo "FAILED: worker $1 #$i: $id"
            post_mortem "$id"
            "$bin/husk" rm "$id" >/dev/null 2>&1
            return 1
        fi
        if [[ -n $restores ]]; then
            "$bin/husk" rm "$id" >/dev/null 2>&1
        fi
    done
    [[ -n $restores ]] || "$bin/husk" rm "$id" >/dev/null 2>&1
    return 0
}

pids=()
for w in $(seq "$workers"); do
    worker "$w" &
    pids+=($!)
done
failed=0
for pid in "${pids[@]}"; do
    wait "$pid" || failed=1
done
echo "stress: $workers workers x $count: $( ((failed)) && echo FAILED || echo ok)"
exit $failed
