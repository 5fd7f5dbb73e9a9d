#!/usr/bin/env bash
# Installs (once) the pinned JS clients of package.json (package-lock.json)
# into target/jsenv with the client scripts, and prints that directory. The
# tests that use them find it in $HUSK_TEST_JS (`make test` sets it); without
# node (20.18+) it prints nothing and those tests say they are skipped.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
env="$here/../../target/jsenv"
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    echo "tests/js/setup.sh: no node/npm: the JS client tests are skipped" >&2
    exit 0
fi
mkdir -p "$env"
if ! cmp -s "$here/package-lock.json" "$env/package-lock.json" 2>/dev/null || [ ! -d "$env/node_modules" ]; then
    cp "$here/package.json" "$here/package-lock.json" "$env/"
    (cd "$env" && npm ci --no-audit --no-fund --silent) >&2
fi
cp "$here"/*.mjs "$env/"
echo "$env"
