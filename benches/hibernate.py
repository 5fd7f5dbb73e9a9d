"""Hibernation and wake, measured through a husk daemon's API (the README's
hibernation table). Start a daemon and build the templates first:

    husk serve --state-dir DIR --kernel K --initramfs I &      # release build
    husk template build base; husk template build big --mem-mib 1024
    HUSK_HOST=DIR/husk.sock python3 benches/hibernate.py cycles base 20
    HUSK_HOST=DIR/husk.sock python3 benches/hibernate.py cycles big 5
    HUSK_HOST=DIR/husk.sock python3 benches/hibernate.py compare base 20
    HUSK_HOST=DIR/husk.sock python3 benches/hibernate.py many base 1000   # as root

cycles:  hibernate and wake after a small change (n times), then after
         writing half the guest's memory (its root is in memory).
compare: wake, a fresh restore and a pooled create, each to a file listing
         the guest answers; quiet, then with a spinning process per core.
many:    N sandboxes restored, a file written, hibernated; the host's
         memory (with and without the page cache), the daemon's PSS, disk.
"""

import json
import os
import subprocess
import sys
import time

from husk_api import drop_caches, meminfo_kib, pct, req

def ms(f):
    t = time.perf_counter()
    out = f()
    return (time.perf_counter() - t) * 1000, out


def create(template):
    return json.loads(req("POST", "/v1/sandboxes", {"template": template}))["sandbox"]


def sh(sb, cmd):
    return req("POST", f"/v1/sandboxes/{sb}/exec", {"argv": ["/bin/sh", "-c", cmd]})


def answered(sb):
    req("GET", f"/v1/sandboxes/{sb}/dir?path=/tmp")


def cycles(template, n):
    s = create(template)
    sb = s["id"]
    sh(sb, "echo small > /tmp/small")
    hib, wake, size = [], [], []
    for _ in range(n):
        t, info = ms(lambda: json.loads(req("POST", f"/v1/sandboxes/{sb}/hibernate")))
        hib.append(t)
        size.append(info["disk_bytes"])
        t, _ = ms(lambda: req("POST", f"/v1/sandboxes/{sb}/wake"))
        wake.append(t)
    print(f"{template} after a small change (n={n}): hibernate p50 {pct(hib, .5):.1f} ms, "
          f"{pct(size, .5) / 2**20:.2f} MiB on disk; wake to the agent answering "
          f"p50 {pct(wake, .5):.0f} p99 {pct(wake, .99):.0f} ms")
    half = s["mem_mib"] // 2
    sh(sb, f"dd if=/dev/zero of=/tmp/fill bs=1048576 count={half} 2>/dev/null; true")
    t, info = ms(lambda: json.loads(req("POST", f"/v1/sandboxes/{sb}/hibernate")))
    t2, _ = ms(lambda: req("POST", f"/v1/sandboxes/{sb}/wake"))
    print(f"{template} after writing {half} MiB: hibernate {t:.0f} ms, "
          f"{info['disk_bytes'] / 2**20:.1f} MiB on disk; wake {t2:.0f} ms")
    req("DELETE", f"/v1/sandboxes/{sb}")


def compare(template, n):
    def series(label):
        sb = create(template)["id"]
        sh(sb, "echo small > /tmp/small")
        wake, fresh, pooled = [], [], []
        for _ in range(n):
            req("POST", f"/v1/sandboxes/{sb}/hibernate")
            wake.append(ms(lambda: (req("POST", f"/v1/sandboxes/{sb}/wake"), answered(sb)))[0])
        req("DELETE", f"/v1/sandboxes/{sb}")
        for _ in range(max(3, n // 4)):
            t, s2 = ms(lambda: create(template))
            fresh.append(t + ms(lambda: answered(s2["id"]))[0])
            req("DELETE", f"/v1/sandboxes/{s2['id']}")
        req("PUT", f"/v1/pools/{template}", {"size": 4})
        for _ in range(n):
            deadline = time.time() + 120
            while time.time() < deadline and not any(
                    p["ready"] > 0 for p in json.loads(req("GET", "/v1/pools"))
                    if p["template_name"] == template):
                time.sleep(0.2)
            t, s2 = ms(lambda: create(template))
            pooled.append(t + ms(lambda: answered(s2["id"]))[0])
            req("DELETE", f"/v1/sandboxes/{s2['id']}")
        req("PUT", f"/v1/pools/{template}", {"size": 0})
        print(f"{label}: to a file listing answered: wake p50 {pct(wake, .5):.0f} "
              f"p99 {pct(wake, .99):.0f} ms (n={n}); fresh restore p50 {pct(fresh, .5):.0f} ms "
              f"(n={len(fresh)}); pooled create p50 {pct(pooled, .5):.0f} p99 {pct(pooled, .99):.0f} ms (n={n})")

    series("quiet")
    hogs = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(os.cpu_count())]
    try:
        series("both cores busy")
    finally:
        for h in hogs:
            h.kill()


def meminfo(key):
    return meminfo_kib(key) // 1024


def daemon_pss():
    pid = subprocess.run(["pgrep", "-f", "husk serve"], capture_output=True, text=True).stdout.split()[0]
    for line in open(f"/proc/{pid}/smaps_rollup"):
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024


def many(template, n):
    drop_caches()
    a0, c0, p0 = meminfo("MemAvailable"), meminfo("Cached"), daemon_pss()
    t0 = time.time()
    for i in range(n):
        sb = create(template)["id"]
        req("PUT", f"/v1/sandboxes/{sb}/files?path=/tmp/mine", raw=str(i).encode())
        req("POST", f"/v1/sandboxes/{sb}/hibernate")
        if (i + 1) % 100 == 0:
            print(f"{i + 1} hibernated in {time.time() - t0:.0f} s", flush=True)
    subprocess.run(["sync"])
    a1, c1, p1 = meminfo("MemAvailable"), meminfo("Cached"), daemon_pss()
    listed = json.loads(req("GET", "/v1/sandboxes?state=hibernated"))
    disk = sum(s.get("disk_bytes") or 0 for s in listed)
    print(f"{n} hibernated: MemAvailable {a0} -> {a1} MiB, page cache {c0} -> {c1} MiB, "
          f"daemon PSS {p0:.1f} -> {p1:.1f} MiB, {disk / 2**20:.0f} MiB on disk")
    drop_caches()
    print(f"page cache dropped: MemAvailable {meminfo('MemAvailable')} MiB (at the start: {a0})")


if __name__ == "__main__":
    mode, template, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    {"cycles": cycles, "compare": compare, "many": many}[mode](template, n)
