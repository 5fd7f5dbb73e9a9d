#!/usr/bin/env bash
# `make test`'s runner: builds every test binary of the workspace as `cargo
# test` would, then runs them HUSK_TEST_JOBS at a time (default 2), the
# slowest first, each from its crate's directory as cargo runs it, then the
# doc tests. Every line a binary prints comes out as it is printed, prefixed
# with the binary's name; one line per binary when it ends (its verdict and
# wall time), and a table of them all at the end. Exits non-zero if any
# binary failed.
#
#   tests/run.sh            every test binary, then the doc tests
#   tests/run.sh NAME...    only those binaries (daemon, lib:husk_core, ...)
#
# Why not `cargo test`: it runs one binary at a time, and most of the
# suite's binaries keep one guest busy at a time (a single long test, as
# cri's and bench's, or one test thread left waiting for the slowest): on a
# 2-core host the second core sat idle while those ran (vmstat during cri's:
# 50% idle). On a host that is busy already, a second binary would only
# oversubscribe it: a binary is started beside another only while the host
# has half a core or more to spare (measured over 2 s; the wait is said).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

jobs=${HUSK_TEST_JOBS:-2}
[[ $jobs =~ ^[1-9][0-9]*$ ]] || { echo "HUSK_TEST_JOBS must be a positive number, not '$jobs'" >&2; exit 2; }
# The slowest binaries (CI's per-binary times on a 2-core PVM host),
# started first so that the short ones fill in beside them at the end.
slowest=(daemon cri snapshot bench containerd agent boot net embed vsock block fuzz)

# NAME KIND CRATE_DIR EXECUTABLE, one test binary per line.
built=$(cargo test --workspace --locked --no-run --message-format=json-render-diagnostics |
    python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        t = m["target"]
        print(t["name"], t["kind"][0], m["manifest_path"].rsplit("/", 1)[0], m["executable"])
') || { echo "building the test binaries failed" >&2; exit 1; }

declare -A dir_of=() exe_of=()
order=()
while read -r name kind dir exe; do
    # Integration tests by name; a crate's own unit tests as lib:CRATE
    # or bin:NAME.
    label=$name
    [[ $kind == test ]] || label="$kind:$name"
    dir_of[$label]=$dir
    exe_of[$label]=$exe
    order+=("$label")
done <<<"$built"
if (($#)); then
    for label in "$@"; do
        [[ -n ${exe_of[$label]:-} ]] || { echo "no test binary '$label' (there are: ${order[*]})" >&2; exit 2; }
    done
    order=("$@")
    slowest=()
fi
queue=()
for label in "${slowest[@]}"; do
    [[ -n ${exe_of[$label]:-} ]] && queue+=("$label")
done
for label in "${order[@]}"; do
    [[ " ${slowest[*]} " == *" $label "* ]] || queue+=("$label")
done

logs=$(mktemp -d /tmp/husk-tests.XXXXXX)
trap 'rm -rf "$logs"' EXIT
declare -A label_of=() start_of=()
results=()
failed=()
run() {
    local label=$1
    (
        cd "${dir_of[$label]}" || exit 1
        began=$SECONDS
        : >"$logs/$label"
        # The binary writes to a file that is followed, not to a pipe: a
        # process a test left behind holding the pipe would keep the job
        # from ending; `tail --pid` ends with the binary.
        "${exe_of[$label]}" >"$logs/$label" 2>&1 &
        bin=$!
        tail -n +1 -f --pid="$bin" "$logs/$label" | sed -u "s/^/[$label] /" &
        wait "$bin"
        rc=$?
        echo $((SECONDS - began)) >"$logs/$label.took"
        wait
        exit "$rc"
    ) &
    label_of[$!]=$label
    start_of[$!]=$SECONDS
}
# Reaps the job PID, or the next job to end.
reap() {
    local pid=${1:-} rc label took verdict
    if [[ -n $pid ]]; then
        wait "$pid"
    else
        wait -n -p pid
    fi
    rc=$?
    label=${label_of[$pid]}
    took=$(cat "$logs/$label.took" 2>/dev/null || echo $((SECONDS - start_of[$pid])))
    unset "label_of[$pid]"
    if ((rc == 0)); then
        verdict="ok in $took s"
    else
        verdict="FAILED (status $rc) in $took s"
        failed+=("$label")
    fi
    results+=("$(printf '%-28s %s' "$label" "$verdict")")
    echo "[$label] $verdict"
}

# The CPU the host leaves idle over the next 2 s, in hundredths of a core
# (from /proc/stat: idle and iowait over all time spent).
idle_centicores() {
    local cpu a=() b=()
    read -r cpu a[0] a[1] a[2] a[3] a[4] a[5] a[6] a[7] _ </proc/stat
    sleep 2
    read -r cpu b[0] b[1] b[2] b[3] b[4] b[5] b[6] b[7] _ </proc/stat
    local total=0 i
    for i in 0 1 2 3 4 5 6 7; do total=$((total + b[i] - a[i])); done
    local idle=$((b[3] - a[3] + b[4] - a[4]))
    echo $((total > 0 ? 100 * $(nproc) * idle / total : 0))
}
# Reaps every job that has ended, without waiting for one that has not.
reap_ended() {
    local pid
    for pid in "${!label_of[@]}"; do
        kill -0 "$pid" 2>/dev/null || reap "$pid"
    done
}

started=$SECONDS
echo "running ${#queue[@]} test binaries, up to $jobs at a time"
for label in "${queue[@]}"; do
    while ((${#label_of[@]} >= jobs)); do reap; done
    said=
    while ((${#label_of[@]})); do
        idle=$(idle_centicores)
        reap_ended
        ((${#label_of[@]} && idle < 50)) || break
        [[ -n $said ]] || echo "[run] $label waits for a spare core (idle: 0.$(printf %02d "$idle") of one)"
        said=1
    done
    run "$label"
done
while ((${#label_of[@]})); do reap; done

if ((${#@} == 0)); then
    echo "doc tests:"
    if cargo test --workspace --locked --doc --quiet 2>&1 | sed -u 's/^/[doc] /'; then
        results+=("$(printf '%-28s %s' doc ok)")
    else
        results+=("$(printf '%-28s %s' doc FAILED)")
        failed+=(doc)
    fi
fi

echo "test binaries, up to $jobs at a time, in $((SECONDS - started)) s:"
printf '  %s\n' "${results[@]}"
if ((${#failed[@]})); then
    echo "FAILED: ${failed[*]}"
    exit 1
fi
