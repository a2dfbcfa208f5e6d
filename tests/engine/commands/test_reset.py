"""engine.commands.reset: RESET empties one namespace of the pool and the disk tier, never
frees a page a copy still uses, leaves other namespaces alone and refuses a namespace that is
not the asker's (or its vLLM instance's).  Through a real engine: ``test_reset_engine.py``."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from engine.copy.base import CopyDone
from pegaflow.platform.protocol import completion_of
from pegaflow.platform.wire import CommandFlag, Opcode, Status, encode_hashes
from tests.engine.commands.held_dispatcher import held_dispatcher, save_payload, store_blocks

NAMESPACE = 7  # the held dispatcher's clients send under it
OTHER = 8


def _attached(h, namespace: int = NAMESPACE, instance: int = 0):
    """The held dispatcher's client as ATTACH would have left it."""
    h.client.namespace, h.client.instance = namespace, instance
    return h


def _answer(h):
    return completion_of(h.completions.try_get())


def _stat(h, name: str) -> int:
    stats = h.dispatcher.stats
    return stats._words[stats._at[name]]


def _hits(h, command_id: int, hashes, namespace: int = NAMESPACE) -> int:
    """A LOOKUP's hits (its lease, if any, released again)."""
    h.send(command_id, Opcode.LOOKUP, encode_hashes(hashes).view(np.uint8), len(hashes), namespace=namespace)
    found = _answer(h)
    if found.value2:
        h.dispatcher.index.release(found.value2)
    return found.value


def test_reset_drops_every_block_of_the_namespace_and_a_lookup_misses():
    # 1. Three blocks stored under the client's namespace.
    h = _attached(held_dispatcher())
    hashes = [bytes([i + 1]) * 32 for i in range(3)]
    store_blocks(h, 1, [1, 2, 3], hashes)
    assert _hits(h, 2, hashes) == 3
    # 2. RESET: all three dropped, none held; their pages are back in the pool.
    h.send(3, Opcode.RESET)
    done = _answer(h)
    assert (done.status, done.result) == (Status.OK, (3, 0, 0))
    assert h.dispatcher.index.pool.num_entries == 0 and not h.dispatcher.index.entries
    # 3. A LOOKUP afterwards misses; the stats counted the reset and its blocks.
    assert _hits(h, 4, hashes) == 0
    assert (_stat(h, "resets"), _stat(h, "reset_blocks_dropped"), _stat(h, "reset_blocks_held")) == (1, 3, 0)


def test_reset_leaves_another_namespace_untouched():
    # 1. The same hashes under two namespaces.
    h = _attached(held_dispatcher())
    hashes = [b"s" * 32, b"t" * 32]
    store_blocks(h, 1, [1, 2], hashes)
    h.send(2, Opcode.SAVE, save_payload([3, 4], hashes), 2, namespace=OTHER)
    h.dispatcher.on_copy_done(CopyDone(h.backend.held.pop()))
    assert _answer(h).status == Status.OK
    # 2. RESET of the client's namespace: the other's blocks are still served.
    h.send(3, Opcode.RESET)
    assert _answer(h).result.num_dropped == 2
    assert _hits(h, 4, hashes) == 0 and _hits(h, 5, hashes, namespace=OTHER) == 2


def test_reset_of_a_block_under_an_inflight_load_frees_its_page_only_when_the_load_ends():
    # 1. Two blocks stored; a LOOKUP leases them and a LOAD of the lease is in flight.
    h = _attached(held_dispatcher())
    index, hashes = h.dispatcher.index, [b"u" * 32, b"v" * 32]
    store_blocks(h, 1, [1, 2], hashes)
    h.send(2, Opcode.LOOKUP, encode_hashes(hashes).view(np.uint8), 2)
    lease_id = _answer(h).value2
    h.send(3, Opcode.LOAD, save_payload([5, 6], hashes), 2, flags=CommandFlag.RELEASE_LEASE, arg=lease_id)
    (load_token,) = h.backend.held
    # 2. RESET meanwhile: both counted, both held; their pages stay allocated under the copy.
    h.send(4, Opcode.RESET)
    assert _answer(h).result == (2, 2, 0)
    assert index.pool.num_entries == 2
    # 3. Never served again, though: a LOOKUP misses while the copy still runs.
    assert _hits(h, 5, hashes) == 0
    # 4. The copy ends: the LOAD is answered OK (it read the blocks it was given), and only
    #    now are their pages freed.
    h.backend.held.remove(load_token)
    h.dispatcher.on_copy_done(CopyDone(load_token))
    assert _answer(h).status == Status.OK
    assert index.pool.num_entries == 0 and not index.entries


