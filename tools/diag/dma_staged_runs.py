"""One process: a 10 000-token save and load (625 random blocks x 32 layers of 64 KiB
pages, vLLM's layer-major layout) to and from consecutive 2 MiB entries of a registered
/dev/shm pool, scattered (one cuMemcpyBatchAsync per layer: 20 000 page copies) against
staged through device memory: per sub-chunk of S entries, the engine's gather kernel
packs the entries' pages in pool layout into a device slot (one launch per layer), then
one copy moves the slot to the pool (loads: the reverse), the two on their own streams
with a ring of slots.  Rates and issue times; the 4 GiB-class ceiling in the same run.

Ran on the H200 at commit 7618c01.
python tools/diag/dma_staged_runs.py
"""
import ctypes
import mmap
import os
import sys
import time

sys.path.insert(0, os.getcwd())
import numpy as np  # noqa: E402
import torch  # noqa: E402

from engine.copy.kernels import CopyKernel  # noqa: E402
from pegaflow.cuda import driver  # noqa: E402

L, NBLK, PAGE, N = 32, 2560, 65536, 625
ENTRY = L * PAGE
POOL = 1536 << 20
NB = L * N * PAGE


def main() -> None:
    torch.cuda.set_device(0)
    driver.init()
    kv = torch.randint(0, 255, (L, NBLK, PAGE), dtype=torch.uint8, device="cuda")
    base = kv.data_ptr()
    rng = np.random.default_rng(0)
    ids = rng.choice(NBLK, N, replace=False).astype(np.int64)
    ids_dev = torch.as_tensor(ids, device="cuda")
    path = f"/dev/shm/pf-diag-staged-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, POOL)
    m = mmap.mmap(fd, POOL)
    os.close(fd)
    os.unlink(path)
    host = ctypes.addressof(ctypes.c_char.from_buffer(m))
    np.frombuffer(m, np.uint8)[::4096] = 1
    driver.host_register(host, POOL)
    scratch = torch.empty(POOL, dtype=torch.uint8, device="cuda")
    one = driver.create_stream(low_priority=True)
    driver.memcpy_async(host, scratch.data_ptr(), POOL, one)
    driver.synchronize_stream(one)
    layer_streams = [driver.create_stream(low_priority=True) for _ in range(L)]
    gather_stream = driver.create_stream(low_priority=True)
    copy_stream = driver.create_stream(low_priority=True)
    events = [driver.create_event() for _ in range(4096)]

    def ceiling(d2h: bool) -> float:
        ts = []
        for _ in range(4):
            dst, src = (host, scratch.data_ptr()) if d2h else (scratch.data_ptr(), host)
            t0 = time.perf_counter()
            driver.memcpy_async(dst, src, POOL, one)
            driver.synchronize_stream(one)
            ts.append(time.perf_counter() - t0)
        return POOL / float(np.median(ts[1:])) / 1e9

    def scattered(d2h: bool) -> float:
        depth = 4
        ev = iter(events)
        mine = []
        for k in range(L):
            s = layer_streams[k]
            if k >= depth:
                driver.wait(s, mine[k - depth])
            gpu = (base + k * NBLK * PAGE + ids * PAGE).astype(np.uint64)
            pool = (host + np.arange(N, dtype=np.int64) * ENTRY + k * PAGE).astype(np.uint64)
            dst, src = (pool, gpu) if d2h else (gpu, pool)
            driver.memcpy_batch_async(dst, src, PAGE, s)
            e = next(ev)
            driver.record(e, s)
            mine.append(e)
        issued = time.perf_counter()
        for s in layer_streams:
            driver.synchronize_stream(s)
        return issued

    def staged(d2h: bool, kernel: CopyKernel, per_slot: int, slots: list[int],
               local_offsets: int) -> float:
        ev = iter(events)
        free = [None] * len(slots)
        for j, start in enumerate(range(0, N, per_slot)):
            n = min(per_slot, N - start)
            s = j % len(slots)
            slot = slots[s]
            ids_ptr = ids_dev.data_ptr() + 8 * start
            first, then = (gather_stream, copy_stream) if d2h else (copy_stream, gather_stream)
            if free[s] is not None:
                driver.wait(first, free[s])
            if d2h:
                for k in range(L):
                    kernel.launch(gather_stream, ids_ptr, local_offsets, n, base + k * NBLK * PAGE,
                                  PAGE, slot + k * PAGE, PAGE, True)
            else:
                driver.memcpy_async(slot, host + start * ENTRY, n * ENTRY, copy_stream)
            handoff = next(ev)
            driver.record(handoff, first)
            driver.wait(then, handoff)
            if d2h:
                driver.memcpy_async(host + start * ENTRY, slot, n * ENTRY, copy_stream)
            else:
                for k in range(L):
                    kernel.launch(gather_stream, ids_ptr, local_offsets, n, base + k * NBLK * PAGE,
                                  PAGE, slot + k * PAGE, PAGE, False)
            free[s] = next(ev)
            driver.record(free[s], then)
        issued = time.perf_counter()
        driver.synchronize_stream(gather_stream)
        driver.synchronize_stream(copy_stream)
        return issued

    def rate(fn, *args) -> str:
        ts, issue_ms = [], []
        for _ in range(6):
            t0 = time.perf_counter()
            issued = fn(*args)
            ts.append(time.perf_counter() - t0)
            issue_ms.append((issued - t0) * 1e3)
        return f"{NB / float(np.median(ts[1:])) / 1e9:6.2f} (issued in {np.median(issue_ms[1:]):5.1f} ms)"

    staging = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    offsets = torch.arange(N, dtype=torch.int64, device="cuda") * ENTRY
    print(f"ceiling d2h {ceiling(True):.2f} h2d {ceiling(False):.2f} GB/s", flush=True)
    for rep in range(2):
        print(f"scattered d4          d2h {rate(scattered, True)}  h2d {rate(scattered, False)}",
              flush=True)
        for ctas in (16, 32):
            kernel = CopyKernel(0, ctas)
            for per_slot, nslots in ((16, 2), (16, 4), (32, 2), (32, 4), (64, 2)):
                slot_bytes = per_slot * ENTRY
                slots = [staging.data_ptr() + i * slot_bytes for i in range(nslots)]
                if nslots * slot_bytes > staging.numel():
                    continue
                args = (kernel, per_slot, slots, offsets.data_ptr())
                print(f"staged ctas={ctas:2} S={per_slot:2} slots={nslots} d2h "
                      f"{rate(staged, True, *args)}  h2d {rate(staged, False, *args)}", flush=True)
            kernel.close()
    kernel = CopyKernel(0, 16)
    staged(True, kernel, 32, [staging.data_ptr(), staging.data_ptr() + 32 * ENTRY], offsets.data_ptr())
    pool = np.frombuffer(m, np.uint8)
    bad = 0
    for i in rng.choice(N, 40, replace=False):
        for k in rng.choice(L, 4, replace=False):
            want = kv[k, ids[i]].cpu().numpy()
            bad += not np.array_equal(pool[i * ENTRY + k * PAGE:i * ENTRY + (k + 1) * PAGE], want)
    print(f"staged save: {bad} of 160 sampled pages differ", flush=True)
    print(f"ceiling d2h {ceiling(True):.2f} h2d {ceiling(False):.2f} GB/s", flush=True)


if __name__ == "__main__":
    main()
