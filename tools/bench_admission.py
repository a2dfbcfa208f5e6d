"""Which disk admission serves more: one request stream through an engine with a small pool
and a disk tier, once per ``--disk-admission`` (each a fresh engine and an empty disk), counting
the blocks each lookup found (in the pool or on disk) and loaded, checked block by block.

    python -m tools.bench_admission [--json]

The stream (seeded, the same for every policy) mixes what a server sees:

- conversations: users with a long context, round after round, each round's prompt the
  whole history plus a few new blocks (the users take turns: a user's next round comes after
  every other user's);
- shared prefixes: a few system prompts, each request one of them plus a short unique tail;
- one-off documents: long prompts seen once (``--documents``), the traffic a ``reused``
  admission keeps off the disk.

``servable`` is what an unbounded cache would serve: every block of a request's prefix that an
earlier request stored.  The engine runs on the host backend (no GPU): what the figures
compare is which blocks each policy keeps, not the drive's speed.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from pegaflow.client.connection import EngineClient
from pegaflow.client.host_memory import HostKVBuffer, layer_major_records
from pegaflow.stats.engine_stats import read_stats
from tools.engine_process import EngineProcess

POLICIES = ("evicted", "reused", "all")
NAMESPACE = 0xAD
NUM_LAYERS, PAGE_BYTES = 4, 4096  # one block: a 16 KiB pool entry


@dataclass(frozen=True)
class Workload:
    users: int = 24
    context_blocks: int = 40
    rounds: int = 6
    round_blocks: int = 3
    prefixes: int = 4
    prefix_blocks: int = 30
    prefix_requests: int = 96
    tail_blocks: int = 4
    documents: int = 120
    document_blocks: int = 40
    seed: int = 0

    def requests(self) -> list[list[int]]:
        """Every request as its chain of block ids (a block id names one block's content)."""
        rng = random.Random(self.seed)
        next_id = iter(range(1, 1 << 62))
        users = [[next(next_id) for _ in range(self.context_blocks)] for _ in range(self.users)]
        conversation = []
        for _ in range(self.rounds):
            for history in users:
                history.extend(next(next_id) for _ in range(self.round_blocks))
                conversation.append(list(history))
        prefixes = [[next(next_id) for _ in range(self.prefix_blocks)] for _ in range(self.prefixes)]
        others = [rng.choice(prefixes) + [next(next_id) for _ in range(self.tail_blocks)]
                  for _ in range(self.prefix_requests)]
        others += [[next(next_id) for _ in range(self.document_blocks)] for _ in range(self.documents)]
        rng.shuffle(others)
        # the conversation keeps its order; the other requests go in at random places
        places = sorted(rng.randrange(len(conversation) + 1) for _ in others)
        merged, j = [], 0
        for i, request in enumerate(conversation):
            while j < len(others) and places[j] == i:
                merged.append(others[j])
                j += 1
            merged.append(request)
        return merged + others[j:]


def servable(requests: list[list[int]]) -> int:
    """Blocks an unbounded cache would serve: each request's prefix stored before it."""
    stored: set[int] = set()
    total = 0
    for chain in requests:
        hit = 0
        while hit < len(chain) and chain[hit] in stored:
            hit += 1
        total += hit
        stored.update(chain)
    return total


@dataclass
class PolicyResult:
    policy: str
    requests: int = 0
    blocks: int = 0
    served: int = 0
    served_from_disk: int = 0
    failed_loads: int = 0
    wrong_blocks: int = 0
    seconds: float = 0.0
    engine: dict = field(default_factory=dict)


class _Client:
    """A host KV cache of ``num_blocks`` slots registered with the engine; slot i holds the
    i-th block of the request in hand, stamped with its block id."""

    def __init__(self, name: str, num_blocks: int) -> None:
        layer_bytes = num_blocks * PAGE_BYTES
        self.kv = HostKVBuffer(NUM_LAYERS * layer_bytes, "adm")
        self.client = EngineClient.connect(name)
        self.client.register_region(0, self.kv.region_record(num_blocks, PAGE_BYTES, NUM_LAYERS),
                                    layer_major_records(NUM_LAYERS, num_blocks, PAGE_BYTES))
        self.stamps = self.kv.data.reshape(NUM_LAYERS, num_blocks, PAGE_BYTES)[:, :, :8].view(np.uint64)[..., 0]

    def serve(self, chain: list[int], result: PolicyResult) -> None:
        """LOOKUP the chain, LOAD what it found (checked), SAVE the rest."""
        hashes = [block.to_bytes(32, "little") for block in chain]
        found = self.client.lookup(NAMESPACE, hashes)
        hit = found.num_hit_blocks
        result.requests += 1
        result.blocks += len(chain)
        if hit:
            self.stamps[:, :hit] = 0
            done = self.client.wait(self.client.submit_load(NAMESPACE, list(range(hit)), hashes[:hit],
                                                            lease_id=found.lease_id))
            if done.is_ok:
                expected = np.asarray(chain[:hit], dtype=np.uint64)
                result.wrong_blocks += int((self.stamps[:, :hit] != expected).any(axis=0).sum())
                result.served += hit
                result.served_from_disk += found.num_disk_blocks
            else:  # vLLM would recompute these: saved again below
                result.failed_loads += 1
                hit = 0
        if hit < len(chain):
            self.stamps[:, hit:len(chain)] = np.asarray(chain[hit:], dtype=np.uint64)
            saved = self.client.wait(self.client.submit_save(NAMESPACE, list(range(hit, len(chain))), hashes[hit:]))
            if not saved.is_ok:
                raise RuntimeError(f"save answered {saved.status!r}")

    def close(self) -> None:
        self.client.close()
        self.stamps = None
        self.kv.close()


def run_policy(policy: str, requests: list[list[int]], pool_size: str, disk_size: str, disk_dir: Path,
               gap_s: float = 0.0) -> PolicyResult:
    shutil.rmtree(disk_dir, ignore_errors=True)
    disk_dir.mkdir(parents=True)
    result = PolicyResult(policy)
    with EngineProcess(f"adm{policy}", "--disk-path", str(disk_dir), "--disk-size", disk_size,
                       "--disk-admission", policy, pool_size=pool_size) as engine:
        client = _Client(engine.name, max(len(chain) for chain in requests))
        try:
            t0 = time.perf_counter()
            for chain in requests:
                client.serve(chain, result)
                if gap_s:
                    time.sleep(gap_s)
            result.seconds = time.perf_counter() - t0
        finally:
            client.close()
        stats = read_stats(engine.name)
    result.engine = {k: v for k, v in stats.items()
                     if k.startswith(("disk_", "lookup_")) or k in ("evictions", "blocks_saved", "blocks_loaded")}
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pool-size", default="8MiB", help="the engine's pool (16 KiB blocks: 8MiB holds 512)")
    p.add_argument("--disk-size", default="32MiB", help="the disk tier (a block file is 20 KiB)")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--documents", type=int, default=Workload.documents,
                   help="one-off long prompts in the stream (0: none)")
    p.add_argument("--users", type=int, default=Workload.users)
    p.add_argument("--repeats", type=int, default=1, help="passes over the policies (interleaved)")
    p.add_argument("--gap-ms", type=float, default=0.0, help="pause between requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", default="", help="where the disk tier's folder goes (default: a temporary one)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    workload = Workload(users=args.users, documents=args.documents, seed=args.seed)
    requests = workload.requests()
    upper = servable(requests)
    base = Path(tempfile.mkdtemp(prefix="pegaflow-admission-", dir=args.dir or None))
    rows: list[PolicyResult] = []
    try:
        for _ in range(args.repeats):
            rows += [run_policy(policy, requests, args.pool_size, args.disk_size, base / policy, args.gap_ms / 1e3)
                     for policy in args.policies]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    out = sys.stderr if args.json else sys.stdout
    print(f"{len(requests)} requests, {sum(map(len, requests))} blocks, {upper} servable by an unbounded cache; "
          f"pool {args.pool_size}, disk {args.disk_size}", file=out)
    print(f"{'admission':<10}{'served':>8}{'x servable':>11}{'from disk':>10}{'disk writes':>12}"
          f"{'failed':>8}{'wrong':>7}{'s':>7}", file=out)
    for r in rows:
        print(f"{r.policy:<10}{r.served:>8}{r.served / max(upper, 1):>11.3f}{r.served_from_disk:>10}"
              f"{r.engine.get('disk_blocks_written', 0):>12}{r.failed_loads:>8}{r.wrong_blocks:>7}"
              f"{r.seconds:>7.1f}", file=out)
    if args.json:
        print(json.dumps({"workload": asdict(workload), "requests": len(requests), "servable": upper,
                          "pool_size": args.pool_size, "disk_size": args.disk_size,
                          "date": time.strftime("%Y-%m-%d"),
                          "command": "python -m tools.bench_admission " + " ".join(sys.argv[1:]),
                          "rows": [asdict(r) for r in rows]}))
    return 1 if any(r.wrong_blocks for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
