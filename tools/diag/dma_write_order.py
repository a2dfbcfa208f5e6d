"""One process: 64 KiB device->host and host->device copies into torch pinned memory, a
registered /dev/shm buffer, and one with transparent huge pages advised, with host pages in
address order or in random order, on high- and low-priority streams.

Ran on the H200 at commit 85d79e1.  python tools/diag/dma_write_order.py
"""
import ctypes, mmap, os, sys, time
sys.path.insert(0, os.getcwd())
import numpy as np, torch
from pegaflow.cuda import driver
from cuda.bindings import driver as cd

for f in ("enabled", "shmem_enabled", "defrag"):
    try: print(f, open(f"/sys/kernel/mm/transparent_hugepage/{f}").read().strip())
    except OSError as e: print(f, e)
L, NBLK, PAGE, N = 32, 2560, 65536, 625
POOL = 4608 << 20
ENTRY = L * PAGE
torch.cuda.set_device(0)
kv = torch.randint(0, 255, (L, NBLK, PAGE), dtype=torch.uint8, device="cuda")
rng = np.random.default_rng(0)
ids = rng.choice(NBLK, N, replace=False)
base = kv.data_ptr()
NB = L * N * PAGE
hi = [torch.cuda.Stream() for _ in range(2)]
lo_raw = [driver.create_stream(low_priority=True) for _ in range(2)]

def shm_buf(name, huge):
    path = f"/dev/shm/{name}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600); os.ftruncate(fd, POOL)
    m = mmap.mmap(fd, POOL); os.close(fd); os.unlink(path)
    if huge: m.madvise(mmap.MADV_HUGEPAGE)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    np.frombuffer(m, np.uint8)[::4096] = 1  # touch
    driver.host_register(addr, POOL)
    return m, addr

pinned = torch.empty(POOL, dtype=torch.uint8, pin_memory=True)
bufs = {"torch-pinned": pinned.data_ptr()}
keep = []
for nm, huge in (("shm-4k", False), ("shm-thp", True)):
    m, a = shm_buf(f"stg2{os.getpid()}{nm}", huge); keep.append(m); bufs[nm] = a
print([l for l in open("/proc/meminfo") if "Huge" in l or "Shmem" in l])
seq = np.arange(N) * ENTRY
rnd = rng.choice(POOL // ENTRY, N, replace=False) * ENTRY

def run(pbase, entries, d2h, streams):
    for l in range(L):
        s = streams[l % 2]
        g = (base + l * NBLK * PAGE + ids * PAGE).astype(np.uint64)
        h = (pbase + entries + l * PAGE).astype(np.uint64)
        dst, src = (h, g) if d2h else (g, h)
        driver.memcpy_batch_async(dst, src, PAGE, s)

def timed(*a, reps=6):
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize(); t0 = time.perf_counter(); run(*a); torch.cuda.synchronize(); ts.append(time.perf_counter() - t0)
    return NB / float(np.median(ts[1:])) / 1e9

for bn, pb in bufs.items():
    for en, ent in (("seq", seq), ("rnd", rnd)):
        for sn, st in (("hi", [cd.CUstream(s.cuda_stream) for s in hi]), ("lo", lo_raw)):
            print(f"{bn:13} {en} {sn}: d2h {timed(pb, ent, True, st):6.2f}  h2d {timed(pb, ent, False, st):6.2f}", flush=True)
