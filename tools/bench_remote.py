"""Remote tier throughput between two engines on two hosts (network namespaces over a veth
pair, ``tools/remote_hosts.py``) through a Mooncake Store over TCP, against a plain TCP
socket transfer of the same bytes between the same two namespaces, measured in the same run,
phases interleaved.

    sudo python -m tools.bench_remote [--blocks 625] [--repeats 3] [--json docs/benchmarks/remote.json]

Each repeat: a client of engine A saves a 10k-token Llama-3.1-8B prefix (625 blocks of 2 MiB:
32 layers x 64 KiB) under new hashes and A publishes every block (``put``: bytes over the
publish thread's time in the store's calls, checksums included, from A's stats); a client of
engine B, whose pool lacks them, looks the prefix up and loads it at once (``fetch``: the
LOOKUP's answer, which waits for the store's existence check, plus B's fetch call, every
block's checksum in it, by B's stats: the fetch starts before the answer, so this is an upper
bound; ``served``: from the LOOKUP's submission to the LOAD's answer, as the client sees it,
the LOAD waiting in B for the fetch and then copying from B's pool into the client's memory),
checked byte for byte.  ``tcp``: one
socket from A's namespace to B's moving the same bytes (receiver's clock, connect to last byte).
Engines on the host backend (no GPU: the pool is host memory either way).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from pegaflow.client.connection import EngineClient
from pegaflow.client.host_memory import HostKVBuffer, layer_major_records
from pegaflow.stats.engine_stats import read_stats
from tools.engine_process import ROOT, EngineProcess
from tools.remote_hosts import MasterProcess, TwoHosts, free_port, two_hosts

NUM_LAYERS, PAGE_BYTES = 32, 64 << 10
NAMESPACE = 21
TCP_CHUNK = 4 << 20


class BenchClient:
    def __init__(self, engine_name: str, num_blocks: int):
        self.kv = HostKVBuffer(NUM_LAYERS * num_blocks * PAGE_BYTES, "rmb")
        self.client = EngineClient.connect(engine_name, timeout_s=30.0)
        self.client.register_region(0, self.kv.region_record(num_blocks, PAGE_BYTES, NUM_LAYERS),
                                    layer_major_records(NUM_LAYERS, num_blocks, PAGE_BYTES))
        self.pages = self.kv.data.reshape(NUM_LAYERS, num_blocks, PAGE_BYTES)
        self.num_blocks = num_blocks

    def close(self) -> None:
        self.client.close()
        self.kv.close()


def _published(engine_name: str, count: int, timeout_s: float = 300.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while (stats := read_stats(engine_name))["remote_blocks_put"] < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"engine {engine_name}: {stats['remote_blocks_put']} of {count} blocks published")
        time.sleep(1e-3)
    return stats


def one_round(first: BenchClient, second: BenchClient, first_name: str, second_name: str,
              num_put_before: int, rng) -> dict:
    """A saves and publishes the prefix under new hashes; B fetches it; figures of the round."""
    blocks = list(range(first.num_blocks))
    hashes = [rng.bytes(32) for _ in blocks]
    before = read_stats(first_name)
    assert first.client.wait(first.client.submit_save(NAMESPACE, blocks, hashes), 120.0).is_ok
    after = _published(first_name, num_put_before + len(blocks))
    put_ns = after["remote_put_ns"] - before["remote_put_ns"]
    fetch_before = read_stats(second_name)
    second.pages[:] = 0
    started = time.perf_counter()
    found = second.client.lookup(NAMESPACE, hashes, timeout_s=30.0)
    looked_up = time.perf_counter()
    if found.num_hit_blocks != len(blocks) or found.num_disk_blocks != len(blocks):
        raise RuntimeError(f"engine B found {found.num_hit_blocks} of {len(blocks)} blocks "
                           f"({found.num_disk_blocks} in the store)")
    done = second.client.wait(second.client.submit_load(NAMESPACE, blocks, hashes, lease_id=found.lease_id), 120.0)
    finished = time.perf_counter()  # (the LOAD waited in the engine for the fetch: no polling here)
    if not done.is_ok or not np.array_equal(second.pages, first.pages):
        raise RuntimeError(f"engine B's load: {done.status}, or its bytes differ from what A saved")
    fetch_after = read_stats(second_name)
    if fetch_after["remote_blocks_fetched"] - fetch_before["remote_blocks_fetched"] != len(blocks):
        raise RuntimeError(f"engine B fetched {fetch_after['remote_blocks_fetched']} blocks in all")
    fetch_call_s = (fetch_after["remote_fetch_ns"] - fetch_before["remote_fetch_ns"]) / 1e9
    return {"put_s": put_ns / 1e9, "fetch_s": looked_up - started + fetch_call_s, "served_s": finished - started,
            "lookup_s": looked_up - started,
            "engine_fetch_s": fetch_call_s}


def tcp_transfer(hosts: TwoHosts, num_bytes: int) -> float:
    """Seconds one plain socket takes to move ``num_bytes`` from the first host to the second."""
    port = free_port(hosts)
    base = [sys.executable, "-m", "tools.bench_remote"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    sender = subprocess.Popen([*hosts.first.prefix, *base, "--tcp-send", f"{hosts.first.address}:{port}",
                               str(num_bytes)], cwd=ROOT, env=env)
    try:
        out = subprocess.run([*hosts.second.prefix, *base, "--tcp-recv", f"{hosts.first.address}:{port}",
                              str(num_bytes)], cwd=ROOT, env=env, capture_output=True, check=True, timeout=300)
    finally:
        sender.wait(60)
    return float(out.stdout.decode().split()[-1])


def _tcp_send(address: str, num_bytes: int) -> None:
    host, port = address.rsplit(":", 1)
    data = memoryview(np.random.default_rng(1).integers(0, 256, num_bytes, dtype=np.uint8))
    with socket.create_server((host, int(port))) as server:
        connection, _ = server.accept()
        with connection:
            for start in range(0, num_bytes, TCP_CHUNK):
                connection.sendall(data[start:start + TCP_CHUNK])
            connection.shutdown(socket.SHUT_WR)
            connection.recv(1)  # the receiver's close


def _tcp_recv(address: str, num_bytes: int) -> None:
    host, port = address.rsplit(":", 1)
    buf = np.ones(num_bytes, np.uint8)  # (faulted in before the clock starts)
    view, deadline = memoryview(buf), time.monotonic() + 30
    while True:
        try:
            connection = socket.create_connection((host, int(port)))
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)
    with connection:
        started, received = time.perf_counter(), 0
        while received < num_bytes:
            n = connection.recv_into(view[received:], min(TCP_CHUNK, num_bytes - received))
            if n == 0:
                raise RuntimeError(f"the sender closed after {received} of {num_bytes} bytes")
            received += n
        seconds = time.perf_counter() - started
    print(f"{seconds:.6f}")


def run(args) -> dict:
    num_bytes = args.blocks * NUM_LAYERS * PAGE_BYTES
    prefix_gib = num_bytes / 2**30
    pool, segment = f"{max(2, int(prefix_gib * 2) + 1)}GiB", f"{int(prefix_gib * (args.repeats + 2)) + 1}GiB"
    rng = np.random.default_rng(7)
    with two_hosts() as hosts, tempfile.TemporaryDirectory(prefix="bench-remote-") as logs:
        print(f"hosts: {hosts.note}", file=sys.stderr)
        master = MasterProcess(hosts, Path(logs))
        master.start()
        engines, clients = [], []
        try:
            for i, host in enumerate((hosts.first, hosts.second)):
                engines.append(EngineProcess(f"bremote{os.getpid()}{'ab'[i]}", "--slab-size", "64MiB",
                                             *master.engine_flags(host, segment, "--remote-timeout-ms", "2000"),
                                             pool_size=pool, prefix=host.prefix, start_timeout_s=120.0,
                                             stderr_path=Path(logs) / f"engine-{'ab'[i]}.log"))
            clients = [BenchClient(engine.name, args.blocks) for engine in engines]
            clients[0].pages[:] = rng.integers(0, 256, clients[0].pages.shape, dtype=np.uint8)
            rounds, tcp, num_put = [], [], 0
            for i in range(args.warmup + args.repeats):
                figures = one_round(*clients, engines[0].name, engines[1].name, num_put, rng)
                num_put += args.blocks
                seconds = tcp_transfer(hosts, num_bytes)
                if i >= args.warmup:
                    rounds.append(figures)
                    tcp.append(seconds)
        finally:
            for client in clients:
                client.close()
            for engine in engines:
                engine.stop()
            master.kill()
    put_s = statistics.median(r["put_s"] for r in rounds)
    fetch_s = statistics.median(r["fetch_s"] for r in rounds)
    served_s = statistics.median(r["served_s"] for r in rounds)
    tcp_s = statistics.median(tcp)
    gbps = lambda seconds: num_bytes / seconds / 1e9  # noqa: E731
    return {"hosts": hosts.note, "blocks": args.blocks, "block_bytes": NUM_LAYERS * PAGE_BYTES, "bytes": num_bytes,
            "repeats": args.repeats, "protocol": "tcp",
            "put_gbps": gbps(put_s), "fetch_gbps": gbps(fetch_s), "tcp_gbps": gbps(tcp_s),
            "served_gbps": gbps(served_s),
            "put_ratio_vs_tcp": tcp_s / put_s, "fetch_ratio_vs_tcp": tcp_s / fetch_s,
            "served_ratio_vs_tcp": tcp_s / served_s,
            "lookup_ms": 1e3 * statistics.median(r["lookup_s"] for r in rounds),
            "engine_fetch_gbps": gbps(statistics.median(r["engine_fetch_s"] for r in rounds)),
            "rounds": rounds, "tcp_s": tcp}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=625, help="blocks of the prefix (625: 10k tokens of 16)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--json", type=Path, help="also write the figures here")
    p.add_argument("--tcp-send", nargs=2, metavar=("HOST:PORT", "BYTES"), help=argparse.SUPPRESS)
    p.add_argument("--tcp-recv", nargs=2, metavar=("HOST:PORT", "BYTES"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tcp_send or args.tcp_recv:
        (_tcp_send if args.tcp_send else _tcp_recv)((args.tcp_send or args.tcp_recv)[0],
                                                     int((args.tcp_send or args.tcp_recv)[1]))
        return 0
    result = run(args)
    print(f"{'':<8} {'GB/s':>7} {'x tcp':>7}   ({result['blocks']} blocks of "
          f"{result['block_bytes'] >> 20} MiB, median of {result['repeats']}; {result['hosts']})")
    print(f"{'tcp':<8} {result['tcp_gbps']:>7.2f} {1.0:>7.2f}")
    print(f"{'put':<8} {result['put_gbps']:>7.2f} {result['put_ratio_vs_tcp']:>7.2f}")
    print(f"{'fetch':<8} {result['fetch_gbps']:>7.2f} {result['fetch_ratio_vs_tcp']:>7.2f}   "
          f"(lookup {result['lookup_ms']:.1f} ms; the engine's fetch calls alone "
          f"{result['engine_fetch_gbps']:.2f} GB/s)")
    print(f"{'served':<8} {result['served_gbps']:>7.2f} {result['served_ratio_vs_tcp']:>7.2f}   "
          f"(fetch, then the LOAD into the client's memory)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
