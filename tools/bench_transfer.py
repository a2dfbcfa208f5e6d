"""KV transfer bandwidth of the CUDA data path, against a pinned 4 GiB copy of the same run.

A Llama-3.1-8B-shaped KV cache (32 layers, 8 KV heads, head 128, bf16) in vLLM's default
layout (one allocation, layer-major, K and V packed: a 16-token block is a 64 KiB page
per layer) is owned by a separate torch process, as a vLLM worker would own it.  Pages
move at random block ids to and from random pool entries:

* ``engine``: through a real engine process (``python -m engine --backend cuda``): the
  client times SAVE and LOAD commands from submit to completion — ring, dispatcher,
  index and copy included.  One engine per copy path.
* ``direct``: this process drives ``CudaBackend`` itself (submit, then poll until done)
  on a /dev/shm pool: the copy alone, and the sweep over prefix lengths and block sizes.

The ceiling: one 4 GiB ``cuMemcpyAsync`` each way between a registered /dev/shm buffer
and device memory.  Each figure is the median of the timed repeats, after one warm-up.

    python -m tools.bench_transfer [--json] [--quick] [--tune] [--no-engine]

``--json`` prints the table on stderr and one JSON object on stdout: ``gpu``,
``pinned_h2d_gbps``, ``pinned_d2h_gbps`` and, for the 10k-token prefix with the ``auto``
path through the engine (``through``: "direct" if the engine runs failed, with
``engine_error``), ``h2d_gbps``, ``d2h_gbps`` and their ``*_ratio_vs_pinned``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import sys
import time

import numpy as np

from engine.copy.base import CopyOp, Direction, LayerPlacement  # noqa: E402
from engine.copy.cuda import CudaBackend  # noqa: E402
from engine.fault_in import default_threads, fault_in  # noqa: E402
from pegaflow.platform import shm  # noqa: E402
from pegaflow.platform.cuda import driver  # noqa: E402
from tools.lib.gpu import gpu_name  # noqa: E402

NUM_LAYERS, KV_HEADS, HEAD, DTYPE_BYTES = 32, 8, 128, 2
TOKEN_BYTES = KV_HEADS * 2 * HEAD * DTYPE_BYTES  # K and V of one token in one layer: 4 KiB
CAPACITY_TOKENS = 40960
CEILING_BYTES = 4 << 30
HEADLINE_TOKENS, HEADLINE_BLOCK = 10_000, 16
PATHS = ("kernel", "copy-engine", "staged", "auto")
TIMEOUT_S = 120.0


def kv_geometry(block_size: int) -> dict:
    page = block_size * TOKEN_BYTES
    return {"page_bytes": page, "num_blocks": CAPACITY_TOKENS // block_size,
            "layer_bytes": CAPACITY_TOKENS * TOKEN_BYTES}


def _client_main(conn) -> None:
    """The KV owner (torch): export the cache, then run engine-mode commands when asked."""
    import torch

    from pegaflow.platform.cuda.ipc import export_allocation
    torch.cuda.set_device(0)
    kv = torch.empty(NUM_LAYERS * CAPACITY_TOKENS * TOKEN_BYTES, dtype=torch.uint8, device="cuda")
    for chunk in kv.split(1 << 30):
        chunk.random_(0, 256)
    torch.cuda.synchronize()
    conn.send(export_allocation(kv.data_ptr()))
    while (cmd := conn.recv()) is not None:
        try:
            conn.send(_client_engine_run(kv, *cmd))
        except Exception as exc:  # noqa: BLE001  (process boundary: hand the error back)
            conn.send({"error": f"{type(exc).__name__}: {exc}"})


def _client_engine_run(kv, name: str, tokens: int, block_size: int, runs: int, seed: int) -> dict:
    """SAVE then LOAD ``tokens`` at random block ids through engine ``name``, timed here."""
    import torch

    from pegaflow.client.connection import EngineClient
    from pegaflow.client.host_memory import layer_major_records
    from pegaflow.platform.cuda.ipc import export_allocation, region_record
    geo, rng = kv_geometry(block_size), np.random.default_rng(seed)
    pages = kv.view(NUM_LAYERS, geo["num_blocks"], geo["page_bytes"])
    client = EngineClient.connect(name, timeout_s=TIMEOUT_S)
    try:
        layers = layer_major_records(NUM_LAYERS, geo["num_blocks"], geo["page_bytes"])
        region = region_record(export_allocation(kv.data_ptr()), NUM_LAYERS, geo["num_blocks"],
                               geo["page_bytes"])
        client.register_region(0, region, layers)
        out = {"save_s": [], "load_s": [], "verified": None}
        for run in range(runs):
            _engine_round(client, pages, rng, -(-tokens // block_size), seed, out, run == 1)
        return out
    finally:
        client.close()
        torch.cuda.synchronize()


def _engine_round(client, pages, rng, num_blocks: int, namespace: int, out: dict,
                  verify: bool) -> None:
    import torch
    src = rng.choice(pages.shape[1], num_blocks, replace=False)
    hashes = [rng.bytes(32) for _ in range(num_blocks)]
    t0 = time.perf_counter()
    saved = client.wait(client.submit_save(namespace, src, hashes), TIMEOUT_S)
    out["save_s"].append(time.perf_counter() - t0)
    found = client.lookup(namespace, hashes)
    if not saved.is_ok or saved.value != num_blocks or found.num_hit_blocks != num_blocks:
        raise RuntimeError(f"save stored {saved.value}, lookup hit {found.num_hit_blocks} "
                           f"of {num_blocks} blocks")
    dst = rng.choice(pages.shape[1], num_blocks, replace=False)
    expected = pages[:, torch.as_tensor(src, device="cuda")].clone() if verify else None
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    loaded = client.wait(client.submit_load(namespace, dst, hashes, lease_id=found.lease_id),
                         TIMEOUT_S)
    out["load_s"].append(time.perf_counter() - t0)
    if not loaded.is_ok:
        raise RuntimeError(f"load answered {loaded.status.name}")
    if verify:
        out["verified"] = bool(torch.equal(pages[:, torch.as_tensor(dst, device="cuda")],
                                           expected))


def measure_ceiling(runs: int) -> dict[str, float]:
    """GB/s of one 4 GiB cuMemcpyAsync each way, registered /dev/shm <-> device memory."""
    segment = shm.create_segment(shm.ipc_name("bench", f"ceiling{os.getpid()}"), CEILING_BYTES)
    try:
        fault_in(segment, 0, CEILING_BYTES, default_threads())
        driver.use_device(0)
        host = segment.address()
        driver.host_register(host, CEILING_BYTES)
        gpu, stream = driver.device_alloc(CEILING_BYTES), driver.create_stream(low_priority=False)
        rates = {}
        for label, dst, src in (("h2d", gpu, host), ("d2h", host, gpu)):
            seconds = []
            for _ in range(runs + 1):
                t0 = time.perf_counter()
                driver.memcpy_async(dst, src, CEILING_BYTES, stream)
                driver.synchronize_stream(stream)
                seconds.append(time.perf_counter() - t0)
            rates[label] = CEILING_BYTES / float(np.median(seconds[1:])) / 1e9
        driver.destroy_stream(stream)
        driver.device_free(gpu)
        driver.host_unregister(host)
        return rates
    finally:
        segment.close()
        segment.unlink()


class DirectRunner:
    """This process as the engine: ``CudaBackend`` on a /dev/shm pool, one path at a time."""

    def __init__(self, exported, pool_bytes: int) -> None:
        self.exported = exported
        self.pool = shm.create_segment(shm.ipc_name("bench", f"pool{os.getpid()}"), pool_bytes)
        self.backend: CudaBackend | None = None
        self._tokens = iter(range(1, 1 << 62))

    def open(self, path: str, block_sizes: list[int], **tuning) -> None:
        from pegaflow.platform.cuda.ipc import region_record
        self.backend = CudaBackend(copy_backend=path, **tuning)
        self.backend.attach_pool(self.pool)
        for block_size in block_sizes:
            geo = kv_geometry(block_size)
            self.backend.register_region(0, block_size, region_record(
                self.exported, NUM_LAYERS, geo["num_blocks"], geo["page_bytes"])[0])

    def time_copy(self, direction: Direction, tokens: int, block_size: int, rng) -> float:
        geo = kv_geometry(block_size)
        num_blocks, entry_bytes = -(-tokens // block_size), NUM_LAYERS * geo["page_bytes"]
        layers = [LayerPlacement(i, block_size, i * geo["layer_bytes"], geo["page_bytes"])
                  for i in range(NUM_LAYERS)]
        block_ids = rng.choice(geo["num_blocks"], num_blocks, replace=False)
        entries = rng.choice(self.pool.size // entry_bytes, num_blocks, replace=False)
        op = CopyOp(next(self._tokens), direction, 0, layers, geo["page_bytes"],
                    block_ids.astype(np.int64), entries.astype(np.int64) * entry_bytes)
        t0 = time.perf_counter()
        self.backend.submit(op)
        while not (done := self.backend.poll()):
            if time.perf_counter() - t0 > TIMEOUT_S:
                raise RuntimeError(f"copy {op.token} not done within {TIMEOUT_S:.0f} s")
        seconds = time.perf_counter() - t0
        if done[0].error:
            raise RuntimeError(f"copy failed: {done[0].error}")
        return seconds

    def close_backend(self) -> list[dict]:
        probes = self.backend.probes
        self.backend.close()
        self.backend = None
        return probes

    def close(self) -> None:
        self.pool.close()
        self.pool.unlink()


def _gbps(tokens: int, block_size: int, seconds: list[float]) -> float:
    num_bytes = -(-tokens // block_size) * block_size * TOKEN_BYTES * NUM_LAYERS
    return num_bytes / float(np.median(seconds[1:])) / 1e9


def run_direct(runner: DirectRunner, args, rows: list[dict]) -> list[dict]:
    rng, probes = np.random.default_rng(1), []
    for path in args.paths:
        runner.open(path, args.block_sizes)
        cases = [(HEADLINE_TOKENS, HEADLINE_BLOCK)]
        if path != "auto":
            cases += [(t, b) for b in args.block_sizes for t in args.prefixes]
        for tokens, block_size in cases:
            for direction, label in ((Direction.LOAD, "h2d"), (Direction.SAVE, "d2h")):
                runs = args.runs if tokens == HEADLINE_TOKENS else args.sweep_runs
                seconds = [runner.time_copy(direction, tokens, block_size, rng)
                           for _ in range(runs + 1)]
                rows.append({"through": "direct", "path": path, "block": block_size,
                             "tokens": tokens, "dir": label,
                             "gbps": _gbps(tokens, block_size, seconds)})
        probes += runner.close_backend()
    return probes


def run_tuning(runner: DirectRunner, args, rows: list[dict]) -> None:
    """The kernel's knobs at the 10k-token case: CTAs per launch, layers in flight."""
    rng = np.random.default_rng(2)
    for num_ctas, layers_in_flight in args.tune:
        runner.open("kernel", [HEADLINE_BLOCK], num_ctas=num_ctas,
                    layers_in_flight=layers_in_flight)
        for direction, label in ((Direction.LOAD, "h2d"), (Direction.SAVE, "d2h")):
            seconds = [runner.time_copy(direction, HEADLINE_TOKENS, HEADLINE_BLOCK, rng)
                       for _ in range(args.sweep_runs + 1)]
            rows.append({"through": "tune", "path": f"k{num_ctas}x{layers_in_flight}",
                         "block": HEADLINE_BLOCK, "tokens": HEADLINE_TOKENS, "dir": label,
                         "gbps": _gbps(HEADLINE_TOKENS, HEADLINE_BLOCK, seconds)})
        runner.close_backend()


