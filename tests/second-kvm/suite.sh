#!/usr/bin/env bash
# Runs test binaries one after another, each from its crate's directory as
# cargo would, and prints one line per binary as it ends (its verdict and
# wall time), labelled with the KVM it ran on. Exits non-zero if any failed.
#
#   tests/second-kvm/suite.sh LABEL NAME=CRATE_DIR:BINARY...
#   tests/second-kvm/suite.sh --l1 SECONDS LABEL NAME=CRATE_DIR:BINARY...
#
# With --l1 it runs itself in L1 (run.sh), within SECONDS in all. L1's kernel
# is Debian's kvm_amd under QEMU's TCG, and it has died there, rarely, in the
# emulation of SVM itself (a host interrupt taken on the instruction after
# VMRUN, before the host's GS is back: a page-fault loop, "Kernel panic" on
# its console; or a vCPU thread's stack overrun in error_entry), in about one
# L1 run of five while L1 had two vCPUs (run.sh now gives it one, and none has
# died since; see its header). When L1 panics before the suite's end, the
# binaries it had not finished (the one in flight included) run again in a
# fresh L1, up to two more times; a binary that ended, passed or failed, keeps
# its verdict, and a third panic fails the suite.
set -uo pipefail

if [[ ${1:-} == --l1 ]]; then
    budget="$2"
    label="$3"
    shift 3
    here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
    console="$(mktemp /tmp/husk-second-kvm-console.XXXXXX)"
    trap 'rm -f "$console"' EXIT
    started=$SECONDS
    pending=("$@")
    summary=()
    failed=()
    attempts=3
    for ((attempt = 1; attempt <= attempts; attempt++)); do
        "$here/run.sh" --timeout $((budget - (SECONDS - started))) -- \
            "$here/suite.sh" "$label" "${pending[@]}" | tee "$console"
        rc=${PIPESTATUS[0]}
        # The verdicts this L1 printed ("[LABEL] NAME: ok in N s").
        done=()
        while IFS= read -r line; do
            summary+=("$line")
            name=${line#"[$label] "}
            name=${name%%:*}
            done+=("$name")
            [[ $line == *": ok in "* ]] || failed+=("$name")
        done < <(tr -d '\r' <"$console" | grep -E "^\[$label\] [^ ]+: (ok|FAILED \(status [0-9]+\)) in [0-9]+ s$")
        if ((rc != 125)) || ! grep -q 'Kernel panic' "$console" || ((attempt == attempts)); then
            break
        fi
        left=()
        for spec in "${pending[@]}"; do
            [[ " ${done[*]} " == *" ${spec%%=*} "* ]] || left+=("$spec")
        done
        pending=("${left[@]}")
        echo "[$label] L1's kernel panicked (its console above) after $((SECONDS - started)) s;" \
            "a fresh L1 runs what it had not finished: ${pending[*]%%=*}"
        if ((budget - (SECONDS - started) < 300)); then
            echo "[$label] too little of the ${budget} s left for a fresh L1"
            break
        fi
    done
    if ((attempt > 1)); then
        echo "[$label] summary of all $attempt L1s:"
        printf '  %s\n' "${summary[@]}"
    fi
    if ((${#failed[@]})); then
        echo "[$label] failed: ${failed[*]}"
        exit 1
    fi
    exit "$rc"
fi

label="$1"
shift
failed=()
summary=()
for spec in "$@"; do
    name=${spec%%=*}
    rest=${spec#*=}
    dir=${rest%%:*}
    bin=${rest#*:}
    echo "[$label] $name: $bin"
    started=$SECONDS
    (cd "$dir" && "$bin")
    rc=$?
    verdict=ok
    ((rc == 0)) || { verdict="FAILED (status $rc)"; failed+=("$name"); }
    summary+=("[$label] $name: $verdict in $((SECONDS - started)) s")
    echo "${summary[-1]}"
done
echo "[$label] summary:"
printf '  %s\n' "${summary[@]}"
if ((${#failed[@]})); then
    echo "[$label] failed: ${failed[*]}"
    exit 1
fi
echo "[$label] all ${#summary[@]} test binaries passed"
