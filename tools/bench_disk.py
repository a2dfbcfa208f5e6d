"""Disk tier throughput: blocks written from and read back into page-aligned memory (as the
pool's pages are) by the tier's store, with its I/O threads, checksums and one file per
block, against a raw sequential direct-I/O write and read of one file on the same file system
(single stream, one block a request, as ``dd oflag=direct`` / ``iflag=direct``; of the same
random bytes) measured in the same run, phases interleaved.  Two more
read columns tell a slow read's cause apart: ``pool read`` (a thread pool of direct ``preadv``
of the raw file, one block each: parallel reads without one file per block) and the tier's
read at each of ``--read-threads`` (and its write at each of ``--write-threads``); where
KvikIO is installed, ``kvikio read``: KvikIO's own thread pool reading the tier's block
files into the same memory.

    python -m tools.bench_disk --dir /nvme/pegaflow-bench [--json]

Sets (``--sets name:blocks``): a 10k-token Llama-3.1-8B prefix (625 blocks of 2 MiB: 32
layers x 64 KiB) and a multi-GB working set.  Every read is checked against what was
written.  The directory's file system must have room for the largest set twice.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SETS = ("prefix_10k:625", "working_4gib:2048")


def _settle(store, count: int, timeout_s: float = 600.0) -> list:
    done, deadline = [], time.monotonic() + timeout_s
    while len(done) < count:
        done += store.poll()
        if time.monotonic() > deadline:
            raise RuntimeError(f"{count - len(done)} of {count} disk operations unfinished")
        time.sleep(1e-3)
    return done


def tier_write(directory: Path, data: np.ndarray, block_bytes: int, threads: int) -> float:
    """Seconds the store takes to write every block of ``data`` (a fresh directory)."""
    from engine.disk.store import DiskStore
    shutil.rmtree(directory, ignore_errors=True)
    store = DiskStore([directory], data.nbytes * 2, threads)
    try:
        count = data.nbytes // block_bytes
        t0 = time.perf_counter()
        for i in range(count):
            if not store.try_write(_key(i), data[i * block_bytes:(i + 1) * block_bytes], i, 32):
                raise RuntimeError(f"write {i} refused")
        errors = [d.error for d in _settle(store, count) if d.error]
        seconds = time.perf_counter() - t0
    finally:
        store.close()
    if errors:
        raise RuntimeError(f"{len(errors)} writes failed: {errors[0]}")
    return seconds


def tier_read(directory: Path, expected: np.ndarray, block_bytes: int, threads: int) -> float:
    """Seconds a new store (files taken in by ``scan``) takes to read every block back;
    the bytes are checked against ``expected``."""
    from engine.disk.blockfile import aligned_buffer
    from engine.disk.store import DiskStore
    store = DiskStore([directory], expected.nbytes * 2, threads)
    dst = aligned_buffer(expected.nbytes)
    try:
        count = store.scan()
        if count != expected.nbytes // block_bytes:
            raise RuntimeError(f"scan found {count} blocks")
        t0 = time.perf_counter()
        for i in range(count):
            store.try_read(_key(i), dst[i * block_bytes:(i + 1) * block_bytes], i)
        errors = [d.error for d in _settle(store, count) if d.error]
        seconds = time.perf_counter() - t0
    finally:
        store.close()
    if errors or not np.array_equal(dst, expected):
        raise RuntimeError(f"read back wrong: {errors[:1] or 'bytes differ'}")
    return seconds


class KvikioUnusable(RuntimeError):
    """KvikIO imports but cannot read on this machine."""


def kvikio_read(directory: Path, expected: np.ndarray, block_bytes: int, threads: int) -> float | None:
    """Seconds KvikIO (its own thread pool of ``threads``) takes to read every block file's
    data into the same kind of memory (no checksum, no index); None without KvikIO."""
    try:
        import kvikio
        import kvikio.defaults
    except ImportError:
        return None
    from engine.disk.blockfile import HEADER_BYTES, aligned_buffer, block_path_text
    dst = aligned_buffer(expected.nbytes)
    count = expected.nbytes // block_bytes
    try:
        with kvikio.defaults.set({"num_threads": threads, "task_size": block_bytes}):
            files = [kvikio.CuFile(block_path_text(str(directory), _key(i)), "r") for i in range(count)]
            try:
                t0 = time.perf_counter()
                futures = [f.pread(dst[i * block_bytes:(i + 1) * block_bytes], block_bytes, HEADER_BYTES)
                           for i, f in enumerate(files)]
                num_read = sum(future.get() for future in futures)
                seconds = time.perf_counter() - t0
            finally:
                for f in files:
                    f.close()
    except RuntimeError as exc:  # KvikIO installed but unusable here (no libcuda, no cuFile)
        raise KvikioUnusable(str(exc)) from exc
    if num_read != expected.nbytes or not np.array_equal(dst, expected):
        raise RuntimeError("KvikIO read back wrong bytes")
    return seconds


def _key(i: int) -> tuple[int, bytes]:
    return 1, i.to_bytes(32, "little") + bytes([32])


def raw(directory: Path, data: np.ndarray, block_bytes: int, write: bool) -> tuple[float, bool]:
    """Seconds of one sequential single-stream pass over one file of ``data``'s bytes, one
    ``block_bytes`` request at a time (what ``dd bs=... oflag=direct`` / ``iflag=direct``
    does), direct I/O where the file system takes it; and whether it was direct.  The
    bytes are ``data``'s, not zeros: a virtual disk may store zero-filled writes as holes
    and read them back faster than data.  A read is checked against ``data``."""
    from engine.disk.blockfile import aligned_buffer
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / "raw.bin"
    flags = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if write else os.O_RDONLY
    try:
        fd, direct = os.open(target, flags | getattr(os, "O_DIRECT", 0), 0o644), hasattr(os, "O_DIRECT")
    except OSError:  # tmpfs and the like refuse O_DIRECT
        fd, direct = os.open(target, flags, 0o644), False
    buf = data if write else aligned_buffer(data.nbytes)
    try:
        t0 = time.perf_counter()
        for offset in range(0, data.nbytes, block_bytes):
            view = memoryview(buf[offset:offset + block_bytes])
            num = os.pwritev(fd, [view], offset) if write else os.preadv(fd, [view], offset)
            if num != view.nbytes:
                raise RuntimeError(f"raw {'write' if write else 'read'} moved {num} of {view.nbytes} bytes")
        if write and not direct:
            os.fsync(fd)
        seconds = time.perf_counter() - t0
    finally:
        os.close(fd)
    if not write and not np.array_equal(buf, data):
        raise RuntimeError("raw read back wrong bytes")
    return seconds, direct


def pool_read(directory: Path, num_bytes: int, block_bytes: int, threads: int) -> float:
    """Seconds ``threads`` threads take to read the raw file, one direct ``preadv`` of
    ``block_bytes`` per block (no checksum, no file per block)."""
    from engine.disk.blockfile import aligned_buffer
    dst = aligned_buffer(num_bytes)
    try:
        fd = os.open(directory / "raw.bin", os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    except OSError:  # a file system without direct I/O (tmpfs): as ``raw`` does, buffered
        fd = os.open(directory / "raw.bin", os.O_RDONLY)
    try:
        def read(i: int) -> int:
            return os.preadv(fd, [memoryview(dst[i * block_bytes:(i + 1) * block_bytes])], i * block_bytes)
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            num_read = sum(pool.map(read, range(num_bytes // block_bytes)))
        seconds = time.perf_counter() - t0
    finally:
        os.close(fd)
    if num_read != num_bytes:
        raise RuntimeError(f"pool read {num_read} of {num_bytes} bytes")
    return seconds


def run_set(directory: Path, name: str, count: int, block_bytes: int, threads: int, repeats: int,
            read_threads: tuple[int, ...] = (), write_threads: tuple[int, ...] = ()) -> dict:
    from engine.disk.blockfile import aligned_buffer
    data = aligned_buffer(count * block_bytes)
    data[:] = np.random.default_rng(0).integers(0, 256, data.nbytes, dtype=np.uint8)
    times: dict[str, list[float]] = {"raw_write": [], "tier_write": [], "raw_read": [], "tier_read": [],
                                     "pool_read": [], "kvikio_read": [],
                                     **{f"tier_read_t{n}": [] for n in read_threads},
                                     **{f"tier_write_t{n}": [] for n in write_threads}}
    is_direct = True
    use_kvikio = True
    tier_dir, raw_dir = directory / f"{name}-tier", directory / f"{name}-raw"
    tier_write(tier_dir, data[:8 * block_bytes], block_bytes, threads)  # warm-up (not timed):
    tier_read(tier_dir, data[:8 * block_bytes], block_bytes, threads)   # threads, imports, dirs
    for _ in range(repeats):  # interleaved: raw write, tier write, raw read, tier read
        seconds, direct = raw(raw_dir, data, block_bytes, write=True)
        times["raw_write"].append(seconds)
        times["tier_write"].append(tier_write(tier_dir, data, block_bytes, threads))
        seconds, direct_read = raw(raw_dir, data, block_bytes, write=False)
        times["raw_read"].append(seconds)
        times["tier_read"].append(tier_read(tier_dir, data, block_bytes, threads))
        times["pool_read"].append(pool_read(raw_dir, data.nbytes, block_bytes, threads))
        if use_kvikio:
            try:
                if (seconds := kvikio_read(tier_dir, data, block_bytes, threads)) is not None:
                    times["kvikio_read"].append(seconds)
            except KvikioUnusable as exc:
                print(f"bench_disk: KvikIO column left out: {exc}", file=sys.stderr)
                use_kvikio = False
        for n in read_threads:
            times[f"tier_read_t{n}"].append(tier_read(tier_dir, data, block_bytes, n))
        for n in write_threads:
            times[f"tier_write_t{n}"].append(tier_write(tier_dir, data, block_bytes, n))
        is_direct = is_direct and direct and direct_read
    shutil.rmtree(tier_dir, ignore_errors=True)
    shutil.rmtree(raw_dir, ignore_errors=True)
    return summarize_set(name, count, block_bytes, times, is_direct)


def summarize_set(name: str, count: int, block_bytes: int, times: dict[str, list[float]], is_direct: bool) -> dict:
    num_bytes = count * block_bytes
    gbps = {kind: [num_bytes / s / 1e9 for s in values] for kind, values in times.items() if values}
    med = {kind: statistics.median(values) for kind, values in gbps.items()}
    return {"set": name, "blocks": count, "block_bytes": block_bytes, "bytes": num_bytes,
            "raw_is_direct": is_direct, **{f"{k}_gbps": v for k, v in med.items()},
            **{f"{k}_gbps_each": v for k, v in gbps.items()},
            "read_ratio_vs_raw": med["tier_read"] / med["raw_read"],
            "write_ratio_vs_raw": med["tier_write"] / med["raw_write"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=str(ROOT / ".bench-disk"),
                   help="a directory on the drive to measure (the bench works in a new folder inside it)")
    p.add_argument("--sets", nargs="+", default=list(DEFAULT_SETS), help="name:blocks")
    p.add_argument("--block-mib", type=float, default=2.0, help="bytes of one block (MiB)")
    p.add_argument("--threads", type=int, default=8, help="the store's I/O threads (--disk-threads)")
    p.add_argument("--read-threads", type=int, nargs="*", default=[],
                   help="also time the tier's read with each of these thread counts")
    p.add_argument("--write-threads", type=int, nargs="*", default=[],
                   help="also time the tier's write with each of these thread counts")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    # Everything goes in a folder of our own under --dir, removed at the end (never --dir).
    directory, block_bytes = Path(tempfile.mkdtemp(prefix="pegaflow-bench-", dir=args.dir)), int(args.block_mib * 2**20)
    rows = []
    try:
        for spec in args.sets:
            name, count = spec.split(":")
            rows.append(run_set(directory, name, int(count), block_bytes, args.threads, args.repeats,
                                tuple(args.read_threads), tuple(args.write_threads)))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    result = {"dir": str(directory), "threads": args.threads, "repeats": args.repeats, "sets": rows,
              "date": time.strftime("%Y-%m-%d"),
              "command": "python -m tools.bench_disk " + " ".join(sys.argv[1:])}
    last = rows[-1]  # the largest set's ratios are the headline
    result["read_ratio_vs_raw"], result["write_ratio_vs_raw"] = last["read_ratio_vs_raw"], last["write_ratio_vs_raw"]
    print(f"{'set':<14}{'blocks':>7}{'GB':>7}{'raw write':>11}{'tier write':>11}{'x raw':>7}"
          f"{'raw read':>10}{'tier read':>11}{'x raw':>7}{'pool read':>11}{'kvikio':>8}",
          file=sys.stderr if args.json else sys.stdout)
    for r in rows:
        print(f"{r['set']:<14}{r['blocks']:>7}{r['bytes'] / 1e9:>7.2f}{r['raw_write_gbps']:>11.2f}"
              f"{r['tier_write_gbps']:>11.2f}{r['write_ratio_vs_raw']:>7.2f}{r['raw_read_gbps']:>10.2f}"
              f"{r['tier_read_gbps']:>11.2f}{r['read_ratio_vs_raw']:>7.2f}{r['pool_read_gbps']:>11.2f}"
              f"{r.get('kvikio_read_gbps', float('nan')):>8.2f}"
              + "".join(f"  {k[len('tier_'):-len('_gbps')]} {v:.2f}" for k, v in r.items()
                        if k.startswith(("tier_read_t", "tier_write_t")) and k.endswith("_gbps"))
              +               f"{'' if r['raw_is_direct'] else '  (raw not direct)'}",
              file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
