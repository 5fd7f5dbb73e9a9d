"""A terminal keystroke's round trip and the first byte of an attach,
through husk's process API (REST on the daemon's Unix socket) and through
E2B's API (the E2B SDK's `sandbox.pty`), on one sandbox each.

    husk serve --e2b 127.0.0.1:3000 --e2b-api-key-file KEYS ...
    husk template build base
    E2B_API_URL=http://127.0.0.1:3000 E2B_SANDBOX_URL=http://127.0.0.1:3000 \\
    E2B_API_KEY=<key> HUSK_HOST=<state dir>/husk.sock \\
        target/pyenv/bin/python benches/terminal.py [KEYS] [TEMPLATE]

Keystroke: `cat` on a terminal; each key (one byte, sent when the previous
one came back) is timed from its send to its echo arriving on the output
stream that was opened once (the WebSocket: a binary frame each way on `GET
.../terminal`; REST: `POST .../stdin` against `GET .../output?follow=true`;
E2B: `pty.send_stdin` against the `pty.create` stream). Attach: a program that wrote a line is read from offset 0 (`GET
.../output?from=0`), timed from the request to its first output event.
Prints p50/p99 in ms, one JSON line per measure at the end.
"""

import base64
import json
import os
import socket
import struct
import statistics
import sys
import threading
import time

from husk_api import SOCK, Unix, pct, req

KEYS = int(sys.argv[1]) if len(sys.argv) > 1 else 50
TEMPLATE = sys.argv[2] if len(sys.argv) > 2 else "base"
SLOW = 600


def husk(method, path, body=None):
    """The JSON answer (None if empty); bytes go as they are."""
    raw = body if isinstance(body, bytes) else None
    out = req(method, path, body=None if raw is not None else body, raw=raw)
    return json.loads(out) if out else None


def stream(path):
    """The NDJSON events of a GET, as they come."""
    c = Unix()
    c.request("GET", path)
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"GET {path}: {r.status} {r.read()!r}")
    while True:
        line = r.readline()
        if not line:
            return
        yield json.loads(line)


def report(name, samples):
    ms = [x * 1000 for x in samples]
    line = {
        "measure": name,
        "n": len(ms),
        "p50_ms": round(statistics.median(ms), 2),
        "p99_ms": round(pct(ms, 0.99), 2),
    }
    print(f"{name}: n={len(ms)} p50 {line['p50_ms']} ms p99 {line['p99_ms']} ms", flush=True)
    return line


class Echoes:
    """Counts output bytes as they arrive; waits for a count."""

    def __init__(self):
        self.seen = 0
        self.cond = threading.Condition()

    def add(self, n):
        with self.cond:
            self.seen += n
            self.cond.notify_all()

    def wait_for(self, n):
        with self.cond:
            if not self.cond.wait_for(lambda: self.seen >= n, timeout=SLOW):
                raise RuntimeError(f"no echo after {SLOW} s ({self.seen} of {n} bytes)")


def keystrokes(send, echoes):
    samples = []
    for i in range(KEYS + 5):
        want = echoes.seen + 1
        t = time.perf_counter()
        send(b"x")
        echoes.wait_for(want)
        if i >= 5:  # the first keys warm the paths up
            samples.append(time.perf_counter() - t)
    return samples


