"""The front door's cost per request (the README's ports paragraph): a
sandbox runs husk-testsrv (built with guest-init), and N sequential GETs go
through the front door on one keep-alive client connection; then one
request's parts, straight on the VMM's vsock socket (as root, or as the
daemon's user).

    husk serve --state-dir DIR ... --expose 127.0.0.1:8080 &    # release build
    husk template build base
    HUSK_HOST=DIR/husk.sock python3 benches/front_door.py 127.0.0.1:8080 50
"""

import http.client
import json
import os
import socket
import sys
import time

from husk_api import pct, req

DOOR, N = sys.argv[1], int(sys.argv[2])
SERVER = os.path.join(os.path.dirname(__file__), "..",
                      "target/x86_64-unknown-linux-musl/guest/husk-testsrv")


def line(s):
    b = b""
    while not b.endswith(b"\n"):
        c = s.recv(1)
        if not c:
            raise SystemExit(f"closed after {b!r}")
        b += c
    return b


sb = json.loads(req("POST", "/v1/sandboxes", {"template": "base"}))["sandbox"]
sid = sb["id"]
try:
    with open(SERVER, "rb") as f:
        req("PUT", f"/v1/sandboxes/{sid}/files?path=/tmp/srv", raw=f.read())
    req("POST", f"/v1/sandboxes/{sid}/exec", {"argv": ["/bin/sh", "-c",
        "chmod +x /tmp/srv; setsid /tmp/srv 8000 </dev/null >/dev/null 2>&1 &"]})
    while not json.loads(req("GET", f"/v1/sandboxes/{sid}/ports/8000")).get("listening"):
        time.sleep(0.5)
    host, port = DOOR.rsplit(":", 1)
    c = http.client.HTTPConnection(host, int(port), timeout=300)
    ts = []
    for _ in range(N):
        t = time.perf_counter()
        c.request("GET", "/hello", headers={"Host": f"8000-{sid}.localhost:{port}"})
        r = c.getresponse()
        r.read()
        assert r.status == 200, r.status
        ts.append((time.perf_counter() - t) * 1000)
    print(f"front door GET (n={N}): p50 {pct(ts, .5):.0f} ms p90 {pct(ts, .9):.0f} ms "
          f"min {min(ts):.0f} max {max(ts):.0f}")
    parts = []
    for _ in range(20):
        t0 = time.perf_counter()
        s = socket.socket(socket.AF_UNIX)
        s.connect(sb["agent_socket"])
        s.sendall(b"CONNECT 1025\n")
        line(s)
        t1 = time.perf_counter()
        s.sendall(b"PORT 8000\n")
        line(s)
        t2 = time.perf_counter()
        s.sendall(b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n")
        while s.recv(65536):
            pass
        t3 = time.perf_counter()
        s.close()
        parts.append(((t1 - t0) * 1000, (t2 - t1) * 1000, (t3 - t2) * 1000))
    for k, name in enumerate(["vsock connection", "the forwarder's answer",
                              "request to the end of the answer"]):
        print(f"{name}: p50 {pct([p[k] for p in parts], .5):.0f} ms")
finally:
    req("DELETE", f"/v1/sandboxes/{sid}")
