"""Control-path latency: a PING and a LOOKUP of 625 hashes through the shared-memory ring,
against a ZMQ REQ/REP + pickle round trip (the socket design) measured in the same run.

    python -m tools.bench_ipc [--iters 20000] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pickle
import sys
import time

import numpy as np

from pegaflow.client.connection import EngineClient  # noqa: E402
from tools.engine_process import EngineProcess  # noqa: E402


def _percentiles(samples_ns: list[int]) -> tuple[float, float]:
    us = np.array(samples_ns) / 1e3
    return float(np.percentile(us, 50)), float(np.percentile(us, 99))


def _time_calls(fn, iters: int, warmup: int) -> list[int]:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t0)
    return samples


def bench_ring(name: str, iters: int) -> dict:
    client = EngineClient.connect(name)
    hashes = [os.urandom(32) for _ in range(625)]
    try:
        ping = _time_calls(client.ping, iters, iters // 10)
        lookup = _time_calls(lambda: client.lookup(1, hashes), max(iters // 10, 100), 50)
    finally:
        client.close()
    return {"ring": _percentiles(ping), "lookup625": _percentiles(lookup)}


def _zmq_server(address: str, ready) -> None:
    import zmq
    sock = zmq.Context.instance().socket(zmq.REP)
    sock.bind(address)
    ready.set()
    while True:
        msg = pickle.loads(sock.recv())
        if msg == "stop":
            sock.send(pickle.dumps("bye"))
            return
        sock.send(pickle.dumps({"op": "pong", "value": msg["value"]}))


def bench_zmq(iters: int, transport: str) -> tuple[float, float]:
    import zmq
    address = (f"ipc:///tmp/pegaflow-bench-{os.getpid()}.sock" if transport == "ipc"
               else f"tcp://127.0.0.1:{20000 + os.getpid() % 20000}")
    ready = mp.get_context("spawn").Event()
    server = mp.get_context("spawn").Process(target=_zmq_server, args=(address, ready))
    server.start()
    if not ready.wait(30):
        server.kill()
        raise RuntimeError("the ZMQ server process did not start within 30 s")
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.connect(address)

    def call():
        sock.send(pickle.dumps({"op": "ping", "value": 1}))
        pickle.loads(sock.recv())
    try:
        return _percentiles(_time_calls(call, iters, iters // 10))
    finally:  # the timing is over: from here every wait has a deadline
        sock.setsockopt(zmq.RCVTIMEO, 10_000)
        sock.send(pickle.dumps("stop"))
        sock.recv()
        server.join(10)


def idle_cpu_percent(pid: int, seconds: float) -> float:
    """On-CPU time of the process (``/proc/PID/schedstat``, ns) over ``seconds`` of wall
    time, in % of one core, measured after a second of settling."""
    def cpu_ns() -> int:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[0])
    time.sleep(1.0)
    start, t0 = cpu_ns(), time.monotonic()
    time.sleep(seconds)
    return 100.0 * (cpu_ns() - start) / 1e9 / (time.monotonic() - t0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20000)
    parser.add_argument("--idle-seconds", type=float, default=5.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with EngineProcess(f"benchipc{os.getpid()}") as engine:
        ring = bench_ring(engine.name, args.iters)
        idle = idle_cpu_percent(engine.pid, args.idle_seconds)  # no client attached
        client = EngineClient.connect(engine.name)  # one attached, silent client (housekeeping runs)
        try:
            client.ping()
            idle_attached = idle_cpu_percent(engine.pid, args.idle_seconds)
        finally:
            client.close()
    zmq_p50, zmq_p99 = bench_zmq(args.iters, "ipc")
    zmq_tcp_p50, zmq_tcp_p99 = bench_zmq(args.iters, "tcp")
    result = {
        "ring_rtt_us_p50": ring["ring"][0], "ring_rtt_us_p99": ring["ring"][1],
        "lookup625_us_p50": ring["lookup625"][0], "lookup625_us_p99": ring["lookup625"][1],
        "zmq_pickle_rtt_us_p50": zmq_p50, "zmq_pickle_rtt_us_p99": zmq_p99,
        "zmq_tcp_pickle_rtt_us_p50": zmq_tcp_p50, "zmq_tcp_pickle_rtt_us_p99": zmq_tcp_p99,
        "zmq_over_ring_p50": zmq_p50 / ring["ring"][0],
        "zmq_tcp_over_ring_p50": zmq_tcp_p50 / ring["ring"][0],
        "engine_idle_cpu_pct": idle, "engine_idle_attached_cpu_pct": idle_attached,
        "iters": args.iters, "cpus": os.cpu_count(),
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{'path':<26}{'p50 us':>10}{'p99 us':>10}")
    print(f"{'ring PING':<26}{result['ring_rtt_us_p50']:>10.1f}{result['ring_rtt_us_p99']:>10.1f}")
    print(f"{'ring LOOKUP x625':<26}{result['lookup625_us_p50']:>10.1f}{result['lookup625_us_p99']:>10.1f}")
    print(f"{'zmq REQ/REP+pickle ipc':<26}{zmq_p50:>10.1f}{zmq_p99:>10.1f}")
    print(f"{'zmq REQ/REP+pickle tcp':<26}{zmq_tcp_p50:>10.1f}{zmq_tcp_p99:>10.1f}")
    print(f"zmq / ring (p50): ipc {result['zmq_over_ring_p50']:.1f}x, "
          f"tcp {result['zmq_tcp_over_ring_p50']:.1f}x; "
          f"idle engine CPU: {idle:.2f}% of a core over {args.idle_seconds:.0f}s "
          f"({idle_attached:.2f}% with a silent client attached)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