def test_reset_of_a_block_being_saved_never_makes_it_ready():
    # 1. A SAVE's copy is in flight (its entry WRITING) when RESET comes: held, not freed.
    h = _attached(held_dispatcher())
    index, hashes = h.dispatcher.index, [b"w" * 32]
    h.send(1, Opcode.SAVE, save_payload([1], hashes), 1)
    (token,) = h.backend.held
    h.send(2, Opcode.RESET)
    assert _answer(h).result == (1, 1, 0) and index.pool.num_entries == 1
    # 2. The copy lands: the SAVE is answered, the block dropped, never READY.
    h.backend.held.remove(token)
    h.dispatcher.on_copy_done(CopyDone(token))
    assert _answer(h).status == Status.OK
    assert index.pool.num_entries == 0 and _hits(h, 3, hashes) == 0


@pytest.mark.parametrize("attached,namespace", [(NAMESPACE, OTHER), (0, 0)], ids=["another-models", "zero"])
def test_reset_of_a_namespace_not_the_clients_is_refused_bad_argument(attached, namespace):
    # 1. A block under the client's namespace, and one under another (the client attached
    #    under NAMESPACE, or under none: 0 is no namespace, not one to empty).
    h = _attached(held_dispatcher(), namespace=attached)
    store_blocks(h, 1, [1], [b"x" * 32])
    h.send(2, Opcode.SAVE, save_payload([2], [b"y" * 32]), 1, namespace=OTHER)
    h.dispatcher.on_copy_done(CopyDone(h.backend.held.pop()))
    assert _answer(h).status == Status.OK
    # 2. A RESET of a namespace this client did not attach under: refused, nothing dropped.
    h.send(3, Opcode.RESET, namespace=namespace)
    assert _answer(h).status == Status.BAD_ARGUMENT
    assert len(h.dispatcher.index.entries) == 2 and _stat(h, "resets") == 0


def test_reset_with_a_payload_is_refused_bad_payload():
    h = _attached(held_dispatcher())
    store_blocks(h, 1, [1], [b"x" * 32])
    # A RESET record that carries a hash record (no encoder writes one): refused, nothing dropped.
    h.send(2, Opcode.RESET, encode_hashes([b"x" * 32]).view(np.uint8), 1)
    assert _answer(h).status == Status.BAD_PAYLOAD
    assert len(h.dispatcher.index.entries) == 1


def test_reset_may_name_a_namespace_of_its_instances_other_clients_only():
    # 1. A scheduler (namespace 7, instance 5) beside its rank-1 worker (namespace 8, the same
    #    instance) and another vLLM's worker (namespace 9, instance 6).
    h = _attached(held_dispatcher(), instance=5)
    worker, stranger = h.add_client(1), h.add_client(2)
    worker.client.namespace, worker.client.instance = OTHER, 5
    stranger.client.namespace, stranger.client.instance = 9, 6
    resets = h.dispatcher.resets
    lone = SimpleNamespace(namespace=OTHER, instance=0)  # a client of no instance under OTHER
    resets.clients = lambda: (h.client, worker.client, stranger.client, lone)
    # 2. Its own namespace and its worker's: yes; the other vLLM's: no.
    assert resets.may_reset(h.client, NAMESPACE) and resets.may_reset(h.client, OTHER)
    assert not resets.may_reset(h.client, 9)
    # 3. A client of no instance may name its own namespace only (not another of no instance's).
    assert not resets.may_reset(SimpleNamespace(namespace=NAMESPACE, instance=0), OTHER)


