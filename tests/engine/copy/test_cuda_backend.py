"""GPU tests of the CUDA copy backend against KV memory owned by another process.

A spawned client process (torch) allocates a KV cache in vLLM's default layout — one
allocation, layer-major, ``[num_layers, num_blocks, block_size, kv_heads, 2 * head]`` in
bf16 — exports it and an event pool, and obeys commands over a pipe.  This process is
the engine: it drives ``CudaBackend`` on a pool in /dev/shm.  The last test runs the
real engine process (``--backend cuda``) with this process as its torch client.
Skipped where CUDA is absent.
"""

from __future__ import annotations

import itertools
import os
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)
pytest.importorskip("cuda.bindings")
pytest.importorskip("posix_ipc")

from engine.copy import cuda_device  # noqa: E402
from engine.copy.base import CopyOp, Direction, LayerPlacement  # noqa: E402
from engine.copy.cuda import CudaBackend  # noqa: E402
from pegaflow.client.host_memory import layer_major_records  # noqa: E402
from pegaflow.platform import shm  # noqa: E402
from pegaflow.platform.cuda.ipc import EventPool, export_allocation, region_record  # noqa: E402
from pegaflow.platform.errors import CommandError  # noqa: E402
from pegaflow.platform.wire import ALL_LAYERS, Status  # noqa: E402
from tests.spawn import start_child  # noqa: E402

NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD = 4, 64, 16, 2, 64
PAGE_BYTES = BLOCK_SIZE * KV_HEADS * 2 * HEAD * 2  # K and V of one block, bf16: 8 KiB
LAYER_BYTES = NUM_BLOCKS * PAGE_BYTES
ENTRY_BYTES = NUM_LAYERS * PAGE_BYTES
NUM_ENTRIES = 48
NUM_EVENTS = 8
NUM_COPIED = 12
PAD_BYTES = (1 << 20) + 4096
SLEEP_CYCLES = 400_000_000  # ~0.2 s of GPU time
TIMEOUT_S = 60.0
POISON, NEW_BYTE = 0xAB, 0x5A
_tokens = itertools.count(1)
_pools = itertools.count()


def _client_main(conn, pad_bytes: int, seed: int) -> None:
    """The KV owner: random pages, exported; then one command per message until None."""
    torch.cuda.set_device(0)
    whole = torch.empty(pad_bytes + NUM_LAYERS * LAYER_BYTES, dtype=torch.uint8, device="cuda")
    raw = whole[pad_bytes:]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, device="cuda", generator=gen))
    kv = raw.view(torch.bfloat16).view(NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, 2 * HEAD)
    pages = raw.view(NUM_LAYERS, NUM_BLOCKS, PAGE_BYTES)
    events, side = EventPool(NUM_EVENTS), torch.cuda.Stream()
    torch.cuda.synchronize()
    conn.send((export_allocation(kv.data_ptr()), events.handles()))
    while (cmd := conn.recv()) is not None:
        conn.send(_client_command(pages, events, side, *cmd))
    events.close()


def _client_command(pages, events: EventPool, side, name: str, *args):
    current = torch.cuda.current_stream()
    if name == "read":
        torch.cuda.synchronize()
        return pages.cpu().numpy()
    if name == "poison":
        pages[:, torch.as_tensor(args[0], device="cuda")] = POISON
        torch.cuda.synchronize()
        return None
    if name == "late_write_then_record":  # the layer gets new bytes ~0.2 s from now
        layer, event = args
        torch.cuda._sleep(SLEEP_CYCLES)
        pages[layer].fill_(NEW_BYTE)
        events.record([event], current.cuda_stream)
        return None
    if name == "sleep_then_record":
        torch.cuda._sleep(SLEEP_CYCLES)
        events.record([args[0]], current.cuda_stream)
        return None
    if name == "wait_then_read":  # a "compute" stream that reads after the event only
        layer, block_ids, event = args
        events.wait([event], side.cuda_stream)
        with torch.cuda.stream(side):
            out = pages[layer, torch.as_tensor(block_ids, device="cuda")].clone()
        side.synchronize()
        return out.cpu().numpy()
    raise ValueError(name)


class KVOwner:
    def __init__(self, pad_bytes: int = 0, seed: int = 1) -> None:
        self.conn, self.proc = start_child(_client_main, pad_bytes, seed)
        self.exported, self.event_handles = self._recv()

    def _recv(self):
        assert self.conn.poll(TIMEOUT_S), "the client process did not answer"
        return self.conn.recv()

    def call(self, *cmd):
        self.conn.send(cmd)
        return self._recv()

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(TIMEOUT_S)


