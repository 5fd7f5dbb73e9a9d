"""What the Python benches share: husk's API over the daemon's Unix socket
($HUSK_HOST), and percentiles."""

import http.client
import json
import os
import socket
import subprocess

SOCK = os.environ["HUSK_HOST"]


class Unix(http.client.HTTPConnection):
    def __init__(self):
        super().__init__("husk", timeout=900)

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect(SOCK)


def req(method, path, body=None, raw=None):
    """The answer's body; an error status raises. `body` goes as JSON,
    `raw` as it is."""
    c = Unix()
    data = raw if raw is not None else (json.dumps(body) if body is not None else None)
    headers = {"Content-Type": "application/json"} if body is not None else {}
    c.request(method, path, body=data, headers=headers)
    r = c.getresponse()
    out = r.read()
    c.close()
    assert r.status < 300, (r.status, out)
    return out


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * p))]


def meminfo_kib(key):
    """A /proc/meminfo value in KiB (None if the kernel has no such line)."""
    for line in open("/proc/meminfo"):
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return None


def drop_caches():
    """Writes back and drops the page cache (root), so memory is counted clean."""
    subprocess.run(["sync"])
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")