class WebSocket:
    """The least of a WebSocket client (RFC 6455) on the daemon's socket."""

    def __init__(self, path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(SOCK)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(
            (
                f"GET {path} HTTP/1.1\r\nHost: husk\r\nUpgrade: websocket\r\n"
                f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                "Sec-WebSocket-Version: 13\r\n\r\n"
            ).encode()
        )
        self.buf = b""
        while b"\r\n\r\n" not in self.buf:
            self.buf += self.sock.recv(4096)
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        if b" 101 " not in head.split(b"\r\n")[0]:
            raise RuntimeError(f"no upgrade: {head!r}")

    def send_binary(self, data):
        mask = os.urandom(4)
        body = bytes(b ^ mask[i % 4] for i, b in enumerate(data))
        assert len(data) < 126
        self.sock.sendall(bytes([0x82, 0x80 | len(data)]) + mask + body)

    def _take(self, n):
        while len(self.buf) < n:
            more = self.sock.recv(65536)
            if not more:
                raise EOFError
            self.buf += more
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def recv(self):
        """(opcode, payload) of the next frame."""
        b0, b1 = self._take(2)
        n = b1 & 0x7F
        if n == 126:
            (n,) = struct.unpack(">H", self._take(2))
        elif n == 127:
            (n,) = struct.unpack(">Q", self._take(8))
        return b0 & 0x0F, self._take(n)


def websocket(sandbox):
    base = f"/v1/sandboxes/{sandbox}/processes"
    cat = husk("POST", base, {"argv": ["cat"], "terminal": {"rows": 24, "cols": 80}})
    pid = cat["pid"]
    ws = WebSocket(f"{base}/{pid}/terminal")
    echoes = Echoes()

    def read():
        try:
            while True:
                op, data = ws.recv()
                if op == 2:
                    echoes.add(len(data))
                elif op == 8:
                    return
        except (EOFError, OSError):
            return

    threading.Thread(target=read, daemon=True).start()
    line = report("websocket_keystroke_rtt", keystrokes(ws.send_binary, echoes))
    husk("POST", f"{base}/{pid}/signal", {"signal": "KILL"})
    return [line]


def rest(sandbox):
    lines = []
    base = f"/v1/sandboxes/{sandbox}/processes"
    cat = husk("POST", base, {"argv": ["cat"], "terminal": {"rows": 24, "cols": 80}})
    pid = cat["pid"]
    echoes = Echoes()

    def read():
        for e in stream(f"{base}/{pid}/output?from=0&follow=true"):
            if e["type"] == "stdout":
                echoes.add(len(base64.b64decode(e["data"])))

    threading.Thread(target=read, daemon=True).start()
    lines.append(
        report(
            "rest_keystroke_rtt",
            keystrokes(lambda b: husk("POST", f"{base}/{pid}/stdin", b), echoes),
        )
    )
    husk("POST", f"{base}/{pid}/signal", {"signal": "KILL"})

    # The first byte of an attach: a program whose line is kept.
    printer = husk("POST", base, {"argv": ["/bin/sh", "-c", "echo ready; exec sleep 100000"]})
    ppid = printer["pid"]
    while husk("GET", f"{base}/{ppid}")["written"] == 0:
        time.sleep(0.2)
    firsts = []
    for _ in range(KEYS):
        t = time.perf_counter()
        for e in stream(f"{base}/{ppid}/output?from=0&follow=false"):
            if e["type"] == "stdout":
                firsts.append(time.perf_counter() - t)
                break
    lines.append(report("rest_attach_first_byte", firsts))
    husk("POST", f"{base}/{ppid}/signal", {"signal": "KILL"})
    return lines


def e2b():
    from e2b import Sandbox
    from e2b.sandbox.commands.command_handle import PtySize

    sbx = Sandbox.create(TEMPLATE, timeout=SLOW)
    try:
        echoes = Echoes()
        h = sbx.pty.create(PtySize(rows=24, cols=80), timeout=0)
        def read():
            try:
                h.wait(on_pty=lambda d: echoes.add(len(d)))
            except Exception:  # the kill below ends it
                pass

        threading.Thread(target=read, daemon=True).start()
        # The shell's prompt first.
        echoes.wait_for(1)
        time.sleep(1)
        line = report(
            "e2b_keystroke_rtt", keystrokes(lambda b: sbx.pty.send_stdin(h.pid, b), echoes)
        )
        sbx.pty.kill(h.pid)
        return [line]
    finally:
        sbx.kill()


def main():
    created = husk("POST", "/v1/sandboxes", {"template": TEMPLATE, "ttl_s": SLOW})
    sandbox = created["sandbox"]["id"]
    try:
        lines = websocket(sandbox) + rest(sandbox)
    finally:
        husk("DELETE", f"/v1/sandboxes/{sandbox}")
    if os.environ.get("E2B_API_URL"):
        lines += e2b()
    for line in lines:
        print(json.dumps(line))


if __name__ == "__main__":
    main()
