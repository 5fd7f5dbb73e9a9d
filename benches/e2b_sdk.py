"""E2B's SDK against husk, next to husk's own API for the same work:
create a sandbox (a warm pool's clone), run `echo hi` the way the SDK does
(`/bin/bash -l -c` as `user` in /home/user), time to its first output,
destroy it. What the E2B gateway costs is the difference.

    husk serve --e2b 127.0.0.1:3000 --e2b-api-key-file KEYS ...
    husk template build base; husk pool set base 4
    E2B_API_URL=http://127.0.0.1:3000 E2B_SANDBOX_URL=http://127.0.0.1:3000 \\
    E2B_API_KEY=<key> HUSK_HOST=<state dir>/husk.sock \\
        target/pyenv/bin/python benches/e2b_sdk.py [N] [TEMPLATE]

Runs the two paths interleaved (a noisy host hurts both alike) and waits for
the pool to be full again before each run.
"""

import http.client
import json
import os
import socket
import sys
import time

from e2b import Sandbox

N = int(sys.argv[1]) if len(sys.argv) > 1 else 10
TEMPLATE = sys.argv[2] if len(sys.argv) > 2 else "base"
SOCK = os.environ["HUSK_HOST"]


class Unix(http.client.HTTPConnection):
    def __init__(self):
        super().__init__("husk", timeout=600)

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(SOCK)


def husk(method, path, body=None):
    c = Unix()
    c.request(method, path, body=json.dumps(body) if body is not None else None,
              headers={"Content-Type": "application/json"})
    return c, c.getresponse()


def pool_full():
    deadline = time.time() + 600
    while time.time() < deadline:
        c, r = husk("GET", "/v1/pools")
        pools = json.loads(r.read())
        c.close()
        p = [p for p in pools if p["template_name"] == TEMPLATE]
        if p and p[0]["ready"] >= p[0]["target"] > 0:
            return
        time.sleep(0.5)
    raise SystemExit("the pool did not fill (husk pool set TEMPLATE N first)")


def via_husk():
    t0 = time.perf_counter()
    c, r = husk("POST", "/v1/sandboxes", {"template": TEMPLATE})
    created = json.loads(r.read())
    c.close()
    sid = created["sandbox"]["id"]
    # The same program the SDK's commands.run starts, as the same user.
    c, r = husk("POST", f"/v1/sandboxes/{sid}/exec", {
        "argv": ["/bin/bash", "-l", "-c", "echo hi"],
        "user": {"uid": 1000, "gid": 1000},
        "cwd": "/home/user",
        "env": {"HOME": "/home/user", "USER": "user"},
    })
    first = None
    while first is None:
        line = r.readline()
        if not line:
            break
        if json.loads(line).get("type") == "stdout":
            first = time.perf_counter() - t0
    c.close()
    c, r = husk("DELETE", f"/v1/sandboxes/{sid}")
    r.read()
    c.close()
    return first


def via_e2b():
    t0 = time.perf_counter()
    first = []
    s = Sandbox.create(TEMPLATE, request_timeout=600)
    s.commands.run("echo hi", on_stdout=lambda _: first or first.append(time.perf_counter() - t0),
                   timeout=600, request_timeout=600)
    s.kill()
    return first[0]


def pct(xs, p):
    xs = sorted(xs)
    return xs[round((len(xs) - 1) * p)] * 1000


times = {"husk API": [], "E2B SDK": []}
for _ in range(N):
    pool_full()
    times["husk API"].append(via_husk())
    pool_full()
    times["E2B SDK"].append(via_e2b())
print(f"create (pooled) to the first output of `echo hi`, {N} runs each:")
for k, v in times.items():
    print(f"  {k:<9} p50 {pct(v, 0.5):8.1f} ms  p99 {pct(v, 0.99):8.1f} ms  min {pct(v, 0):8.1f} ms")
