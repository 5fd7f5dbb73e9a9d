"""Where a parked clone's memory goes (issue 25, item 5): N parked clones of
`base` in a warm pool; the host's memory before and after (caches dropped),
the kernel's share (slab, stacks, page tables) and each VMM's mappings.
Needs root (drop_caches), a daemon with nothing else running:

    husk serve --state-dir DIR --kernel K --initramfs I &      # release build
    husk template build base
    HUSK_HOST=DIR/husk.sock python3 benches/density.py 60
"""
import json, os, re, subprocess, sys, time

from husk_api import drop_caches, meminfo_kib as mi, req

N = int(sys.argv[1])
def slab():
    return mi("Slab"), mi("KernelStack"), mi("PageTables"), mi("SecPageTables") if mi("SecPageTables") is not None else 0
drop_caches(); time.sleep(1)
a0 = mi("MemAvailable"); s0 = slab(); c0 = mi("Cached")
req("PUT", "/v1/pools/base", {"size": N})
deadline = time.time() + 1800
while time.time() < deadline:
    p = [x for x in json.loads(req("GET", "/v1/pools")) if x["template_name"] == "base"][0]
    if p["ready"] >= N: break
    time.sleep(2)
time.sleep(5)
a1 = mi("MemAvailable"); s1 = slab(); c1 = mi("Cached")
pids = subprocess.run(["pgrep", "-x", "husk-vmm"], capture_output=True, text=True).stdout.split()
cat = {}
def add(k, v): cat[k] = cat.get(k, 0) + v
for pid in pids:
    try: smaps = open(f"/proc/{pid}/smaps").read()
    except OSError: continue
    name = None
    for line in smaps.splitlines():
        m = re.match(r"^[0-9a-f]+-[0-9a-f]+ \S+ \S+ \S+ \S+\s*(.*)$", line)
        if m:
            path = m.group(1)
            if "memfd" in path or "/memory" in path or path.endswith("mem") or "snapshot" in path: name = "guest memory (" + os.path.basename(path)[:20] + ")"
            elif path == "[heap]": name = "heap"
            elif path.startswith("[stack"): name = "main stack"
            elif path == "": name = "anonymous (thread stacks, allocator arenas)"
            elif path.startswith("/"): name = "binary and libraries"
            else: name = path
            continue
        if line.startswith("Private_Dirty:") or line.startswith("Private_Clean:") or line.startswith("Pss:"):
            k, v = line.split()[0].rstrip(":"), int(line.split()[1])
            add((name, k), v)
    st = open(f"/proc/{pid}/status").read()
    add(("_", "VmPTE"), int(re.search(r"VmPTE:\s+(\d+)", st).group(1)))
    add(("_", "threads"), int(re.search(r"Threads:\s+(\d+)", st).group(1)))
n = len(pids)
print(f"{n} husk-vmm processes ({N} parked clones); host MemAvailable {a0//1024} -> {a1//1024} MiB: {(a0-a1)/n:.0f} KiB per clone; page cache {c0//1024} -> {c1//1024} MiB")
print(f"kernel, per clone: slab {(s1[0]-s0[0])/n:.0f} KiB, kernel stacks {(s1[1]-s0[1])/n:.0f} KiB, page tables {(s1[2]-s0[2])/n:.0f} KiB, secondary page tables {(s1[3]-s0[3])/n:.0f} KiB")
names = sorted({k[0] for k in cat if k[0] != "_"})
for nm in names:
    print(f"  {nm}: Pss {cat.get((nm,'Pss'),0)/n:.0f} KiB, Private_Dirty {cat.get((nm,'Private_Dirty'),0)/n:.0f} KiB, Private_Clean {cat.get((nm,'Private_Clean'),0)/n:.0f} KiB per VMM")
print(f"  VmPTE {cat[('_','VmPTE')]/n:.0f} KiB, threads {cat[('_','threads')]/n:.1f} per VMM")
req("PUT", "/v1/pools/base", {"size": 0})