@pytest.fixture
def pool():
    name = shm.ipc_name("gputest", f"pool{os.getpid()}_{next(_pools)}")
    segment = shm.create_segment(name, NUM_ENTRIES * ENTRY_BYTES)
    yield segment
    segment.close()
    segment.unlink()


@pytest.fixture(scope="module")
def owners():
    """One client process per padding, shared by the module's tests (each reads afresh)."""
    started: dict[int, KVOwner] = {}

    def owner(pad_bytes: int) -> KVOwner:
        if pad_bytes not in started:
            started[pad_bytes] = KVOwner(pad_bytes)
        return started[pad_bytes]

    yield owner
    for kv_owner in started.values():
        kv_owner.close()


@pytest.fixture
def setup(pool, owners):
    """``setup(path, pad_bytes=0, **backend options)`` -> (client process, backend, pool entries view)."""
    made = []

    def make(path: str, pad_bytes: int = 0, **options):
        owner = owners(pad_bytes)
        backend = CudaBackend(copy_backend=path, **options)
        made.append(backend)
        backend.attach_pool(pool)
        backend.register_region(0, 0, region_record(owner.exported, NUM_LAYERS, NUM_BLOCKS,
                                                    PAGE_BYTES)[0])
        backend.register_events(0, owner.event_handles)
        entries = pool.array(np.uint8, NUM_ENTRIES * ENTRY_BYTES).reshape(
            NUM_ENTRIES, NUM_LAYERS, PAGE_BYTES)
        entries[:] = POISON
        return owner, backend, entries

    yield make
    for backend in made:  # closes its handles before the owners exit
        backend.close()


def _op(direction: Direction, block_ids, entry_ids, layers=range(NUM_LAYERS), **kw) -> CopyOp:
    placements = [LayerPlacement(i, 0, i * LAYER_BYTES, PAGE_BYTES) for i in layers]
    return CopyOp(next(_tokens), direction, 0, placements, PAGE_BYTES,
                  np.asarray(block_ids, np.int64), np.asarray(entry_ids, np.int64) * ENTRY_BYTES,
                  **kw)


def _wait(backend: CudaBackend, *tokens: int) -> dict[int, str | None]:
    """Poll (never synchronize) until every token is reported; token -> error."""
    deadline, done = time.monotonic() + TIMEOUT_S, {}
    while set(tokens) - set(done):
        done.update((d.token, d.error) for d in backend.poll())
        assert time.monotonic() < deadline, f"copies {tokens} not done; {done}"
        time.sleep(1e-4)
    return done


@pytest.mark.gpu
@pytest.mark.parametrize("pad_bytes", [0, PAD_BYTES], ids=["at-base", "offset"])
@pytest.mark.parametrize("path", ["kernel", "copy-engine", "staged", "auto"])
def test_cuda_backend_round_trip_random_blocks_byte_exact(setup, rng, path, pad_bytes):
    owner, backend, entries = setup(path, pad_bytes)
    if pad_bytes:  # the KV tensor is not at its allocation's base
        assert owner.exported.base_offset >= pad_bytes
    before = owner.call("read")
    # 1. SAVE random blocks into random (poisoned) pool entries: exactly their bytes land.
    src = rng.choice(NUM_BLOCKS, NUM_COPIED, replace=False)
    entry_ids = rng.choice(NUM_ENTRIES, NUM_COPIED, replace=False)
    save = _op(Direction.SAVE, src, entry_ids)
    backend.submit(save)
    assert _wait(backend, save.token) == {save.token: None}
    assert np.array_equal(entries[entry_ids], before[:, src].transpose(1, 0, 2))
    untouched = np.setdiff1d(np.arange(NUM_ENTRIES), entry_ids)
    assert (entries[untouched] == POISON).all()
    # 2. LOAD them into other, poisoned blocks: those get the saved bytes, the rest stay.
    dst = rng.choice(np.setdiff1d(np.arange(NUM_BLOCKS), src), NUM_COPIED, replace=False)
    owner.call("poison", dst)
    load = _op(Direction.LOAD, dst, entry_ids)
    backend.submit(load)
    assert _wait(backend, load.token) == {load.token: None}
    after = owner.call("read")
    assert np.array_equal(after[:, dst], before[:, src])
    others = np.setdiff1d(np.arange(NUM_BLOCKS), dst)
    assert np.array_equal(after[:, others], before[:, others])


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["kernel", "copy-engine", "staged"])
def test_cuda_backend_saves_queued_together_each_land_byte_exact(setup, rng, path):
    # Several SAVE ops at once join one chain of layer copies (each op's first layers wait
    # on the previous op's last ones): every op still stores exactly its blocks.
    owner, backend, entries = setup(path)
    before = owner.call("read")
    src = rng.choice(NUM_BLOCKS, 3 * NUM_COPIED, replace=False).reshape(3, NUM_COPIED)
    entry_ids = rng.choice(NUM_ENTRIES, 3 * NUM_COPIED, replace=False).reshape(3, NUM_COPIED)
    saves = [_op(Direction.SAVE, src[i], entry_ids[i]) for i in range(3)]
    for save in saves:
        backend.submit(save)
    assert _wait(backend, *(s.token for s in saves)) == {s.token: None for s in saves}
    for i in range(3):
        assert np.array_equal(entries[entry_ids[i]], before[:, src[i]].transpose(1, 0, 2))