def run_engine(conn, args, rows: list[dict]) -> dict:
    """One engine process per path; the client process times 10k-token SAVE and LOAD.

    The pool holds every round's blocks: what is timed is the copy path, not eviction.
    """
    from tools.engine_process import EngineProcess
    verified, name = {}, f"bench{os.getpid()}"
    pool_mib = (args.runs + 1) * HEADLINE_TOKENS * TOKEN_BYTES * NUM_LAYERS // 2**20 + 512
    for seed, path in enumerate(args.paths, start=100):
        extra = ("--copy-backend", path, "--slab-size", "64MiB", "--log-level", args.engine_log_level)
        with EngineProcess(name, *extra, backend="cuda", pool_size=f"{pool_mib}MiB",
                           start_timeout_s=TIMEOUT_S) as engine:
            engine.wait_pool_pinned(TIMEOUT_S)  # a SAVE into a part-grown pool stores only its part
            conn.send((name, HEADLINE_TOKENS, HEADLINE_BLOCK, args.runs + 1, seed))
            if not conn.poll(TIMEOUT_S * 4):
                raise RuntimeError("the client process did not answer")
            out = conn.recv()
        if "error" in out:
            raise RuntimeError(f"engine run ({path}): {out['error']}")
        verified[path] = out["verified"]
        for key, label in (("load_s", "h2d"), ("save_s", "d2h")):
            rows.append({"through": "engine", "path": path, "block": HEADLINE_BLOCK,
                         "tokens": HEADLINE_TOKENS, "dir": label,
                         "gbps": _gbps(HEADLINE_TOKENS, HEADLINE_BLOCK, out[key])})
    return verified


