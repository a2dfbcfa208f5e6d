"""The remote tier between two engines on two hosts (network namespaces over a veth pair,
see conftest), host backend: a block saved through one engine is served, byte for byte,
to a client of the other; the master killed mid-run means misses, within the lookup
deadline, then hits again once it is back; a block damaged in the store is never served."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np

from pegaflow.platform.wire import Status
from tests.conftest import unique_engine_name
from tools.engine_process import ROOT

NAMESPACE = 11
POOL = dict(pool_size="4MiB")  # 1 MiB slabs of 16 KiB entries: 256 blocks


def _engines(engine_factory, master, hosts, *more: str):
    """Engine A on the first host, engine B on the second, both on the master's store."""
    first = engine_factory(unique_engine_name("rma"), prefix=hosts.first.prefix,
                           extra=master.engine_flags(hosts.first, *more), **POOL)
    second = engine_factory(unique_engine_name("rmb"), prefix=hosts.second.prefix,
                            extra=master.engine_flags(hosts.second, *more), **POOL)
    return first, second


def _published(engine, count: int) -> dict:
    return engine.wait_stats(lambda s: s["remote_blocks_put"] >= count)


def test_remote_tier_blocks_saved_on_one_host_are_served_on_the_other_byte_exact(
        mooncake_master, two_hosts, engine_factory, kv_client, rng):
    # 1. A client of engine A saves 32 blocks; A publishes them all to the store.
    first, second = _engines(engine_factory, mooncake_master, two_hosts)
    hashes, saved = kv_client(first).store(rng, NAMESPACE, list(range(32)))
    _published(first, 32)
    # 2. A client of engine B (its pool empty) finds all 32 through the store: fetched into
    #    B's pool, counted as blocks on their way (the LOAD waits for them), then loaded exactly.
    client = kv_client(second)
    found, done, loaded = client.look_up_and_load(NAMESPACE, hashes)
    assert found.num_hit_blocks == 32 and found.num_disk_blocks == 32
    assert done.is_ok and np.array_equal(loaded, saved)
    stats = second.fresh_stats()
    assert stats["remote_blocks_fetched"] == 32 and stats["remote_checksum_failures"] == 0
    assert stats["lookup_remote_blocks"] == 32 and stats["remote_bytes_fetched"] == 32 * client.ENTRY_BYTES
    # 3. Now local to B: a second lookup hits B's pool and does not ask the store again.
    found, done, loaded = client.look_up_and_load(NAMESPACE, hashes)
    assert found.num_hit_blocks == 32 and found.num_disk_blocks == 0 and np.array_equal(loaded, saved)
    assert second.fresh_stats()["remote_lookups"] == stats["remote_lookups"]
    # 4. A prefix B holds only in part goes on through the store: 8 new blocks on A after them.
    more, more_saved = kv_client(first).store(rng, NAMESPACE, list(range(32, 40)))
    _published(first, 40)
    found, done, loaded = client.look_up_and_load(NAMESPACE, hashes + more)
    assert found.num_hit_blocks == 40 and found.num_disk_blocks == 8
    assert done.is_ok and np.array_equal(loaded, np.concatenate([saved, more_saved], axis=1))


def test_remote_tier_master_killed_is_a_miss_then_recovers(mooncake_master, two_hosts, engine_factory,
                                                           kv_client, rng):
    # 1. Both engines up, blocks published by A.
    first, second = _engines(engine_factory, mooncake_master, two_hosts)
    client_a, client_b = kv_client(first), kv_client(second)
    hashes, _ = client_a.store(rng, NAMESPACE, list(range(8)))
    _published(first, 8)
    # 2. The master is killed: B's lookups are misses, answered within the deadline (the
    #    connector's 5 s is far off), and counted; A's saves are still answered at once.
    mooncake_master.kill()
    assert client_b.num_hits(NAMESPACE, hashes) == 0  # answered (not EngineTimeoutError)
    assert client_a.store(rng, NAMESPACE, list(range(8, 16)))
    stats = second.fresh_stats()
    assert stats["remote_lookup_timeouts"] + stats["remote_errors"] >= 1
    # 3. Back again (an empty store: what it held is gone with the master), the engines'
    #    clients find it by themselves; blocks A saves from then on reach B again.
    mooncake_master.start()
    deadline, served = time.monotonic() + 30.0, False
    while not served and time.monotonic() < deadline:
        new_hashes, new_saved = client_a.store(rng, NAMESPACE, list(range(16, 20)))
        time.sleep(0.3)
        found, done, loaded = client_b.look_up_and_load(NAMESPACE, new_hashes)
        served = found.num_hit_blocks == 4 and done.is_ok and np.array_equal(loaded, new_saved)
        if found.lease_id and not served and done is None:
            client_b.release(found.lease_id)
    assert served, f"the store never served again: A {first.fresh_stats()}, B {second.fresh_stats()}"


def test_remote_tier_damaged_block_is_a_miss_never_served(mooncake_master, two_hosts, engine_factory,
                                                          kv_client, rng):
    # 1. A publishes 4 blocks; one bit of the third one's data is flipped in the store.
    first, second = _engines(engine_factory, mooncake_master, two_hosts)
    hashes, saved = kv_client(first).store(rng, NAMESPACE, [0, 1, 2, 3])
    _published(first, 4)
    env = dict(os.environ, PYTHONPATH=str(ROOT), MC_LOG_LEVEL="WARNING")
    overwrite = subprocess.run([*two_hosts.second.prefix, sys.executable, "-m", "tests.engine.remote.overwrite_block",
                                mooncake_master.address, mooncake_master.metadata, two_hosts.second.address,
                                str(NAMESPACE), hashes[2].hex()], cwd=ROOT, env=env, capture_output=True, timeout=60)
    assert overwrite.returncode == 0, overwrite.stderr.decode(errors="replace")[-2000:]
    # 2. B finds all 4 in the store (their headers are intact), but the damaged one fails
    #    its checksum: the LOAD through it answers MISSING_BLOCK (vLLM recomputes), counted.
    client = kv_client(second)
    found, done, _ = client.look_up_and_load(NAMESPACE, hashes)
    assert found.num_hit_blocks == 4 and found.num_disk_blocks == 4
    assert done.status == Status.MISSING_BLOCK
    stats = second.fresh_stats()
    assert stats["remote_checksum_failures"] == 1 and stats["remote_blocks_fetched"] == 3
    # 3. The good blocks before it are B's now and served exactly; the damaged one never is.
    found, done, loaded = client.look_up_and_load(NAMESPACE, hashes[:2])
    assert found.num_hit_blocks == 2 and done.is_ok and np.array_equal(loaded, saved[:, :2])
    found, done, loaded = client.look_up_and_load(NAMESPACE, hashes)
    assert done.status == Status.MISSING_BLOCK or found.num_hit_blocks == 2
    assert second.fresh_stats()["remote_checksum_failures"] >= 1
