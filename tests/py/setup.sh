#!/usr/bin/env bash
# Makes (once) a Python virtual environment with the pinned clients in
# requirements.txt and prints its python. The tests that use these clients
# find it in $HUSK_TEST_PYTHON (`make test` sets it).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="$here/../../target/pyenv"
stamp="$venv/.requirements"
if ! cmp -s "$here/requirements.txt" "$stamp" 2>/dev/null; then
    if ! command -v python3 >/dev/null || ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
                python3 python3-venv >&2
        else
            echo "tests/py/setup.sh: needs python3 with venv (apt install python3-venv)" >&2
            exit 1
        fi
    fi
    rm -rf "$venv"
    python3 -m venv "$venv" >&2
    "$venv/bin/pip" install -q --disable-pip-version-check -r "$here/requirements.txt" >&2
    cp "$here/requirements.txt" "$stamp"
fi
echo "$venv/bin/python"
