"""Smoke check against a running engine: save, look up, load, compare every byte.

    pegaflow-engine --backend host &      # or: make run-engine
    pegaflow-smoke --name pegaflow        # or: python -m pegaflow.smoke, make smoke

It attaches as a client of its own (host memory, so no GPU is needed whatever the engine's
backend), stores 64 random blocks under a namespace of its own and loads them back.
"""

from __future__ import annotations

import os
import sys

import numpy as np

from pegaflow.client.connection import EngineClient
from pegaflow.client.host_memory import HostKVBuffer, layer_major_records
from pegaflow.platform import shm
from pegaflow.platform.cli import EXIT_FAILED, EXIT_OK, ArgumentParser, say
from pegaflow.platform.errors import ConfigError, EngineNotRunningError, PegaflowError
from pegaflow.platform.values import version_line

PROG = "pegaflow-smoke"
NUM_LAYERS = 4
NUM_BLOCKS = 256
PAGE_BYTES = 4096
NUM_SAVED = 64
NAMESPACE = 0x5A0CE


def run(name: str) -> str | None:
    """None when every byte round-trips, else the reason."""
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    layer_bytes = NUM_BLOCKS * PAGE_BYTES
    client = EngineClient.connect(name)
    kv = HostKVBuffer(NUM_LAYERS * layer_bytes, "smoke")
    try:
        # 1. Register a 4-layer cache: layer l at l * layer_bytes, one page per block.
        client.register_region(0, kv.region_record(NUM_BLOCKS, PAGE_BYTES, NUM_LAYERS),
                               layer_major_records(NUM_LAYERS, NUM_BLOCKS, PAGE_BYTES))
        # 2. Fill 64 random blocks with random bytes and save them under random hashes.
        kv.data[:] = rng.integers(0, 256, kv.num_bytes, dtype=np.uint8)
        src = rng.choice(NUM_BLOCKS, NUM_SAVED, replace=False)
        hashes = [rng.bytes(32) for _ in range(NUM_SAVED)]
        saved = client.wait(client.submit_save(NAMESPACE, src, hashes))
        if not saved.is_ok or saved.value != NUM_SAVED:
            return f"save answered {saved.status.name}, {saved.value} of {NUM_SAVED} blocks stored"
        # 3. Look them up: all must hit.
        found = client.lookup(NAMESPACE, hashes)
        if found.num_hit_blocks != NUM_SAVED:
            return f"lookup hit {found.num_hit_blocks} of {NUM_SAVED} blocks"
        # 4. Load into other block ids, poisoned first, and compare every byte.
        dst = rng.choice(np.setdiff1d(np.arange(NUM_BLOCKS), src), NUM_SAVED, replace=False)
        pages = kv.data.reshape(NUM_LAYERS, NUM_BLOCKS, PAGE_BYTES)
        expected = pages[:, src].copy()
        pages[:, dst] = 0xA5
        loaded = client.wait(client.submit_load(NAMESPACE, dst, hashes, lease_id=found.lease_id))
        if not loaded.is_ok:
            return f"load answered {loaded.status.name}"
        bad = int((pages[:, dst] != expected).sum())
        return f"{bad} bytes differ after the load" if bad else None
    finally:
        client.close()
        kv.close()


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="pegaflow-smoke", description="save, look up and load a few blocks "
                            "through a running engine, comparing every byte")
    parser.add_argument("--version", action="version", version=version_line("pegaflow-smoke"))
    parser.add_argument("--name", default=os.environ.get("PEGAFLOW_NAME", "pegaflow"),
                        help="engine name (env PEGAFLOW_NAME; default %(default)s)")
    args = parser.parse_args(argv)
    try:
        shm.check_engine_name(args.name)
    except ConfigError as exc:
        parser.error(str(exc))
    try:
        reason = run(args.name)
    except EngineNotRunningError as exc:
        say(PROG, _not_running(args.name, exc))
        return EXIT_FAILED
    except PegaflowError as exc:
        reason = str(exc)
    if reason:
        say(PROG, f"FAILED: {reason}")
        return EXIT_FAILED
    print("smoke ok")
    return EXIT_OK


def _not_running(name: str, exc: EngineNotRunningError) -> str:
    """No engine of that name at all, or one that is not serving (still starting, gone)."""
    if os.path.exists(shm.segment_path(shm.ipc_name(name, "control"))):
        return str(exc)
    return (f"no engine named {name!r} is running on this host (start one with "
            f"`pegaflow-engine --name {name}`)")


if __name__ == "__main__":
    sys.exit(main())
