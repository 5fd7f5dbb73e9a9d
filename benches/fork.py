"""E2B's fork against husk: a running sandbox copied into 1, 10 and 20
forks through the SDK (`sandbox.fork(count=N)`, husk's fork: the source
snapshotted copy-on-write, then each fork a clone of that snapshot).

    husk serve --e2b 127.0.0.1:3000 --e2b-api-key-file KEYS ...
    husk template build base
    E2B_API_URL=http://127.0.0.1:3000 E2B_SANDBOX_URL=http://127.0.0.1:3000 \\
    E2B_API_KEY=<key> HUSK_HOST=<state dir>/husk.sock \\
        target/pyenv/bin/python benches/fork.py [COUNTS] [TEMPLATE]

For each count (default 1,10,20): a source sandbox with a background
program, then the fork call timed to its answer (every fork created), the
source's pause (the snapshot's time as the daemon recorded it on the fork's
template: the source's vCPUs are stopped for that long), and the time until
every fork has answered an `echo` (asked of all forks at once). The source
runs on and answers after.
"""

import concurrent.futures
import http.client
import json
import os
import socket
import sys
import time

from e2b import Sandbox

COUNTS = [int(c) for c in (sys.argv[1] if len(sys.argv) > 1 else "1,10,20").split(",")]
TEMPLATE = sys.argv[2] if len(sys.argv) > 2 else "base"
SOCK = os.environ["HUSK_HOST"]
SLOW = 600


class Unix(http.client.HTTPConnection):
    def __init__(self):
        super().__init__("husk", timeout=SLOW)

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(SOCK)


def husk(path):
    c = Unix()
    c.request("GET", path)
    return json.loads(c.getresponse().read())


def fork_template(source_id):
    """The template the daemon made for the fork of `source_id`."""
    made = [t for t in husk("/v1/templates") if t["source"] == f"sandbox:{source_id}"]
    return max(made, key=lambda t: t["created_unix_ms"]) if made else None


def answers(sb):
    return sb.commands.run("echo hi", timeout=0, request_timeout=SLOW).stdout == "hi\n"


def run(count):
    src = Sandbox.create(TEMPLATE, timeout=SLOW, request_timeout=SLOW)
    forks = []
    try:
        src.commands.run("while :; do sleep 1; done", background=True, timeout=0,
                         request_timeout=SLOW)
        started = time.perf_counter()
        forks = src.fork(count=count, timeout=SLOW, request_timeout=SLOW)
        forked = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(max_workers=count) as pool:
            ok = list(pool.map(answers, forks))
        answered = time.perf_counter()
        source_ok = answers(src)
        tpl = fork_template(src.sandbox_id)
        paused = tpl["build_ms"].get("snapshot") if tpl else None
        return {
            "count": count,
            "fork_call_ms": (forked - started) * 1000,
            "all_answered_ms": (answered - started) * 1000,
            "source_paused_ms": paused,
            "forks_ok": sum(ok),
            "source_ok": source_ok,
        }
    finally:
        for f in forks:
            f.kill()
        src.kill()


def main():
    print("forks  fork call (ms)  all answered (ms)  source paused (ms)  answered")
    for count in COUNTS:
        r = run(count)
        paused = "?" if r["source_paused_ms"] is None else f"{r['source_paused_ms']:.1f}"
        print(f"{r['count']:>5}  {r['fork_call_ms']:>14.0f}  {r['all_answered_ms']:>17.0f}"
              f"  {paused:>18}  {r['forks_ok']}/{r['count']}, source {r['source_ok']}")


if __name__ == "__main__":
    main()