@pytest.mark.gpu
@pytest.mark.parametrize("hold", [False, True], ids=["issued", "held"])
@pytest.mark.parametrize("path", ["kernel", "copy-engine"])
def test_cuda_backend_save_waits_for_client_event_saves_new_bytes(setup, rng, path, hold):
    owner, backend, entries = setup(path, hold_saves=hold)
    block_ids = rng.choice(NUM_BLOCKS, NUM_COPIED, replace=False)
    entry_ids = rng.choice(NUM_ENTRIES, NUM_COPIED, replace=False)
    # 1. The client writes layer 2 late (behind ~0.2 s of GPU work) and records event 5.
    owner.call("late_write_then_record", 2, 5)
    # 2. Saved at once, waiting on event 5: the pool holds the new bytes, not the old.
    save = _op(Direction.SAVE, block_ids, entry_ids, layers=[2], wait_event=5)
    backend.submit(save)
    assert _wait(backend, save.token) == {save.token: None}
    assert (entries[entry_ids, 2] == NEW_BYTE).all()


@pytest.mark.gpu
@pytest.mark.parametrize("hold", [False, True], ids=["issued", "held"])
@pytest.mark.parametrize("per_layer", [False, True], ids=["one-event", "event-per-layer"])
def test_cuda_backend_staged_save_waits_for_client_event_saves_new_bytes(setup, rng, per_layer, hold):
    owner, backend, entries = setup("staged", hold_saves=hold)
    before = owner.call("read")
    block_ids = rng.choice(NUM_BLOCKS, NUM_COPIED, replace=False)
    entry_ids = rng.choice(NUM_ENTRIES, NUM_COPIED, replace=False)
    # 1. The client writes layer 2 late (behind ~0.2 s of GPU work) and records the event
    #    the save waits on for that layer (5 for the whole op, or 3 + 2 with one per layer;
    #    the other layers' events were recorded long ago).
    owner.call("late_write_then_record", 2, 5)
    save = _op(Direction.SAVE, block_ids, entry_ids, wait_event=3 if per_layer else 5,
               wait_per_layer=per_layer)
    backend.submit(save)
    # 2. Saved at once, staged through device memory: layer 2 holds the new bytes, the
    #    other layers the blocks' own.
    assert _wait(backend, save.token) == {save.token: None}
    assert (entries[entry_ids, 2] == NEW_BYTE).all()
    others = [0, 1, 3]
    assert np.array_equal(entries[entry_ids][:, others],
                          before[others][:, block_ids].transpose(1, 0, 2))