def headline(rows: list[dict], through: str, ceiling: dict[str, float]) -> dict:
    """The 10k-token figures of the chosen (``auto``) path, and their ratio to the ceiling."""
    out = {}
    for label in ("h2d", "d2h"):
        match = [r["gbps"] for r in rows if r["through"] == through and r["path"] == "auto"
                 and r["tokens"] == HEADLINE_TOKENS and r["block"] == HEADLINE_BLOCK
                 and r["dir"] == label]
        out[f"{label}_gbps"] = match[0] if match else None
        out[f"{label}_ratio_vs_pinned"] = match[0] / ceiling[label] if match else None
    return out


def print_table(rows: list[dict], ceiling: dict[str, float], file=sys.stdout) -> None:
    print(f"{'through':<8} {'path':<12} {'block':>5} {'tokens':>7} {'dir':<4} "
          f"{'GB/s':>7} {'x pinned':>8}", file=file)
    for r in rows:
        print(f"{r['through']:<8} {r['path']:<12} {r['block']:>5} {r['tokens']:>7} "
              f"{r['dir']:<4} {r['gbps']:>7.2f} {r['gbps'] / ceiling[r['dir']]:>8.3f}", file=file)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON object after the table")
    p.add_argument("--quick", action="store_true", help="a short sweep (smoke runs)")
    p.add_argument("--runs", type=int, default=5, help="timed repeats of the 10k-token cases")
    p.add_argument("--sweep-runs", type=int, default=3, help="timed repeats in the sweep")
    p.add_argument("--no-engine", action="store_true", help="skip the engine-process runs")
    p.add_argument("--pool-mib", type=int, default=4608, help="pool size (fits 32k tokens)")
    p.add_argument("--engine-log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING"],
                   help="the engines' log level (on stderr); DEBUG adds each SAVE's and LOAD's "
                        "timeline from its receipt")
    p.add_argument("--tune", action="store_true",
                   help="also time the kernel with other CTA counts and layers in flight")
    args = p.parse_args(argv)
    args.tune = [(c, f) for c in (8, 16, 32, 64) for f in (1, 2, 4)] if args.tune else []
    args.paths = list(PATHS)
    args.prefixes = [1024, 10_000] if args.quick else [1024, 2048, 4096, 8192, 16384, 32768]
    args.block_sizes = [16, 256] if args.quick else [16, 64, 256]
    return args


