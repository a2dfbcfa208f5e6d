"""The staged path's planning and address arithmetic, on a CPU stand-in for the GPU.

The stand-in driver and kernel execute every copy at once on one byte array (addresses
are offsets into it), so a SAVE and a LOAD through ``staged.issue`` are checked byte for
byte; stream order is the GPU tests' part (tests/engine/copy/test_cuda_backend.py).
"""

from __future__ import annotations

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
POISON = 0xAB


class FakeGpu:
    """Memory, driver calls and the copy kernel, executed in call order."""

    def __init__(self) -> None:
        self.mem = np.zeros(1 << 18, np.uint8)
        self.heap = HEAP
        self.calls: list[tuple] = []
        self.num_streams = 0

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

    def record(self, event, stream) -> None:
        self.calls.append(("record", event, stream))

    def memcpy_async(self, dst: int, src: int, size: int, stream) -> None:
        self.calls.append(("copy", stream, 1))
        self.mem[dst:dst + size] = self.mem[src:src + size]

    def memcpy_batch_async(self, dsts, srcs, sizes, stream) -> None:
        self.calls.append(("copy", stream, len(dsts)))
        for dst, src, size in zip(dsts.tolist(), srcs.tolist(), np.asarray(sizes).tolist()):
            self.mem[dst:dst + size] = self.mem[src:src + size]

    # the kernel (kernels.SOURCE's arithmetic)
    def launch(self, stream, ids_ptr, offsets_ptr, num_pages, client_base, client_stride,
               pool_base, page_bytes, to_pool, num_layers=1, client_layer_stride=0,
               pool_layer_stride=0) -> None:
        self.calls.append(("launch", stream, num_layers))
        ids = self.mem[ids_ptr:ids_ptr + 8 * num_pages].view(np.int64)
        offsets = self.mem[offsets_ptr:offsets_ptr + 8 * num_pages].view(np.int64)
        for layer in range(num_layers):
            for block, offset in zip(ids.tolist(), offsets.tolist()):
                c = client_base + block * client_stride + layer * client_layer_stride
                p = pool_base + offset + layer * pool_layer_stride
                src, dst = (c, p) if to_pool else (p, c)
                self.mem[dst:dst + page_bytes] = self.mem[src:src + page_bytes]


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


def _issue(gpu: FakeGpu, staging, op: CopyOp, regions=None, events=()) -> Inflight:
    """``staged.issue`` as the backend calls it: ids and local offsets in memory first."""
    n, step = len(op.block_ids), staged.run_bytes(op)
    per_slot = staging.slot_bytes // step
    words = np.concatenate([op.block_ids, np.arange(min(per_slot, n)) * step]).astype(np.int64)
    gpu.mem[WORDS:WORDS + 8 * len(words)] = words.view(np.uint8)
    regions = regions or [Region(0, b"", CLIENT, NUM_LAYERS * LAYER_BYTES)] * len(op.layers)
    counter = iter(range(1 << 20))
    inflight = Inflight()
    staged.issue(staging, gpu, op, regions, POOL, WORDS, WORDS + 8 * n, list(events),
                 lambda: f"ev{next(counter)}", inflight)
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


def test_can_stage_only_unfenced_consecutive_layers_fitting_a_slot():
    assert staged.can_stage(_op(Direction.SAVE, [1], [0]), ENTRY)
    assert staged.can_stage(_op(Direction.LOAD, [1], [0], layers=[1, 2]), ENTRY)
    assert not staged.can_stage(_op(Direction.LOAD, [1], [0], record_events=0), ENTRY)
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