def _stored_entries_and_poisoned_blocks(owner, entries, rng):
    """(client blocks, pool entries) for a LOAD: random bytes in the entries, poison in the
    blocks, so a read before the copy landed shows."""
    dst = rng.choice(NUM_BLOCKS, NUM_COPIED, replace=False)
    entry_ids = rng.choice(NUM_ENTRIES, NUM_COPIED, replace=False)
    entries[entry_ids] = rng.integers(0, 256, entries[entry_ids].shape, dtype=np.uint8)
    owner.call("poison", dst)
    return dst, entry_ids


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["kernel", "copy-engine"])
def test_cuda_backend_load_records_event_compute_reads_after_it(setup, rng, path):
    owner, backend, entries = setup(path)
    dst, entry_ids = _stored_entries_and_poisoned_blocks(owner, entries, rng)
    # 1. Hold the LOAD ~0.2 s: its copy first waits for a late client event (0), then
    #    records event 4 after layer 1's copy.
    owner.call("sleep_then_record", 0)
    load = _op(Direction.LOAD, dst, entry_ids, layers=[1], record_events=4, wait_event=0)
    backend.submit(load)
    # 2. The client's compute stream waits on event 4 and reads at once: the loaded bytes,
    #    not the poison the blocks held for those 0.2 s.
    got = owner.call("wait_then_read", 1, dst, 4)
    assert np.array_equal(got, entries[entry_ids, 1])
    assert _wait(backend, load.token) == {load.token: None}


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["kernel", "copy-engine", "staged", "staged-groups"])
def test_cuda_backend_all_layers_load_events_each_layer_in_order(setup, rng, path):
    # staged-groups: staged, the LOAD a layer group at a time (--load-layer-groups 2)
    owner, backend, entries = setup("staged", load_layer_groups=2) if path == "staged-groups" else setup(path)
    dst, entry_ids = _stored_entries_and_poisoned_blocks(owner, entries, rng)
    # One LOAD of every layer records events 2..5, one per layer; each layer reads right.
    load = _op(Direction.LOAD, dst, entry_ids, record_events=2)
    backend.submit(load)
    for layer in range(NUM_LAYERS):
        got = owner.call("wait_then_read", layer, dst, 2 + layer)
        assert np.array_equal(got, entries[entry_ids, layer])
    assert _wait(backend, load.token) == {load.token: None}


@pytest.mark.gpu
def test_cuda_backend_attach_pool_leaves_its_bytes_unchanged(pool, monkeypatch):
    """Attaching writes every pool page once by DMA: the bytes it writes are those it read,
    through many chunks on both streams and a short last one."""
    monkeypatch.setattr(cuda_device, "_DMA_CHUNK", 40 << 10)
    assert pool.size % (40 << 10) and pool.size // (40 << 10) > 2
    copies, memcpy_async = [], cuda_device.driver.memcpy_async

    def recorded(dst, src, num_bytes, stream):
        copies.append((dst, num_bytes))
        memcpy_async(dst, src, num_bytes, stream)

    monkeypatch.setattr(cuda_device.driver, "memcpy_async", recorded)
    before = np.random.default_rng(3).integers(0, 256, pool.size, dtype=np.uint8)
    pool.array(np.uint8, pool.size)[:] = before
    backend = CudaBackend(copy_backend="copy-engine")
    try:
        backend.attach_pool(pool)
        assert np.array_equal(pool.array(np.uint8, pool.size), before)
        # Every pool byte was written by DMA exactly once (writes are the copies into it).
        base = backend._devices[0].pool_base
        writes = sorted((dst, n) for dst, n in copies if base <= dst < base + pool.size)
        assert [dst for dst, _ in writes] == list(np.cumsum([base] + [n for _, n in writes[:-1]]))
        assert sum(n for _, n in writes) == pool.size
    finally:
        backend.close()


