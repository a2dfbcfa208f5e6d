"""One process: a 10 000-token save and load (625 random blocks x 32 layers of 64 KiB pages,
vLLM's layer-major layout) between device memory and consecutive (or random, sorted) 2 MiB
pool entries of a registered /dev/shm buffer, with one cuMemcpyBatchAsync per group of G
layers, pages ordered entry by entry inside the group (G = 32: the host side is written
strictly in address order), on 1 or 4 streams, with and without the overlap-with-compute
flag.  The 4 GiB single-copy ceiling into the same buffer is measured in the same run.

Ran on the H200 at commit 7618c01.
python tools/diag/dma_layer_groups.py
"""
import ctypes
import mmap
import os
import sys
import time

sys.path.insert(0, os.getcwd())
import numpy as np  # noqa: E402
import torch  # noqa: E402

from pegaflow.cuda import driver  # noqa: E402

L, NBLK, PAGE, N = 32, 2560, 65536, 625
ENTRY = L * PAGE
POOL = 4608 << 20
NB = L * N * PAGE


def main() -> None:
    torch.cuda.set_device(0)
    driver.init()
    kv = torch.randint(0, 255, (L, NBLK, PAGE), dtype=torch.uint8, device="cuda")
    base = kv.data_ptr()
    rng = np.random.default_rng(0)
    ids = rng.choice(NBLK, N, replace=False).astype(np.int64)
    path = f"/dev/shm/pf-diag-groups-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, POOL)
    m = mmap.mmap(fd, POOL)
    os.close(fd)
    os.unlink(path)
    host = ctypes.addressof(ctypes.c_char.from_buffer(m))
    np.frombuffer(m, np.uint8)[::4096] = 1
    driver.host_register(host, POOL)
    scratch = torch.empty(POOL, dtype=torch.uint8, device="cuda")
    streams = [driver.create_stream(low_priority=True) for _ in range(4)]
    # every host page written once by DMA first (the engine does this at attach)
    driver.memcpy_async(host, scratch.data_ptr(), POOL, streams[0])
    driver.synchronize_stream(streams[0])

    def ceiling(d2h: bool) -> float:
        ts = []
        for _ in range(4):
            dst, src = (host, scratch.data_ptr()) if d2h else (scratch.data_ptr(), host)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            driver.memcpy_async(dst, src, 4 << 30, streams[0])
            driver.synchronize_stream(streams[0])
            ts.append(time.perf_counter() - t0)
        return (4 << 30) / float(np.median(ts[1:])) / 1e9

    consecutive = np.arange(N, dtype=np.int64) * ENTRY
    scattered = np.sort(rng.choice(POOL // ENTRY, N, replace=False)).astype(np.int64) * ENTRY
    plans = {}
    for ename, entries in (("consec", consecutive), ("random", scattered)):
        for g in (1, 2, 4, 8, 32):
            batches = []
            for g0 in range(0, L, g):
                layers = np.arange(g0, g0 + g, dtype=np.int64)
                gpu = (base + layers[None, :] * (NBLK * PAGE) + ids[:, None] * PAGE).ravel()
                pool = (host + entries[:, None] + layers[None, :] * PAGE).ravel()
                batches.append((gpu.astype(np.uint64), pool.astype(np.uint64)))
            plans[(ename, g)] = batches

    def run(batches, d2h: bool, nstreams: int) -> tuple[float, float]:
        ts, issue = [], []
        for _ in range(6):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i, (gpu, pool) in enumerate(batches):
                dst, src = (pool, gpu) if d2h else (gpu, pool)
                driver.memcpy_batch_async(dst, src, PAGE, streams[i % nstreams])
            t1 = time.perf_counter()
            for s in streams[:nstreams]:
                driver.synchronize_stream(s)
            ts.append(time.perf_counter() - t0)
            issue.append(t1 - t0)
        return NB / float(np.median(ts[1:])) / 1e9, float(np.median(issue[1:])) * 1e3

    print(f"ceiling d2h {ceiling(True):.2f} h2d {ceiling(False):.2f} GB/s", flush=True)
    for flag in ("overlap", "none"):
        if flag == "none":
            batch = driver._batch_copy
            batch.attrs.flags = 0
        for (ename, g), batches in plans.items():
            for nstreams in (1, 4):
                d2h, d2h_issue = run(batches, True, nstreams)
                h2d, h2d_issue = run(batches, False, nstreams)
                print(f"{flag:7} {ename} G={g:2} streams={nstreams}: d2h {d2h:6.2f} (issue "
                      f"{d2h_issue:5.1f} ms)  h2d {h2d:6.2f} (issue {h2d_issue:5.1f} ms)", flush=True)
    print(f"ceiling d2h {ceiling(True):.2f} h2d {ceiling(False):.2f} GB/s", flush=True)


if __name__ == "__main__":
    main()
