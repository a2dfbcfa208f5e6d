"""Engine start: the time from starting ``python -m engine`` to its first client (a PING
answered), and until its whole pool is pinned, with the pool pinned in the background
(the default) against the whole pool pinned before serving (``--pin-chunk`` = the pool,
as the engine did before) in the same run; then what faulting memory in costs on this
host, by each method and thread count, against the memory's write bandwidth.

    python -m tools.bench_engine_start --backend cuda --pool-size 64GiB --json docs/benchmarks/engine_start.json
    python -m tools.bench_engine_start --backend host --pool-size 4GiB

``pin_gbps`` is the engine's own figure: the pool's bytes over the time from faulting its
first chunk in to pinning its last (``pool_pin_ns`` in its stats).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import mmap
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import posix_ipc

from engine import fault_in
from engine.room import check_room
from pegaflow.platform import shm
from pegaflow.platform.values import format_size, parse_size
from pegaflow.stats.engine_stats import read_stats
from tools.engine_process import LARGE_POOL_STOP_S, ROOT, EngineProcess
from tools.lib.gpu import NO_GPU, gpu_name

POLL_S = 5e-3
FAULT_METHODS = ("write faulted", "touch", "fallocate+touch", "populate", "populate+huge", "map_populate")


def start_once(args, name: str, log: Path, pin_chunk: str | None) -> dict:
    """One engine started, timed to its first client and to its whole pool pinned, stopped."""
    flags = [f for flag, value in (("--pin-chunk", pin_chunk), ("--pin-threads", args.pin_threads))
             if value for f in (flag, value)]
    started, started_at = time.perf_counter(), time.time()
    engine = EngineProcess(name, *flags, backend=args.backend, pool_size=args.pool_size,
                           log_level="INFO", stderr_path=log, wait=False)
    try:
        engine.wait_ready(args.timeout)
        first_client_s = time.perf_counter() - started
        deadline = started + args.timeout
        while not (stats := read_stats(name))["pool_pin_ns"]:
            if "pinning stopped" in engine.stderr_text() or time.perf_counter() > deadline:
                raise RuntimeError(f"the pool was not pinned:\n{engine.stderr_text()[-2000:]}")
            time.sleep(POLL_S)
        fully_ready_s = time.perf_counter() - started
    finally:
        stop_started = time.perf_counter()
        exit_code = engine.stop(timeout_s=LARGE_POOL_STOP_S)
        stop_s = time.perf_counter() - stop_started
    lines = engine.stderr_text().splitlines()
    done = [line for line in lines if " pinned in " in line]
    pin_s = stats["pool_pin_ns"] / 1e9
    return {"first_client_s": first_client_s, "fully_ready_s": fully_ready_s, "pin_s": pin_s,
            "pin_gbps": stats["pool_bytes_capacity"] / pin_s / 1e9, "exit_code": exit_code,
            "stop_s": stop_s,
            "engine_log": done[-1].split(": ", 1)[-1] if done else "",
            "start_timeline": timeline(lines, started_at)}


def timeline(lines: list[str], started_at: float) -> list[tuple[float, str]]:
    """The engine's log up to its "ready" line, each line's time after the process started
    (where the start's time goes)."""
    out = []
    for line in lines:
        try:
            at = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        except ValueError:
            continue
        out.append((round(at - started_at, 3), line[24:]))
        if " ready: " in line:
            break
    return out


def bench_starts(args) -> dict[str, list[dict]]:
    modes = {"background": None, "whole pool first": args.pool_size}
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory() as logs:
        for i in range(args.warmup + args.repeats):
            for mode, pin_chunk in modes.items():
                if mode != "background" and (args.no_baseline or i < args.warmup):
                    continue
                name = f"benchstart{os.getpid()}_{i}{mode[0]}"
                run = start_once(args, name, Path(logs) / f"{name}.log", pin_chunk)
                if i >= args.warmup:
                    runs[mode].append(run)
    return {mode: found for mode, found in runs.items() if found}


def _scratch(size: int) -> shm.Segment:
    return shm.create_segment(shm.ipc_name("bench", f"fault{os.getpid()}"), size)


def _in_threads(segment: shm.Segment, num_threads: int, work) -> None:
    with ThreadPoolExecutor(num_threads) as pool:
        list(pool.map(lambda part: work(segment, *part), fault_in.split(0, segment.size, num_threads)))


def _memset(segment: shm.Segment, start: int, num_bytes: int) -> None:
    ctypes.memset(segment.address() + start, 1, num_bytes)  # a foreign call: the GIL is let go


def _touch_only(segment: shm.Segment, start: int, num_bytes: int) -> None:
    """The engine's old pre-touch: a write per 4 KiB page, nothing allocated first."""
    part = segment.array(np.uint8, num_bytes, start)[::4096]
    np.bitwise_or(part, 0, out=part)


def time_fault(method: str, size: int, num_threads: int) -> tuple[float, int | None]:
    """GB/s of faulting a fresh ``size``-byte /dev/shm segment in by ``method``; its bytes in
    2 MiB pages."""
    segment = _scratch(size)
    try:
        if method == "write faulted":  # the ceiling: writing memory that is faulted in already
            fault_in.fault_in(segment, 0, size, num_threads)
        if method == "populate+huge":
            fault_in.advise_huge_pages(segment)
        started = time.perf_counter()
        if method == "write faulted":
            _in_threads(segment, num_threads, _memset)
        elif method == "touch":
            _in_threads(segment, num_threads, _touch_only)
        elif method == "map_populate":
            mem = posix_ipc.SharedMemory(segment.name, 0)
            mmap.mmap(mem.fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE).close()
            mem.close_fd()
        else:
            how = fault_in.TOUCH if method == "fallocate+touch" else fault_in.POPULATE
            fault_in.fault_in(segment, 0, size, num_threads, how)
        seconds = time.perf_counter() - started
        return size / seconds / 1e9, fault_in.huge_page_bytes(segment)
    finally:
        segment.close()
        segment.unlink()


def bench_faults(args) -> list[dict]:
    size, rows = parse_size(args.scratch_size), []
    check_room(size, size)  # "touch" allocates nothing first: it must not meet a full /dev/shm
    threads = sorted({int(t) for t in args.threads.split(",") if 0 < int(t) <= (os.cpu_count() or 1)})
    for num_threads in threads:
        for method in FAULT_METHODS:
            if method == "map_populate" and num_threads != threads[0]:
                continue  # one thread in the kernel, whatever ours
            samples = [time_fault(method, size, num_threads) for _ in range(args.repeats)]
            rows.append({"method": method, "threads": 1 if method == "map_populate" else num_threads,
                         "gbps": statistics.median(s[0] for s in samples),
                         "huge_page_bytes": samples[-1][1]})
    return rows


def host_facts() -> dict:
    def read(path: str) -> str:
        try:
            return Path(path).read_text().strip()
        except OSError:
            return ""
    mounts = [line.split()[3] for line in read("/proc/mounts").splitlines() if line.split()[1:2] == ["/dev/shm"]]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    return {"cpus": os.cpu_count(), "kernel": platform.release(), "commit": commit,
            "shmem_enabled": read("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
            "dev_shm_options": mounts[-1] if mounts else ""}


def summary(runs: list[dict]) -> dict:
    keys = ("first_client_s", "fully_ready_s", "pin_s", "pin_gbps", "stop_s")
    return {key: statistics.median(r[key] for r in runs) for key in keys}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0].replace("``", ""))
    parser.add_argument("--backend", default="auto", choices=("auto", "cuda", "host"))
    parser.add_argument("--pool-size", default="4GiB")
    parser.add_argument("--pin-threads", help="the engine's --pin-threads (default: its own)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1, help="engine starts run first, not counted")
    parser.add_argument("--no-baseline", action="store_true", help="skip the whole-pool-first starts")
    parser.add_argument("--scratch-size", default="2GiB", help="segment each fault-in method faults in")
    parser.add_argument("--threads", default="1,2,4,8,16", help="fault-in thread counts (up to the cores)")
    parser.add_argument("--no-faults", action="store_true", help="skip the fault-in methods")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds an engine start may take")
    parser.add_argument("--json", metavar="PATH", help="write the results there")
    args = parser.parse_args(argv)
    pool_bytes = parse_size(args.pool_size)
    starts = bench_starts(args)
    faults = [] if args.no_faults else bench_faults(args)
    background = summary(starts["background"])
    print(f"engine start, {args.backend} backend, {format_size(pool_bytes)} pool, median of "
          f"{args.repeats}:")
    print(f"{'pinning':<18}{'first client s':>15}{'fully pinned s':>15}{'pin GB/s':>10}{'stop s':>8}")
    for mode, runs in starts.items():
        row = summary(runs)
        print(f"{mode:<18}{row['first_client_s']:>15.3f}{row['fully_ready_s']:>15.3f}{row['pin_gbps']:>10.2f}"
              f"{row['stop_s']:>8.2f}")
    print(f"engine: {starts['background'][-1]['engine_log']}")
    print("its start (seconds after the process began):")
    for at, line in starts["background"][0]["start_timeline"]:
        print(f"  {at:7.3f}  {line[:150]}")
    if faults:
        print(f"\nfault-in of a {args.scratch_size} /dev/shm segment (median of {args.repeats}):")
        print(f"{'method':<18}{'threads':>8}{'GB/s':>8}{'2 MiB pages':>13}")
        for row in faults:
            huge = row["huge_page_bytes"]
            print(f"{row['method']:<18}{row['threads']:>8}{row['gbps']:>8.2f}"
                  f"{'?' if huge is None else format_size(huge):>13}")
    if args.json:
        written = [r["gbps"] for r in faults if r["method"] == "write faulted"]
        result = {"gpu": NO_GPU if args.backend == "host" else gpu_name(), "pool_gib": pool_bytes / 2**30,
                  "backend": args.backend,
                  "first_client_s": background["first_client_s"], "pin_gbps": background["pin_gbps"],
                  "fully_ready_s": background["fully_ready_s"], "stop_s": background["stop_s"],
                  "method": starts["background"][-1]["engine_log"],
                  "memory_write_gbps": max(written) if written else None,
                  "summary": {mode: summary(runs) for mode, runs in starts.items()},
                  "runs": starts, "fault_in": faults, "scratch_bytes": parse_size(args.scratch_size),
                  "host": host_facts(), "argv": sys.argv[1:]}
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
