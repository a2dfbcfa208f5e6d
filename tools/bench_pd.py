"""Prefill/decode disaggregation (GPU): 1P1D through pegaflow beside two plain replicas.

    python -m tools.bench_pd --model tools/models/llama-3.1-8b-shape --json docs/benchmarks/pd.json

Setups, one after another on one GPU (both servers of a setup share its SMs: a prefill still
slows the decode steps running beside it, only not inside one batch):

    reference   one plain ``vllm serve``, one request at a time: the answers both setups must give
    pd_1p1d     a pegaflow engine, a ``kv_producer`` and a ``kv_consumer`` server, ``pegaflow-proxy``
    replicas_2  two plain servers (no connector), requests alternating between them

Workload: ``--requests`` distinct prompts of ``--prompt-tokens`` (no shared prefixes: every
prefill is cold), ``--answer-tokens`` each, arriving at ``--arrival-rate`` per second (Poisson),
after ``--warmup`` requests of the same shape.  Per setup: TTFT p50/p99, TPOT p50/p99 and
ITL (gaps between streamed chunks) p50/p99 in ms; for pd_1p1d the served share (the decode
server's external hits over the prompts' full blocks) and whether every answer equals the
reference's.  Dummy weights, token-id prompts; servers and the proxy through
``tools/lib/vllm_serve.py``'s ``Server`` and ``complete``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from tools.engine_process import EngineProcess
from tools.lib.gpu import gpu_name
from tools.lib.serving_setup import pegaflow_transfer_args
from tools.lib.vllm_serve import Server, complete, external_hit_tokens, server_command
from tools.serving_workload import RequestResult, cacheable_tokens, percentile, poisson_offsets

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 16  # vLLM's default block size: the full blocks a complete cache serves
SETUPS = ("pd_1p1d", "replicas_2")


def prompts(count: int, num_tokens: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 30000) for _ in range(num_tokens)] for _ in range(count)]


def stream(port: int, prompt: list[int], max_tokens: int, key: str) -> tuple[RequestResult, list[float]]:
    """One streamed completion (``complete``), with the arrival time of every chunk that
    carries tokens: the gaps between them are the inter-token latencies; it is done at the last."""
    times: list[float] = []
    result = complete(port, prompt, max_tokens, key, chunk_times=times)
    if result.error:
        return result, []
    return dataclasses.replace(result, done_s=times[-1]), times


def drive(ports: list[int], jobs: list[list[int]], args) -> list[tuple[RequestResult, list[float]]]:
    """Send ``jobs`` at Poisson arrivals, request i to ``ports[i % len(ports)]``."""
    offsets, t0 = poisson_offsets(len(jobs), args.arrival_rate, seed=args.seed), time.monotonic()

    def one(i: int):
        time.sleep(max(0.0, t0 + offsets[i] - time.monotonic()))
        return stream(ports[i % len(ports)], jobs[i], args.answer_tokens, f"p{i}")

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(jobs))) as pool:
        return list(pool.map(one, range(len(jobs))))


def figures(timed: list[tuple[RequestResult, list[float]]]) -> dict:
    ok = [(r, t) for r, t in timed if not r.error]
    ttft = [r.ttft_s * 1e3 for r, _ in ok]
    tpot = [r.tpot_s * 1e3 for r, _ in ok if r.tpot_s is not None]
    itl = [(b - a) * 1e3 for _, t in ok for a, b in zip(t, t[1:])]
    return {"requests": len(timed), "errors": len(timed) - len(ok),
            "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
            "tpot_p50_ms": percentile(tpot, 50), "tpot_p99_ms": percentile(tpot, 99),
            "itl_p50_ms": percentile(itl, 50), "itl_p99_ms": percentile(itl, 99)}


def server_args(args, port: int, share: float) -> SimpleNamespace:
    return SimpleNamespace(model=args.model, port=port, max_model_len=args.max_model_len,
                           gpu_memory_utilization=share, gpu_blocks=args.gpu_blocks, host_gib=0, eager=args.eager)


def pd_command(role: str, args, port: int, engine_name: str) -> list[str]:
    """A plain server's command with pegaflow's connector in ``role``."""
    return server_command("none", server_args(args, port, args.gpu_share), "",
                          pegaflow_transfer_args(engine_name, role))


def run_reference(args, jobs: list[list[int]], log_dir: Path) -> list[list[int]]:
    """One plain server, one request at a time: the answers every setup must give."""
    port = args.port
    server = Server(server_command("none", server_args(args, port, args.gpu_share), ""), port,
                    log_dir / "reference.log")
    try:
        return [complete(port, p, args.answer_tokens, f"ref{i}").tokens for i, p in enumerate(jobs)]
    finally:
        server.stop()


def run_pd(args, warmup: list[list[int]], jobs: list[list[int]], log_dir: Path) -> tuple[list, float]:
    """1P1D: (the timed results, the decode server's external hits during the timed part)."""
    prefill_port, decode_port, proxy_port = args.port, args.port + 1, args.port + 2
    name = f"benchpd{os.getpid()}"
    servers = []
    with EngineProcess(name, *args.engine_arg, backend="cuda", pool_size=args.pool_size, start_timeout_s=300):
        try:
            servers.append(Server(pd_command("kv_producer", args, prefill_port, name), prefill_port,
                                  log_dir / "prefill.log"))
            servers.append(Server(pd_command("kv_consumer", args, decode_port, name), decode_port,
                                  log_dir / "decode.log"))
            servers.append(Server([sys.executable, "-m", "pegaflow.proxy", "--port", str(proxy_port),
                                   "--prefill", f"http://127.0.0.1:{prefill_port}",
                                   "--decode", f"http://127.0.0.1:{decode_port}"], proxy_port, log_dir / "proxy.log"))
            drive([proxy_port], warmup, args)
            hits_before = external_hit_tokens(decode_port)
            timed = drive([proxy_port], jobs, args)
            return timed, external_hit_tokens(decode_port) - hits_before
        finally:
            for server in reversed(servers):
                server.stop()


def run_replicas(args, warmup: list[list[int]], jobs: list[list[int]], log_dir: Path) -> list:
    ports, servers = [args.port, args.port + 1], []
    try:
        for i, port in enumerate(ports):
            servers.append(Server(server_command("none", server_args(args, port, args.gpu_share), ""), port,
                                  log_dir / f"replica{i}.log"))
        drive(ports, warmup, args)
        return drive(ports, jobs, args)
    finally:
        for server in servers:
            server.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "tools/models/llama-3.1-8b-shape"))
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=4000)
    p.add_argument("--answer-tokens", type=int, default=128)
    p.add_argument("--arrival-rate", type=float, default=2.0, help="requests per second (Poisson)")
    p.add_argument("--gpu-share", type=float, default=0.4,
                   help="--gpu-memory-utilization of each server (two share the GPU)")
    p.add_argument("--gpu-blocks", type=int, default=4000, help="each server's GPU KV cache, in blocks")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--pool-size", default="16GiB", help="the engine's pool")
    p.add_argument("--engine-arg", action="append", default=[], metavar="FLAG",
                   help="a flag for pegaflow's engine, e.g. --engine-arg=--lookup-wait-ms=80 (repeatable)")
    p.add_argument("--eager", action="store_true", help="--enforce-eager (default: CUDA graphs)")
    p.add_argument("--port", type=int, default=8031)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default="/tmp/bench_pd")
    p.add_argument("--json", metavar="PATH", help="write every figure here")
    args = p.parse_args(argv)
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    jobs = prompts(args.requests, args.prompt_tokens, args.seed)
    warmup = prompts(args.warmup, args.prompt_tokens, args.seed + 1)
    reference = run_reference(args, jobs, log_dir)
    pd_timed, hits = run_pd(args, warmup, jobs, log_dir)
    replicas_timed = run_replicas(args, warmup, jobs, log_dir)
    full_tokens = sum(cacheable_tokens(len(p), len(p), BLOCK) for p in jobs)
    table = {"gpu": gpu_name(), "model": args.model, "args": vars(args) | {"arrival_rate": str(args.arrival_rate)},
             "note": "one GPU: the prefill and decode servers share its SMs (as the two replicas do)",
             "served_share": hits / full_tokens if full_tokens else float("nan"),
             "outputs_identical": all(r.tokens == ref for (r, _), ref in zip(pd_timed, reference))
             and all(r.tokens == ref for (r, _), ref in zip(replicas_timed, reference)),
             "pd_1p1d": figures(pd_timed), "replicas_2": figures(replicas_timed)}
    print_table(table)
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1))
    return 1 if table["pd_1p1d"]["errors"] or table["replicas_2"]["errors"] else 0


def print_table(table: dict) -> None:
    keys = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "itl_p50_ms", "itl_p99_ms")
    print(f"{'setup':<11} " + " ".join(f"{k[:-3]:>12}" for k in keys) + f" {'errors':>7}")
    for setup in SETUPS:
        row = table[setup]
        print(f"{setup:<11} " + " ".join(f"{row[k]:>12.1f}" for k in keys) + f" {row['errors']:>7}")
    print(f"served share {table['served_share']:.4f}, outputs identical: {table['outputs_identical']} "
          f"({table['gpu']}; {table['note']})")


if __name__ == "__main__":
    sys.exit(main())
