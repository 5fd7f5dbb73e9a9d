#!/usr/bin/env bash
# Runs test binaries one after another, each from its crate's directory as
# cargo would, and prints one line per binary (its verdict and wall time),
# labelled with the KVM it ran on. Exits non-zero if any failed.
#
#   tests/second-kvm/suite.sh LABEL NAME=CRATE_DIR:BINARY...
set -uo pipefail
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
done
printf '%s\n' "${summary[@]}"
if ((${#failed[@]})); then
    echo "[$label] failed: ${failed[*]}"
    exit 1
fi
echo "[$label] all ${#summary[@]} test binaries passed"
