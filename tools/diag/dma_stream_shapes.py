"""One process copying a 10 000-token prefix (625 random blocks x 32 layers of 64 KiB
pages) to and from consecutive 2 MiB entries of a registered /dev/shm pool, one
cuMemcpyBatchAsync per layer, in the shapes the engine could issue it:

* memory: this process's own allocation, or another process's opened by IPC handle
* streams: one stream, or one per layer with layer k waiting for layer k - depth's event
* chunks: one op of 625 blocks, or SAVE-like chunks of 64, 128, 256, 177 blocks
* client events: none, or each layer first waits for an IPC event the other process
  recorded (as an engine SAVE waits for the worker's layer event)

The 4 GiB single-copy ceiling into the same buffer is measured in the same run.

Ran on the H200 at commit 7618c01.
python tools/diag/dma_stream_shapes.py
"""
import ctypes
import mmap
import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.getcwd())
import numpy as np  # noqa: E402

L, NBLK, PAGE, N = 32, 2560, 65536, 625
ENTRY = L * PAGE
POOL = 1536 << 20
NB = L * N * PAGE
CHUNKS = (64, 128, 256, 177)


def owner(conn) -> None:
    """The other process: a KV allocation and 32 IPC events, recorded once."""
    import torch
    from pegaflow.cuda import driver
    torch.cuda.set_device(0)
    driver.init()
    kv = torch.randint(0, 255, (L, NBLK, PAGE), dtype=torch.uint8, device="cuda")
    base, _ = driver.address_range(kv.data_ptr())
    events = [driver.create_event(interprocess=True) for _ in range(L)]
    stream = torch.cuda.current_stream().cuda_stream
    for e in events:
        driver.record(e, stream)
    torch.cuda.synchronize()
    conn.send((driver.ipc_mem_handle(base), kv.data_ptr() - base,
               [driver.ipc_event_handle(e) for e in events]))
    conn.recv()


def main() -> None:
    import torch
    from pegaflow.cuda import driver
    torch.cuda.set_device(0)
    driver.init()
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=owner, args=(child,))
    proc.start()
    handle, offset, event_handles = parent.recv()
    remote = driver.open_ipc_mem(handle) + offset
    client_events = [driver.open_ipc_event(h) for h in event_handles]
    local = torch.randint(0, 255, (L, NBLK, PAGE), dtype=torch.uint8, device="cuda")
    rng = np.random.default_rng(0)
    ids = rng.choice(NBLK, N, replace=False).astype(np.int64)

    path = f"/dev/shm/pf-diag-shapes-{os.getpid()}"
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
    layer_streams = [driver.create_stream(low_priority=True) for _ in range(L)]
    spare = [driver.create_event() for _ in range(4 * L * len(CHUNKS))]
    driver.memcpy_async(host, scratch.data_ptr(), POOL, one)  # every page written once
    driver.synchronize_stream(one)

    def ceiling(d2h: bool) -> float:
        ts = []
        for _ in range(4):
            dst, src = (host, scratch.data_ptr()) if d2h else (scratch.data_ptr(), host)
            t0 = time.perf_counter()
            driver.memcpy_async(dst, src, POOL, one)
            driver.synchronize_stream(one)
            ts.append(time.perf_counter() - t0)
        return POOL / float(np.median(ts[1:])) / 1e9

    def issue(base: int, d2h: bool, per_layer: bool, depth: int, chunks, wait_client: bool):
        events = iter(spare)
        chain = []  # events of the latest layer copies, oldest first
        start = 0
        for size in chunks:
            blocks = ids[start:start + size]
            entries = np.arange(start, start + size, dtype=np.int64) * ENTRY
            start += size
            mine = []
            for k in range(L):
                stream = layer_streams[k] if per_layer else one
                if per_layer and len(chain) + len(mine) >= depth:
                    driver.wait(stream, (chain + mine)[-depth])
                if wait_client:
                    driver.wait(stream, client_events[k])
                gpu = (base + k * NBLK * PAGE + blocks * PAGE).astype(np.uint64)
                pool = (host + entries + k * PAGE).astype(np.uint64)
                dst, src = (pool, gpu) if d2h else (gpu, pool)
                driver.memcpy_batch_async(dst, src, PAGE, stream)
                if per_layer:
                    event = next(events)
                    driver.record(event, stream)
                    mine.append(event)
            chain = (chain + mine)[-depth:]
        issued = time.perf_counter()
        for s in (layer_streams if per_layer else [one]):
            driver.synchronize_stream(s)
        return issued

    def rate(*args) -> str:
        ts, issue_ms = [], []
        for _ in range(6):
            t0 = time.perf_counter()
            issued = issue(*args)
            ts.append(time.perf_counter() - t0)
            issue_ms.append((issued - t0) * 1e3)
        return f"{NB / float(np.median(ts[1:])) / 1e9:6.2f} (issued in {np.median(issue_ms[1:]):5.1f} ms)"

    print(f"ceiling d2h {ceiling(True):.2f} h2d {ceiling(False):.2f} GB/s", flush=True)
    shapes = [
        ("local  one-stream  one-op        ", local.data_ptr(), False, 1, (N,), False),
        ("ipc    one-stream  one-op        ", remote, False, 1, (N,), False),
        ("ipc    one-stream  one-op  +ev   ", remote, False, 1, (N,), True),
        ("ipc    layer-d2    one-op        ", remote, True, 2, (N,), False),
        ("ipc    layer-d4    one-op        ", remote, True, 4, (N,), False),
        ("ipc    layer-d4    one-op  +ev   ", remote, True, 4, (N,), True),
        ("ipc    one-stream  chunks  +ev   ", remote, False, 1, CHUNKS, True),
        ("ipc    layer-d4    chunks  +ev   ", remote, True, 4, CHUNKS, True),
        ("ipc    layer-d32   chunks  +ev   ", remote, True, 32, CHUNKS, True),
        ("ipc    layer-d2    one-op  +ev   ", remote, True, 2, (N,), True),
        ("local  layer-d4    one-op        ", local.data_ptr(), True, 4, (N,), False),
    ]
    for name, base, per_layer, depth, chunks, wait_client in shapes + shapes:
        d2h = rate(base, True, per_layer, depth, chunks, wait_client)
        h2d = rate(base, False, per_layer, depth, chunks, wait_client)
        print(f"{name} d2h {d2h}  h2d {h2d}", flush=True)
    print(f"ceiling d2h {ceiling(True):.2f} h2d {ceiling(False):.2f} GB/s", flush=True)
    parent.send(None)
    proc.join(10)


if __name__ == "__main__":
    main()