@pytest.mark.gpu
def test_cuda_backend_out_of_range_block_is_refused_at_submit(setup):
    _, backend, entries = setup("kernel")
    bad = _op(Direction.LOAD, [1 << 24], [0])  # 128 GiB past the region: past any allocation
    with pytest.raises(CommandError) as info:
        backend.submit(bad)
    assert info.value.status == Status.BLOCK_OUT_OF_RANGE
    assert backend.num_inflight() == 0 and backend.poll() == []  # nothing of it in flight
    assert (entries == POISON).all()


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["kernel", "copy-engine", "staged"])
def test_engine_process_cuda_backend_round_trip_byte_exact(engine_factory, rng, path):
    # 1. A real engine with the CUDA backend; this process is its torch client.
    engine = engine_factory(pool_size="64MiB", slab_size="1MiB",
                            extra=("--backend", "cuda", "--copy-backend", path))
    raw = torch.randint(0, 256, (PAD_BYTES + NUM_LAYERS * LAYER_BYTES,), dtype=torch.uint8,
                        device="cuda")[PAD_BYTES:]
    pages = raw.view(NUM_LAYERS, NUM_BLOCKS, PAGE_BYTES)
    events = EventPool(NUM_EVENTS)
    torch.cuda.synchronize()
    client = engine.connect()
    try:
        client.register_region(0, region_record(export_allocation(raw.data_ptr()), NUM_LAYERS,
                                                NUM_BLOCKS, PAGE_BYTES),
                               layer_major_records(NUM_LAYERS, NUM_BLOCKS, PAGE_BYTES))
        client.register_events(events.handles())
        # 2. Save random blocks (all layers), look them up, load into other poisoned blocks.
        src = rng.choice(NUM_BLOCKS, NUM_COPIED, replace=False)
        hashes = [rng.bytes(32) for _ in src]
        saved = client.wait(client.submit_save(7, src, hashes, layer=ALL_LAYERS))
        assert saved.is_ok and saved.value == NUM_COPIED
        found = client.lookup(7, hashes)
        assert found.num_hit_blocks == NUM_COPIED
        expected = pages[:, torch.as_tensor(src, device="cuda")].cpu().numpy()
        dst = rng.choice(np.setdiff1d(np.arange(NUM_BLOCKS), src), NUM_COPIED, replace=False)
        pages[:, torch.as_tensor(dst, device="cuda")] = POISON
        torch.cuda.synchronize()
        # 3. A fenced LOAD: answered once issued; the stream waits on each layer's event.
        loaded = client.wait(client.submit_load(7, dst, hashes, lease_id=found.lease_id,
                                                event_index=0))
        assert loaded.is_ok
        stream = torch.cuda.current_stream()
        for layer in range(NUM_LAYERS):
            events.wait([layer], stream.cuda_stream)
        got = pages[:, torch.as_tensor(dst, device="cuda")].cpu().numpy()
        assert np.array_equal(got, expected)
    finally:
        client.close()
        events.close()


def _held_saver_main(conn, engine_name: str) -> None:
    """A client of ``engine_name`` whose SAVE the engine holds (--hold-saves): its GPU is busy
    for about a minute before the event the SAVE waits on; it says so, then waits to be killed."""
    from pegaflow.client.connection import EngineClient
    torch.cuda.set_device(0)
    raw = torch.zeros(NUM_LAYERS * LAYER_BYTES, dtype=torch.uint8, device="cuda")
    events = EventPool(NUM_EVENTS)
    torch.cuda.synchronize()
    client = EngineClient.connect(engine_name, timeout_s=TIMEOUT_S)
    client.register_region(0, region_record(export_allocation(raw.data_ptr()), NUM_LAYERS, NUM_BLOCKS, PAGE_BYTES),
                           layer_major_records(NUM_LAYERS, NUM_BLOCKS, PAGE_BYTES))
    client.register_events(events.handles())
    torch.cuda._sleep(300 * SLEEP_CYCLES)  # ~60 s of GPU time, then the data's event
    events.record([5], torch.cuda.current_stream().cuda_stream)
    client.submit_save(7, list(range(4)), [bytes([65 + i]) * 32 for i in range(4)], layer=2, event_index=5)
    conn.send("submitted")
    conn.recv()


@pytest.mark.gpu
def test_engine_process_client_killed_while_its_save_is_held_is_reclaimed(engine_factory):
    # 1. An engine with --hold-saves; a client process submits a SAVE whose data its GPU has
    #    not written yet (a minute of work before the event): the engine holds it.
    engine = engine_factory(pool_size="64MiB", slab_size="1MiB", extra=("--backend", "cuda", "--hold-saves"))
    conn, proc = start_child(_held_saver_main, engine.name)
    try:
        assert conn.poll(TIMEOUT_S) and conn.recv() == "submitted"
        engine.wait_stats(lambda s: s["clients_attached"] == 1 and s["inflight_copies"] == 1)
        # 2. The client is killed: its event will never fire.
        proc.kill()
        proc.join(TIMEOUT_S)
        # 3. The engine ends the held SAVE and reclaims the slot (its housekeeping, every
        #    second while blocks are half written), long before the event would have come,
        #    whatever the driver does with the dead client's event and memory (their release
        #    runs off the engine's thread: engine/copy/releases.py).  The SAVE is answered
        #    COPY_FAILED and stores nothing: its bytes were never written.
        stats = engine.wait_stats(lambda s: s["clients_attached"] == 0 and s["inflight_copies"] == 0)
        assert stats["errors_by_status"][Status.COPY_FAILED] == 1 and stats["blocks_saved"] == 0
    finally:
        if proc.is_alive():
            proc.kill()
    # 4. It serves on: a new client attaches and is answered.
    client = engine.connect()
    try:
        assert client.ping() == 0
    finally:
        client.close()
