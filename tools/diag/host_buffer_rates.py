"""The machine's NUMA layout and GPU affinity, then 64 KiB-page and 1 GiB copies each way
between device memory and a /dev/shm buffer first touched by each NUMA node's CPUs.

Ran on the H200 at commit 85d79e1 (one NUMA node visible).  python tools/diag/host_buffer_rates.py
"""
import ctypes, mmap, os, subprocess, sys, time, glob
sys.path.insert(0, os.getcwd())
import numpy as np, torch
from pegaflow.cuda import driver
from cuda.bindings import driver as cd
nodes = sorted(glob.glob("/sys/devices/system/node/node[0-9]*"))
for n in nodes: print(n, open(n + "/cpulist").read().strip())
print(subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True).stdout)
bus = subprocess.run(["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
for p in glob.glob("/sys/bus/pci/devices/*"):
    if p.split("/")[-1].lower() == bus.lower()[4:] or p.split("/")[-1].lower() == bus.lower():
        print("gpu", p, "numa_node", open(p + "/numa_node").read().strip(), "local_cpulist", open(p + "/local_cpulist").read().strip())
print("affinity", sorted(os.sched_getaffinity(0)))
def cpus(n):
    out = set()
    for part in open(n + "/cpulist").read().strip().split(","):
        a, _, b = part.partition("-"); out |= set(range(int(a), int(b or a) + 1))
    return out
L, NBLK, PAGE, N, POOL = 32, 2560, 65536, 625, 2 << 30
torch.cuda.set_device(0)
kv = torch.randint(0, 255, (L, NBLK, PAGE), dtype=torch.uint8, device="cuda")
ids = np.random.default_rng(0).choice(NBLK, N, replace=False); base = kv.data_ptr()
big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
st = [torch.cuda.Stream() for _ in range(2)]
allc = os.sched_getaffinity(0)
for n in nodes:
    os.sched_setaffinity(0, cpus(n) & allc or allc)
    fd = os.open("/dev/shm/numa_t", os.O_RDWR | os.O_CREAT, 0o600); os.ftruncate(fd, POOL)
    m = mmap.mmap(fd, POOL); os.close(fd); os.unlink("/dev/shm/numa_t")
    np.frombuffer(m, np.uint8)[::4096] = 1
    os.sched_setaffinity(0, allc)
    a = ctypes.addressof(ctypes.c_char.from_buffer(m)); driver.host_register(a, POOL)
    def run(d2h):
        for l in range(L):
            g = (base + l * NBLK * PAGE + ids * PAGE).astype(np.uint64)
            h = (a + np.arange(N) * PAGE * 2 + (l % 2) * PAGE).astype(np.uint64)
            dst, src = (h, g) if d2h else (g, h)
            driver.memcpy_batch_async(dst, src, PAGE, cd.CUstream(st[l % 2].cuda_stream))
    res = []
    for d2h in (True, False):
        ts = []
        for _ in range(5):
            torch.cuda.synchronize(); t0 = time.perf_counter(); run(d2h); torch.cuda.synchronize(); ts.append(time.perf_counter() - t0)
        res.append(L * N * PAGE / np.median(ts[1:]) / 1e9)
    for d2h in (True, False):
        ts = []
        for _ in range(4):
            torch.cuda.synchronize(); t0 = time.perf_counter()
            driver.memcpy_async(a if d2h else big.data_ptr(), big.data_ptr() if d2h else a, 1 << 30, cd.CUstream(st[0].cuda_stream))
            torch.cuda.synchronize(); ts.append(time.perf_counter() - t0)
        res.append((1 << 30) / np.median(ts[1:]) / 1e9)
    print(f"{n}: 64KiB d2h {res[0]:.2f} h2d {res[1]:.2f}; 1GiB d2h {res[2]:.2f} h2d {res[3]:.2f}", flush=True)
    driver.host_unregister(a); del m
