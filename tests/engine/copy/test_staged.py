"""The staged path's planning, ordering and address arithmetic, on a CPU stand-in for the GPU.

The stand-in driver and kernel queue every copy, launch, event record and event wait on
its stream, as CUDA does; ``FakeGpu.run`` then executes the queues in a random order that
honours only stream order and event waits (a wait holds its stream until the record it
saw when issued is done), on one byte array (addresses are offsets into it).  So a SAVE
or LOAD through ``staged.issue`` is checked byte for byte, and a missing wait shows as
bytes read too early under some of the seeds.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import numpy as np
import pytest

from engine.copy import staged
from engine.copy.base import CopyOp, Direction, LayerPlacement
from engine.copy.checks import Region

PAGE = 64
NUM_LAYERS, NUM_BLOCKS, NUM_ENTRIES = 4, 16, 24
LAYER_BYTES = NUM_BLOCKS * PAGE
ENTRY = NUM_LAYERS * PAGE
CLIENT, POOL, WORDS, HEAP = 0, 1 << 14, 1 << 15, 1 << 16
POISON, NEW_BYTE = 0xAB, 0x5A
SEEDS = range(8)


class FakeGpu:
    """Memory, streams, events and the copy kernel; work runs in ``run``."""

    def __init__(self) -> None:
        self.mem = np.zeros(1 << 18, np.uint8)
        self.heap = HEAP
        self.calls: list[tuple] = []  # as issued
        self.num_streams = 0
        self.queues: dict[str, collections.deque] = collections.defaultdict(collections.deque)
        self.recorded: dict[object, int] = {}  # event -> records issued
        self.reached: dict[object, int] = {}   # event -> records executed

    # driver
    def device_alloc(self, size: int) -> int:
        address, self.heap = self.heap, self.heap + size
        assert self.heap <= len(self.mem)
        return address

    def device_free(self, address: int) -> None:
        self.calls.append(("free", address))

    def create_stream(self, low_priority: bool = True) -> str:
        self.num_streams += 1
        return f"stream{self.num_streams}"

    def destroy_stream(self, stream) -> None:
        pass

    def wait(self, stream, event) -> None:
        self.calls.append(("wait", stream, event))
        self.queues[stream].append(("wait", event, self.recorded.get(event, 0)))

    def record(self, event, stream) -> None:
        self.calls.append(("record", event, stream))
        self.recorded[event] = self.recorded.get(event, 0) + 1
        self.queues[stream].append(("record", event, self.recorded[event]))

    def enqueue(self, stream, work) -> None:
        self.queues[stream].append(("work", work, 0))

    def memcpy_async(self, dst: int, src: int, size: int, stream) -> None:
        self.calls.append(("copy", stream, 1))
        self.enqueue(stream, lambda: self._move(dst, src, size))

    def memcpy_batch_async(self, dsts, srcs, sizes, stream) -> None:
        self.calls.append(("copy", stream, len(dsts)))
        moves = list(zip(dsts.tolist(), srcs.tolist(), np.broadcast_to(sizes, dsts.shape).tolist()))
        self.enqueue(stream, lambda: [self._move(*m) for m in moves])

    def _move(self, dst: int, src: int, size: int) -> None:
        self.mem[dst:dst + size] = self.mem[src:src + size].copy()

    # the kernel (kernels.SOURCE's arithmetic)
    def launch(self, stream, ids_ptr, offsets_ptr, num_pages, client_base, client_stride,
               pool_base, page_bytes, to_pool, num_layers=1, client_layer_stride=0,
               pool_layer_stride=0) -> None:
        self.calls.append(("launch", stream, num_layers))

        def kernel():  # reads its id lists when it runs, as the GPU does
            ids = self.mem[ids_ptr:ids_ptr + 8 * num_pages].view(np.int64)
            offsets = self.mem[offsets_ptr:offsets_ptr + 8 * num_pages].view(np.int64)
            for layer in range(num_layers):
                for block, offset in zip(ids.tolist(), offsets.tolist()):
                    c = client_base + block * client_stride + layer * client_layer_stride
                    p = pool_base + offset + layer * pool_layer_stride
                    src, dst = (c, p) if to_pool else (p, c)
                    self._move(dst, src, page_bytes)
        self.enqueue(stream, kernel)

    def run(self, seed: int) -> None:
        """Execute every queue, picking at random among streams whose next step may run."""
        rng = np.random.default_rng(seed)
        while any(self.queues.values()):
            ready = [s for s, q in self.queues.items()
                     if q and (q[0][0] != "wait" or self.reached.get(q[0][1], 0) >= q[0][2])]
            assert ready, "deadlock: every stream waits on an event never recorded"
            kind, what, version = self.queues[ready[rng.integers(len(ready))]].popleft()
            if kind == "work":
                what()
            elif kind == "record":
                self.reached[what] = max(self.reached.get(what, 0), version)


@dataclass
class Inflight:
    streams: list = field(default_factory=list)
    events: list = field(default_factory=list)
    done: object = None


@pytest.fixture
def gpu(monkeypatch):
    fake = FakeGpu()
    monkeypatch.setattr(staged, "driver", fake)
    return fake


def _op(direction, block_ids, entry_ids, layers=range(NUM_LAYERS), **kw) -> CopyOp:
    placements = [LayerPlacement(i, 0, i * LAYER_BYTES, PAGE) for i in layers]
    return CopyOp(1, direction, 0, placements, PAGE, np.asarray(block_ids, np.int64),
                  np.asarray(entry_ids, np.int64) * ENTRY, **kw)


def _issue(gpu: FakeGpu, staging, op: CopyOp, regions=None, events=(), seed: int = 0,
           then=None) -> Inflight:
    """``staged.issue`` as the backend calls it (ids and local offsets in memory first),
    then ``then()`` (the client's own work queued after it), then the GPU runs it all
    under ``seed``'s order."""
    words = np.concatenate([op.block_ids, staged.local_offsets(op, staging.buffer_bytes, staging.groups_of(op))])
    gpu.mem[WORDS:WORDS + 8 * len(words)] = words.astype(np.int64).view(np.uint8)
    regions = regions or [Region(0, b"", CLIENT, NUM_LAYERS * LAYER_BYTES)] * len(op.layers)
    counter = iter(range(1 << 20))
    inflight = Inflight()
    staged.issue(staging, gpu, op, regions, POOL, WORDS, list(events),
                 lambda: f"ev{next(counter)}", inflight)
    if then is not None:
        then()
    gpu.run(seed)
    return inflight


def _client(gpu):
    return gpu.mem[CLIENT:CLIENT + NUM_LAYERS * LAYER_BYTES].reshape(NUM_LAYERS, NUM_BLOCKS, PAGE)


def _pool(gpu):
    return gpu.mem[POOL:POOL + NUM_ENTRIES * ENTRY].reshape(NUM_ENTRIES, NUM_LAYERS, PAGE)


def test_entry_runs_cut_where_entries_stop_following():
    starts, counts = staged.entry_runs(np.array([0, 8, 16, 40, 48, 80]), 8)
    assert starts.tolist() == [0, 3, 5] and counts.tolist() == [3, 2, 1]
    starts, counts = staged.entry_runs(np.array([24]), 8)
    assert starts.tolist() == [0] and counts.tolist() == [1]


def test_entry_runs_never_span_two_pinned_chunks():
    # 1. Entries of 8 bytes following one another across the 32-byte chunk boundaries: one
    #    run without a split, one per chunk with it.
    offsets = np.arange(16, 80, 8)
    assert staged.entry_runs(offsets, 8)[1].tolist() == [8]
    starts, counts = staged.entry_runs(offsets, 8, split_bytes=32)
    assert starts.tolist() == [0, 2, 6] and counts.tolist() == [2, 4, 2]


def test_can_stage_consecutive_layers_fitting_a_slot_and_fenced_loads_only_when_asked():
    assert staged.can_stage(_op(Direction.SAVE, [1], [0]), ENTRY)
    assert staged.can_stage(_op(Direction.LOAD, [1], [0], layers=[1, 2]), ENTRY)
    assert not staged.can_stage(_op(Direction.LOAD, [1], [0], record_events=0), ENTRY)
    assert staged.can_stage(_op(Direction.LOAD, [1], [0], record_events=0), ENTRY, allow_fenced=True)
    assert not staged.can_stage(_op(Direction.SAVE, [1], [0], layers=[2]), ENTRY)
    assert not staged.can_stage(_op(Direction.SAVE, [1], [0], layers=[0, 2]), ENTRY)
    assert not staged.can_stage(_op(Direction.SAVE, [1], [0], layers=[1, 0]), ENTRY)
    assert not staged.can_stage(_op(Direction.SAVE, [1], [0]), ENTRY - 1)


def test_uniform_layers_needs_one_step_and_one_block_stride():
    op = _op(Direction.SAVE, [1], [0])
    one = [Region(0, b"", 1000, 1 << 20)] * NUM_LAYERS
    assert staged.uniform_layers(op, one) == LAYER_BYTES
    apart = [Region(0, b"", 1000 + (5000 if i == 2 else 0), 1 << 20) for i in range(NUM_LAYERS)]
    assert staged.uniform_layers(op, apart) is None
    op.layers[3] = LayerPlacement(3, 0, 3 * LAYER_BYTES, 2 * PAGE)
    assert staged.uniform_layers(op, one) is None


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("uniform", [True, False], ids=["one-launch", "per-layer"])
@pytest.mark.parametrize("slot_entries", [1, 3, 8])
def test_save_then_load_through_slots_byte_exact(gpu, uniform, slot_entries, seed):
    rng = np.random.default_rng(slot_entries)
    gpu.mem[CLIENT:CLIENT + NUM_LAYERS * LAYER_BYTES] = rng.integers(0, 256, NUM_LAYERS * LAYER_BYTES)
    before = _client(gpu).copy()
    _pool(gpu)[:] = POISON
    staging = staged.DeviceStaging(2 * staged.BUFFERS_PER_DIRECTION * slot_entries * ENTRY)
    assert staging.buffer_bytes == slot_entries * ENTRY
    regions = None
    if not uniform:  # layer 2 lives in another allocation (same bytes copied there)
        other = 3 * LAYER_BYTES + 2 * LAYER_BYTES + 512
        gpu.mem[other:other + LAYER_BYTES] = gpu.mem[2 * LAYER_BYTES:3 * LAYER_BYTES]
        regions = [Region(0, b"", CLIENT + (other - 2 * LAYER_BYTES if i == 2 else 0), 1 << 16)
                   for i in range(NUM_LAYERS)]
    # 1. SAVE 7 blocks into entries with runs of 3, 1, 2, 1 consecutive entries.
    src = rng.choice(NUM_BLOCKS, 7, replace=False)
    entries = np.array([2, 3, 4, 9, 12, 13, 20])
    _issue(gpu, staging, _op(Direction.SAVE, src, entries), regions, seed=seed)
    pool = _pool(gpu)
    assert np.array_equal(pool[entries], before[:, src].transpose(1, 0, 2))
    assert (np.delete(pool, entries, axis=0) == POISON).all()
    # 2. LOAD them into other, poisoned blocks: exactly those change.
    dst = rng.choice(np.setdiff1d(np.arange(NUM_BLOCKS), src), 7, replace=False)
    _client(gpu)[:, dst] = POISON
    if not uniform:
        gpu.mem[other:other + LAYER_BYTES].reshape(NUM_BLOCKS, PAGE)[dst] = POISON
    _issue(gpu, staging, _op(Direction.LOAD, dst, entries), regions, seed=seed)
    after = _client(gpu)
    if not uniform:
        after = after.copy()
        after[2] = gpu.mem[other:other + LAYER_BYTES].reshape(NUM_BLOCKS, PAGE)
    assert np.array_equal(after[:, dst], before[:, src])
    assert np.array_equal(np.delete(after, dst, axis=1), np.delete(before, dst, axis=1))


def test_save_of_some_layers_leaves_the_entries_other_layers(gpu):
    rng = np.random.default_rng(5)
    gpu.mem[CLIENT:CLIENT + NUM_LAYERS * LAYER_BYTES] = rng.integers(0, 256, NUM_LAYERS * LAYER_BYTES)
    before = _client(gpu).copy()
    _pool(gpu)[:] = POISON
    staging = staged.DeviceStaging(2 * staged.BUFFERS_PER_DIRECTION * 4 * ENTRY)
    src, entries = np.array([3, 7, 11]), np.array([5, 6, 7])  # consecutive entries
    _issue(gpu, staging, _op(Direction.SAVE, src, entries, layers=[1, 2]))
    pool = _pool(gpu)
    assert np.array_equal(pool[entries][:, 1:3], before[1:3][:, src].transpose(1, 0, 2))
    assert (pool[entries][:, [0, 3]] == POISON).all()
    copies = [c for c in gpu.calls if c[0] == "copy"]
    assert sum(c[2] for c in copies) == 3  # a run per entry: their pages do not touch


def test_save_waits_each_layers_event_before_its_first_gather_then_one_launch(gpu):
    staging = staged.DeviceStaging(2 * staged.BUFFERS_PER_DIRECTION * 2 * ENTRY)
    events = [f"client{i}" for i in range(8)]
    op = _op(Direction.SAVE, [1, 2, 3, 4, 5], [0, 1, 2, 3, 4], wait_event=3, wait_per_layer=True)
    inflight = _issue(gpu, staging, op, events=events)
    side = staging.sides[Direction.SAVE]
    gather = [c for c in gpu.calls if c[1] == side.gather_stream]
    # sub-chunk 1: wait(client 3+k) then layer k's gather, per layer; sub-chunks 2, 3: one launch
    first = gather[:2 * NUM_LAYERS]
    assert first == [x for k in range(NUM_LAYERS)
                     for x in (("wait", side.gather_stream, events[3 + k]),
                               ("launch", side.gather_stream, 1))]
    launches = [c for c in gpu.calls if c[0] == "launch"]
    assert [c[2] for c in launches] == [1] * NUM_LAYERS + [NUM_LAYERS, NUM_LAYERS]
    # each sub-chunk's copy waits for its gather; the op is done with the last copy
    assert inflight.done == gpu.calls[-1][1] and gpu.calls[-1][2] == side.copy_stream
    assert set(inflight.streams) == {side.gather_stream, side.copy_stream}
    assert inflight.done in inflight.events


def test_slot_reuse_waits_for_its_last_use_and_forget_frees_it(gpu):
    staging = staged.DeviceStaging(2 * staged.BUFFERS_PER_DIRECTION * ENTRY)
    side = staging.sides[Direction.LOAD]
    inflight = _issue(gpu, staging, _op(Direction.LOAD, [1, 2, 3], [0, 5, 9]))
    # three sub-chunks over two slots: the third waits (on the copy stream) for the first's end
    waits = [c for c in gpu.calls if c[0] == "wait" and c[1] == side.copy_stream]
    first_free = [c for c in gpu.calls if c[0] == "record" and c[2] == side.gather_stream][0][1]
    assert waits == [("wait", side.copy_stream, first_free)]
    # a LOAD is done with its last scatter, on the gather stream
    last = [c for c in gpu.calls if c[0] == "record" and c[2] == side.gather_stream][-1][1]
    assert inflight.done == last
    # forget frees only the finished op's slots: another op's last uses stay waited on
    other = _issue(gpu, staging, _op(Direction.LOAD, [4], [11]))
    kept = [e for e in side.free_events if e in other.events]
    assert len(kept) == 1 and all(e is not None for e in side.free_events)
    staging.forget({id(e) for e in inflight.events})
    assert [e for e in side.free_events if e is not None] == kept
    staging.forget({id(e) for e in other.events})
    assert side.free_events == [None, None]


def _client_late(gpu: FakeGpu, event: str, write) -> None:
    """The client's stream: ``write`` (GPU work still running), then ``event`` recorded."""
    gpu.enqueue("client", write)
    gpu.record(event, "client")


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("per_layer", [False, True], ids=["one-event", "event-per-layer"])
def test_save_reads_client_pages_only_after_their_event(gpu, seed, per_layer):
    # 1. The client is still writing layer 2 of every block when the SAVE is issued; its
    #    event (one for the op, or layer 2's) is recorded after that write.
    gpu.mem[CLIENT:CLIENT + NUM_LAYERS * LAYER_BYTES] = 7
    events = [f"client{i}" for i in range(8)]
    waited = events[3 + 2] if per_layer else events[5]
    _client_late(gpu, waited, lambda: _client(gpu).__setitem__(2, NEW_BYTE))
    staging = staged.DeviceStaging(2 * staged.BUFFERS_PER_DIRECTION * 2 * ENTRY)
    src, entries = np.array([1, 4, 9, 12, 15]), np.array([0, 1, 2, 5, 6])
    op = _op(Direction.SAVE, src, entries, wait_event=3 if per_layer else 5,
             wait_per_layer=per_layer)
    _issue(gpu, staging, op, events=events, seed=seed)
    # 2. Whatever the order the GPU ran things in, the pool holds the new layer 2.
    assert (_pool(gpu)[entries, 2] == NEW_BYTE).all()
    assert (_pool(gpu)[entries][:, [0, 1, 3]] == 7).all()


@pytest.mark.parametrize("seed", SEEDS)
def test_load_writes_client_pages_only_after_its_event(gpu, seed):
    # 1. The client still uses the destination blocks (it poisons them) until its event.
    gpu.mem[POOL:POOL + NUM_ENTRIES * ENTRY] = np.arange(NUM_ENTRIES * ENTRY) % 251
    dst, entries = np.array([2, 3, 8, 10, 11]), np.array([4, 5, 6, 9, 20])
    def still_in_use():
        _client(gpu)[:, dst] = POISON

    _client_late(gpu, "client1", still_in_use)
    staging = staged.DeviceStaging(2 * staged.BUFFERS_PER_DIRECTION * 2 * ENTRY)
    _issue(gpu, staging, _op(Direction.LOAD, dst, entries, wait_event=1),
           events=[f"client{i}" for i in range(4)], seed=seed)
    # 2. The loaded bytes land after the client's last use, never under it.
    assert np.array_equal(_client(gpu)[:, dst], _pool(gpu)[entries].transpose(1, 0, 2))


@pytest.mark.parametrize("seed", SEEDS)
def test_fenced_load_records_each_layer_event_after_every_sub_chunk_landed(gpu, seed):
    # 1. A fenced LOAD of every layer over three sub-chunks (two entries a slot); the
    #    client's stream waits on layer k's event, then reads layer k of every block.
    gpu.mem[POOL:POOL + NUM_ENTRIES * ENTRY] = np.arange(NUM_ENTRIES * ENTRY) % 251
    dst, entries = np.array([2, 3, 8, 10, 11]), np.array([4, 5, 6, 9, 20])
    _client(gpu)[:, dst] = POISON
    staging = staged.DeviceStaging(2 * staged.BUFFERS_PER_DIRECTION * 2 * ENTRY)
    events, seen = [f"client{i}" for i in range(2 + NUM_LAYERS)], {}

    def client_reads_each_layer_after_its_event():
        for layer in range(NUM_LAYERS):
            gpu.wait("client stream", events[2 + layer])
            gpu.enqueue("client stream", lambda k=layer: seen.__setitem__(k, _client(gpu)[k, dst].copy()))
    _issue(gpu, staging, _op(Direction.LOAD, dst, entries, record_events=2), events=events, seed=seed,
           then=client_reads_each_layer_after_its_event)
    # 2. Whatever order the GPU ran things in, each layer's event meant all of it was in.
    for layer in range(NUM_LAYERS):
        assert np.array_equal(seen[layer], _pool(gpu)[entries, layer]), layer


def test_groups_of_splits_only_a_fenced_load_and_evenly():
    staging = object.__new__(staged.DeviceStaging)
    staging.load_groups = 3
    fenced = _op(Direction.LOAD, [1], [1], record_events=2)
    assert staging.groups_of(fenced) == [range(0, 1), range(1, 3), range(3, 4)]  # 4 layers, 3 groups
    assert staging.groups_of(_op(Direction.LOAD, [1], [1])) == [range(NUM_LAYERS)]  # not fenced
    assert staging.groups_of(_op(Direction.SAVE, [1], [1], wait_event=0)) == [range(NUM_LAYERS)]
    staging.load_groups = 9  # at most one layer a group
    assert staging.groups_of(fenced) == [range(k, k + 1) for k in range(NUM_LAYERS)]
    assert staged.slot_bytes(fenced, [range(0, 1), range(1, 4)]) == 3 * PAGE


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("groups", [2, 3, NUM_LAYERS])
@pytest.mark.parametrize("uniform", [True, False], ids=["one-launch", "per-layer"])
def test_fenced_load_in_layer_groups_each_layer_ready_once_its_group_landed(gpu, seed, groups, uniform):
    # 1. A fenced LOAD of every layer, in layer groups, over three sub-chunks a group (two
    #    entries a slot of a whole entry's size); the client's stream waits on layer k's event,
    #    then reads layer k of every block (layer 2 elsewhere unless uniform).
    gpu.mem[POOL:POOL + NUM_ENTRIES * ENTRY] = np.arange(NUM_ENTRIES * ENTRY) % 251
    dst, entries = np.array([2, 3, 8, 10, 11]), np.array([4, 5, 6, 9, 20])
    _client(gpu)[:, dst] = POISON
    regions, other = None, 3 * LAYER_BYTES + 2 * LAYER_BYTES + 512
    if not uniform:
        regions = [Region(0, b"", CLIENT + (other - 2 * LAYER_BYTES if i == 2 else 0), 1 << 16)
                   for i in range(NUM_LAYERS)]

    def layer_now(k):
        if k == 2 and not uniform:
            return gpu.mem[other:other + LAYER_BYTES].reshape(NUM_BLOCKS, PAGE)[dst].copy()
        return _client(gpu)[k, dst].copy()
    staging = staged.DeviceStaging(2 * staged.BUFFERS_PER_DIRECTION * 2 * ENTRY, load_groups=groups)
    events, seen = [f"client{i}" for i in range(2 + NUM_LAYERS)], {}

    def client_reads_each_layer_after_its_event():
        for layer in range(NUM_LAYERS):
            gpu.wait("client stream", events[2 + layer])
            gpu.enqueue("client stream", lambda k=layer: seen.__setitem__(k, layer_now(k)))
    _issue(gpu, staging, _op(Direction.LOAD, dst, entries, record_events=2), regions, events=events, seed=seed,
           then=client_reads_each_layer_after_its_event)
    # 2. Whatever order the GPU ran things in, each layer's event meant all of it was in.
    for layer in range(NUM_LAYERS):
        assert np.array_equal(seen[layer], _pool(gpu)[entries, layer]), layer
    # 3. The first group's events were recorded before the last group's copies were issued:
    #    the forward's first layers may run while the rest is on its way.
    calls = gpu.calls
    first_ready = calls.index(("record", events[2], "stream3"))
    last_copy = max(i for i, c in enumerate(calls) if c[0] == "copy")
    assert first_ready < last_copy


def test_device_staging_failing_half_way_gives_everything_back(gpu, monkeypatch):
    # The third stream cannot be made: the two made and the memory are released, the
    # error reaches the caller (which then runs without staging).
    from pegaflow.platform.errors import CudaError
    made, destroyed = [], []
    create = gpu.create_stream

    def create_stream(low_priority=True):
        if len(made) == 2:
            raise CudaError("out of streams")
        made.append(create(low_priority))
        return made[-1]

    monkeypatch.setattr(gpu, "create_stream", create_stream)
    monkeypatch.setattr(gpu, "destroy_stream", destroyed.append)
    with pytest.raises(CudaError):
        staged.DeviceStaging(4 * ENTRY)
    assert sorted(destroyed) == sorted(made) and [c[0] for c in gpu.calls] == ["free"]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("groups", [2, NUM_LAYERS])
def test_fenced_load_in_layer_groups_records_each_layers_event_once_after_its_own_group(gpu, seed, groups):
    # 1. A fenced LOAD in layer groups; the client reads each layer on a stream of its own
    #    (as vLLM's layers may run apart), after that layer's event only.
    gpu.mem[POOL:POOL + NUM_ENTRIES * ENTRY] = np.arange(NUM_ENTRIES * ENTRY) % 251
    dst, entries = np.array([2, 3, 8, 10, 11]), np.array([4, 5, 6, 9, 20])
    _client(gpu)[:, dst] = POISON
    staging = staged.DeviceStaging(2 * staged.BUFFERS_PER_DIRECTION * 2 * ENTRY, load_groups=groups)
    events, seen = [f"client{i}" for i in range(2 + NUM_LAYERS)], {}

    def client_reads_each_layer_on_its_own_stream():
        for layer in range(NUM_LAYERS):
            gpu.wait(f"layer stream {layer}", events[2 + layer])
            gpu.enqueue(f"layer stream {layer}", lambda k=layer: seen.__setitem__(k, _client(gpu)[k, dst].copy()))
    _issue(gpu, staging, _op(Direction.LOAD, dst, entries, record_events=2), events=events, seed=seed,
           then=client_reads_each_layer_on_its_own_stream)
    # 2. Each layer's event is recorded once, in layer order: none for another group's layer.
    assert [c[1] for c in gpu.calls if c[0] == "record" and c[1] in events] == events[2:]
    # 3. Whatever order the GPU ran things in, each layer was in when its event said so.
    for layer in range(NUM_LAYERS):
        assert np.array_equal(seen[layer], _pool(gpu)[entries, layer]), layer