def test_reset_removes_the_namespaces_disk_blocks_too_and_a_lookup_does_not_read_them_back(tmp_path):
    # 1. A disk tier under a pool of two entries: blocks 0..3 of NAMESPACE and one of OTHER
    #    written to disk, the pool then holding only the last two.
    from engine.blocks.index import BlockIndex
    from engine.commands.reset import Resets
    from engine.disk.store import DiskStore
    from engine.disk.tier import DiskTier
    from engine.memory.pool import PagePool
    from engine.stats import StatsWriter
    from pegaflow.platform.wire import STATS
    entry_bytes, num_layers = 4096, 1
    index = BlockIndex(PagePool(2 * entry_bytes, 2 * entry_bytes), lease_ttl_s=60.0)
    tier = DiskTier(DiskStore([tmp_path], 1 << 20, num_threads=2), index, np.zeros(2 * entry_bytes, np.uint8),
                    StatsWriter(np.zeros(1, STATS)), admission="all")
    keys = [(NAMESPACE, bytes([i + 1]) * 32 + b" ") for i in range(4)] + [(OTHER, b"o" * 32 + b" ")]
    try:
        for key in keys:
            index.reserve(key, entry_bytes, num_layers, 1)
            index.mark_layers_done([key], 1)
            tier.spill()
            _settle(tier)
        assert all(tier.store.contains(key) for key in keys)
        # 2. A RESET of NAMESPACE: the pool's and the disk's copies of its blocks go.
        resets = Resets(index, tier.stats, tuple, disk=tier)
        asker = SimpleNamespace(namespace=NAMESPACE, instance=0, slot=1, pid=1)
        answer = resets.reset(SimpleNamespace(client=asker), SimpleNamespace(namespace=NAMESPACE))
        assert answer.num_disk_dropped == 4 and answer.num_held == 0
        assert not any(tier.store.contains(key) for key in keys[:4]) and tier.store.contains(keys[4])
        # 3. A LOOKUP reads none of them back from disk: a miss, no read started.
        assert index.lookup(1, keys[:4]) == (0, 0) and tier.num_inflight == 0
        assert index.lookup(1, keys[4:])[0] == 1  # the other namespace's block still served
        files = [p for p in tmp_path.rglob("*.blk")]  # and their files are gone, the other's stays
        assert len(files) == 1 and f"{OTHER:016x}" in str(files[0])
    finally:
        tier.close()


def _settle(tier) -> None:
    import time
    deadline = time.monotonic() + 10
    while tier.num_inflight:
        tier.poll()
        assert time.monotonic() < deadline, "disk I/O did not finish"
        time.sleep(1e-3)


def test_reset_drops_a_kept_pools_entries_not_taken_in_yet():
    # 1. A kept pool's entries of two namespaces in its second slab, not pinned yet: they
    #    wait outside the index.
    from engine.blocks.entries import ORPHAN, Entry
    from engine.blocks.index import BlockIndex
    from engine.memory.pool import PagePool
    slab = 1 << 16
    pool = PagePool(2 * slab, slab, ready_bytes=slab)
    index = BlockIndex(pool, lease_ttl_s=60.0)
    mine, theirs = (NAMESPACE, b"k" * 32), (OTHER, b"k" * 32)
    assert pool.adopt([(slab, 4096), (slab + 4096, 4096)]) == [True, True]
    index.kept.beyond_ready.extend([(slab, 0, mine, Entry(slab, 4096, 1, ORPHAN, done_mask=1)),
                                    (slab + 4096, 1, theirs, Entry(slab + 4096, 4096, 1, ORPHAN, done_mask=1))])
    # 2. A RESET of NAMESPACE counts its kept entry.
    assert index.drop_namespace(NAMESPACE) == (1, 0)
    # 3. The pool grows over them: only the other namespace's entry is taken in, and the
    #    reset one's page is free again.
    assert index.grow(2 * slab) == 1
    assert list(index.entries) == [theirs] and pool.num_entries == 1
