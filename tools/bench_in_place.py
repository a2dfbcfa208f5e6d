"""What vLLM's CPU path costs: moving a KV cache into shared memory once, against copying.

    python -m tools.bench_in_place [--sizes 256MiB,1GiB] [--repeats 3] [--json out.json]

For each size: ``share_in_place`` of a fresh private anonymous range (what a vLLM CPU worker
pays once, at registration), and the baseline of the other design, a worker that stages
blocks through a shared arena: one memcpy of the same bytes (what it would pay for every
byte it loads or saves, each step, on vLLM's own thread).  One table; medians of the repeats
after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from pegaflow.client.in_place import share_in_place
from pegaflow.platform.values import parse_size


def _private(num_bytes: int) -> np.ndarray:
    array = np.empty(num_bytes, dtype=np.uint8)  # malloc maps it on its own: private anonymous
    array[::4096] = 1  # faulted in, as vLLM's zeroed cache is
    return array


def _share_s(num_bytes: int) -> float:
    array = _private(num_bytes)
    began = time.perf_counter()
    buffer = share_in_place(array.__array_interface__["data"][0], num_bytes)
    took = time.perf_counter() - began
    buffer.close()
    return took


def _memcpy_s(num_bytes: int) -> float:
    src, dst = _private(num_bytes), _private(num_bytes)
    began = time.perf_counter()
    np.copyto(dst, src)
    return time.perf_counter() - began


def measure(num_bytes: int, repeats: int) -> dict:
    _share_s(num_bytes), _memcpy_s(num_bytes)  # warm-up
    share = statistics.median(_share_s(num_bytes) for _ in range(repeats))
    memcpy = statistics.median(_memcpy_s(num_bytes) for _ in range(repeats))
    return {"bytes": num_bytes, "share_in_place_s": share, "memcpy_s": memcpy,
            "memcpy_gb_s": num_bytes / memcpy / 1e9}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="256MiB,1GiB")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    rows = [measure(parse_size(s), args.repeats) for s in args.sizes.split(",")]
    print(f"{'size':>10} {'share_in_place':>15} {'memcpy (baseline)':>18} {'memcpy GB/s':>12}")
    for r in rows:
        print(f"{r['bytes'] >> 20:>7} MiB {r['share_in_place_s'] * 1e3:>12.0f} ms {r['memcpy_s'] * 1e3:>15.0f} ms "
              f"{r['memcpy_gb_s']:>12.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
