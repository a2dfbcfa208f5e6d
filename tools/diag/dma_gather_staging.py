"""One process, torch and the driver API: scattered 64 KiB device->host copies against a
gather into device staging followed by 2 MiB copies (and the reverse for loads).

Ran on the H200 at commit 85d79e1.  python tools/diag/dma_gather_staging.py
"""
import os, sys, time
sys.path.insert(0, os.getcwd())
import numpy as np, torch
from pegaflow.cuda import driver
from cuda.bindings import driver as cd

L, NBLK, PAGE, N = 32, 2560, 65536, 625
RUN = 32  # pages per contiguous pool run (one 64 MiB slab of 2 MiB entries, layer-major)
torch.cuda.set_device(0)
kv = torch.randint(0, 255, (L, NBLK, PAGE), dtype=torch.uint8, device="cuda")
pool = torch.empty(L * N * PAGE + (64 << 20), dtype=torch.uint8, pin_memory=True)
stag = [torch.empty(N * PAGE, dtype=torch.uint8, device="cuda") for _ in range(2)]
streams = [torch.cuda.Stream() for _ in range(2)]
rng = np.random.default_rng(0)
ids = np.sort(rng.choice(NBLK, N, replace=False))
rng.shuffle(ids)
ids_t = torch.as_tensor(ids, device="cuda")
base = kv.data_ptr(); pbase = pool.data_ptr()
NB = L * N * PAGE

def timed(fn, reps=6):
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize(); t0 = time.perf_counter(); fn(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t0)
    return NB / float(np.median(ts[1:])) / 1e9

# (a) scattered 64 KiB D2H (entry-major pool: page (i, l) at i*L*PAGE + l*PAGE), one batch per layer
def a():
    for l in range(L):
        s = streams[l % 2]
        src = (base + l * NBLK * PAGE + ids * PAGE).astype(np.uint64)
        dst = (pbase + np.arange(N) * L * PAGE + l * PAGE).astype(np.uint64)
        driver.memcpy_batch_async(dst, src, PAGE, cd.CUstream(s.cuda_stream))
# layer-major pool: layer l region at l*N*PAGE, entries consecutive
def d2h_runs(l, s, src_base):
    for r in range(0, N, RUN):
        n = min(RUN, N - r)
        driver.memcpy_async(pbase + (l * N + r) * PAGE, src_base + r * PAGE, n * PAGE, cd.CUstream(s.cuda_stream))
# (b) torch gather kernel into staging + D2H runs
def b():
    for l in range(L):
        s = streams[l % 2]
        with torch.cuda.stream(s):
            torch.index_select(kv[l], 0, ids_t, out=stag[l % 2].view(N, PAGE))
        d2h_runs(l, s, stag[l % 2].data_ptr())
# (c) CE D2D batch gather into staging + D2H runs
def c():
    for l in range(L):
        s = streams[l % 2]
        src = (base + l * NBLK * PAGE + ids * PAGE).astype(np.uint64)
        dst = (stag[l % 2].data_ptr() + np.arange(N) * PAGE).astype(np.uint64)
        driver.memcpy_batch_async(dst, src, PAGE, cd.CUstream(s.cuda_stream))
        d2h_runs(l, s, stag[l % 2].data_ptr())
# (d) upper bound: contiguous source, D2H runs
def d():
    for l in range(L):
        d2h_runs(l, streams[l % 2], stag[l % 2].data_ptr())
# (e) H2D scattered 64 KiB  (f) H2D runs into staging + torch scatter
def e():
    for l in range(L):
        s = streams[l % 2]
        dst = (base + l * NBLK * PAGE + ids * PAGE).astype(np.uint64)
        src = (pbase + np.arange(N) * L * PAGE + l * PAGE).astype(np.uint64)
        driver.memcpy_batch_async(dst, src, PAGE, cd.CUstream(s.cuda_stream))
def f():
    for l in range(L):
        s = streams[l % 2]
        for r in range(0, N, RUN):
            n = min(RUN, N - r)
            driver.memcpy_async(stag[l % 2].data_ptr() + r * PAGE, pbase + (l * N + r) * PAGE, n * PAGE, cd.CUstream(s.cuda_stream))
        with torch.cuda.stream(s):
            kv[l].index_copy_(0, ids_t, stag[l % 2].view(N, PAGE))
# ceiling
big = torch.empty(4 << 30, dtype=torch.uint8, device="cuda"); hb = torch.empty(4 << 30, dtype=torch.uint8, pin_memory=True)
ts = []
for _ in range(4):
    torch.cuda.synchronize(); t0 = time.perf_counter(); hb.copy_(big, non_blocking=True); torch.cuda.synchronize(); ts.append(time.perf_counter() - t0)
print(f"ceiling d2h {(4<<30)/np.median(ts[1:])/1e9:.2f}")
for name, fn in (("a scattered d2h", a), ("b torch-gather+runs d2h", b), ("c ce-gather+runs d2h", c), ("d runs only d2h", d), ("e scattered h2d", e), ("f runs+torch-scatter h2d", f)):
    print(f"{name:28} {timed(fn):6.2f} GB/s", flush=True)
# correctness of (b): layer 3 pages
b(); torch.cuda.synchronize()
l = 3; got = pool[l * N * PAGE:(l + 1) * N * PAGE].view(N, PAGE).cuda()
print("b exact:", bool(torch.equal(got, kv[l][ids_t])))