@pytest.mark.parametrize("uniform", [True, False], ids=["one-launch", "per-layer"])
@pytest.mark.parametrize("slot_entries", [1, 3, 8])
def test_save_then_load_through_slots_byte_exact(gpu, uniform, slot_entries):
    rng = np.random.default_rng(slot_entries)
    gpu.mem[CLIENT:CLIENT + NUM_LAYERS * LAYER_BYTES] = rng.integers(0, 256, NUM_LAYERS * LAYER_BYTES)
    before = _client(gpu).copy()
    _pool(gpu)[:] = POISON
    staging = staged.DeviceStaging(2 * staged.SLOTS_PER_DIRECTION * slot_entries * ENTRY)
    assert staging.slot_bytes == slot_entries * ENTRY
    regions = None
    if not uniform:  # layer 2 lives in another allocation (same bytes copied there)
        other = 3 * LAYER_BYTES + 2 * LAYER_BYTES + 512
        gpu.mem[other:other + LAYER_BYTES] = gpu.mem[2 * LAYER_BYTES:3 * LAYER_BYTES]
        regions = [Region(0, b"", CLIENT + (other - 2 * LAYER_BYTES if i == 2 else 0), 1 << 16)
                   for i in range(NUM_LAYERS)]
    # 1. SAVE 7 blocks into entries with runs of 3, 1, 2, 1 consecutive entries.
    src = rng.choice(NUM_BLOCKS, 7, replace=False)
    entries = np.array([2, 3, 4, 9, 12, 13, 20])
    _issue(gpu, staging, _op(Direction.SAVE, src, entries), regions)
    pool = _pool(gpu)
    assert np.array_equal(pool[entries], before[:, src].transpose(1, 0, 2))
    assert (np.delete(pool, entries, axis=0) == POISON).all()
    # 2. LOAD them into other, poisoned blocks: exactly those change.
    dst = rng.choice(np.setdiff1d(np.arange(NUM_BLOCKS), src), 7, replace=False)
    _client(gpu)[:, dst] = POISON
    if not uniform:
        gpu.mem[other:other + LAYER_BYTES].reshape(NUM_BLOCKS, PAGE)[dst] = POISON
    _issue(gpu, staging, _op(Direction.LOAD, dst, entries), regions)
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
    staging = staged.DeviceStaging(2 * staged.SLOTS_PER_DIRECTION * 4 * ENTRY)
    src, entries = np.array([3, 7, 11]), np.array([5, 6, 7])  # consecutive entries
    _issue(gpu, staging, _op(Direction.SAVE, src, entries, layers=[1, 2]))
    pool = _pool(gpu)
    assert np.array_equal(pool[entries][:, 1:3], before[1:3][:, src].transpose(1, 0, 2))
    assert (pool[entries][:, [0, 3]] == POISON).all()
    copies = [c for c in gpu.calls if c[0] == "copy"]
    assert sum(c[2] for c in copies) == 3  # a run per entry: their pages do not touch


def test_save_waits_each_layers_event_before_its_first_gather_then_one_launch(gpu):
    staging = staged.DeviceStaging(2 * staged.SLOTS_PER_DIRECTION * 2 * ENTRY)
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
    staging = staged.DeviceStaging(2 * staged.SLOTS_PER_DIRECTION * ENTRY)
    side = staging.sides[Direction.LOAD]
    inflight = _issue(gpu, staging, _op(Direction.LOAD, [1, 2, 3], [0, 5, 9]))
    # three sub-chunks over two slots: the third waits (on the copy stream) for the first's end
    waits = [c for c in gpu.calls if c[0] == "wait" and c[1] == side.copy_stream]
    first_free = [c for c in gpu.calls if c[0] == "record" and c[2] == side.gather_stream][0][1]
    assert waits == [("wait", side.copy_stream, first_free)]
    assert all(e is not None for e in side.free_events)
    staging.forget({id(e) for e in inflight.events})
    assert side.free_events == [None, None]


@pytest.mark.parametrize("copy_backend,page_bytes,fenced,expected", [
    ("auto", 64 << 10, False, "staged"),
    ("auto", 256 << 10, False, "staged"),
    ("auto", 1 << 20, False, "copy-engine"),   # big pages: page by page (probe's choice)
    ("auto", 64 << 10, True, "kernel"),        # a fenced load: the kernel, layer by layer
    ("staged", 1 << 20, False, "staged"),      # asked for: staged whatever the page size
    ("staged", 64 << 10, True, "copy-engine"),  # asked for but impossible: the copy engine
])
def test_cuda_backend_path_stages_what_it_should(copy_backend, page_bytes, fenced, expected):
    from engine.copy.cuda import CudaBackend
    backend = CudaBackend.__new__(CudaBackend)  # no GPU: only the choice is exercised
    backend.copy_backend = copy_backend
    staging = staged.DeviceStaging.__new__(staged.DeviceStaging)
    staging.slot_bytes = 64 << 20
    dev = type("Dev", (), {"staging": staging, "pool_base": 1 << 40,
                           "paths": {(page_bytes, Direction.LOAD): "copy-engine"}})()
    op = CopyOp(1, Direction.LOAD, 0, [LayerPlacement(i, 0, i * (page_bytes << 8), page_bytes)
                                       for i in range(NUM_LAYERS)], page_bytes,
                np.array([3]), np.array([0]), record_events=0 if fenced else None)
    regions = [Region(0, b"", 1 << 30, 1 << 40)] * NUM_LAYERS
    assert backend._path(dev, op, regions) == expected