def start_client():
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_client_main, args=(child,), daemon=True)
    proc.start()
    if not conn.poll(TIMEOUT_S):
        raise RuntimeError("the KV client process did not start")
    return conn, proc, conn.recv()


def main(argv=None) -> int:
    args = parse_args(argv)
    conn, proc, exported = start_client()
    report = {"gpu": gpu_name(), "date": datetime.date.today().isoformat(),
              "command": "python -m tools.bench_transfer " + " ".join(argv or sys.argv[1:]),
              "model_shape": "Llama-3.1-8B KV: 32 layers, 8 KV heads, head 128, bf16",
              "layout": "vLLM default (layer-major, [blocks, block, heads, K|V])"}
    ceiling = measure_ceiling(args.runs)
    report.update(pinned_h2d_gbps=ceiling["h2d"], pinned_d2h_gbps=ceiling["d2h"])
    rows: list[dict] = []
    runner = DirectRunner(exported, args.pool_mib << 20)
    try:
        report["auto_probes"] = run_direct(runner, args, rows)
        run_tuning(runner, args, rows)
    finally:
        runner.close()
    report["through"] = "direct"
    if not args.no_engine:
        try:
            report["engine_verified"] = run_engine(conn, args, rows)
            report["through"] = "engine"
        except Exception as exc:  # noqa: BLE001  (tool boundary: report and fall back)
            report["engine_error"] = f"{type(exc).__name__}: {exc}"
            print(f"engine runs failed, table shows direct copies only: {report['engine_error']}",
                  file=sys.stderr)
    conn.send(None)
    proc.join(TIMEOUT_S)
    report.update(headline(rows, report["through"], ceiling))
    report["rows"] = rows
    print_table(rows, ceiling, file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
