"""engine.copy.cuda_layers.LayerCopier on the CPU stand-in for the GPU of ``test_staged``:
an op's layers on their streams, byte for byte under random orders, the depth rule, and its
events given back."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from engine.copy import cuda_layers
from engine.copy.base import COPY_ENGINE, KERNEL, Direction
from engine.copy.checks import Region
from engine.copy.cuda_layers import Inflight, LayerCopier
from tests.engine.copy.test_staged import CLIENT, NUM_LAYERS, POOL, SEEDS, FakeGpu, _client, _op, _pool

DEPTH = 2


@pytest.fixture
def gpu(monkeypatch):
    fake = FakeGpu()
    monkeypatch.setattr(cuda_layers, "driver", fake)
    return fake


def _device(gpu: FakeGpu):
    """What LayerCopier reads of a ``cuda_device.Device``: a stream per layer and direction,
    events, the save chains, the pool's base."""
    counter = iter(range(1 << 20))
    return SimpleNamespace(stream=lambda layer, direction: f"{direction.name}{layer}",
                           event=lambda: f"ev{next(counter)}", save_chains={KERNEL: [], COPY_ENGINE: []},
                           pool_base=POOL, kernel=gpu, staging=None, idle_events=[])


def _issue(gpu, dev, op, events=()) -> Inflight:
    inflight = Inflight(op.token, op.slot, 0, None)
    regions = [Region(0, b"", CLIENT, 1 << 20)] * len(op.layers)
    LayerCopier(None, DEPTH, DEPTH).issue(dev, op, regions, COPY_ENGINE, inflight, list(events))
    return inflight


@pytest.mark.parametrize("seed", SEEDS)
def test_layer_copier_load_lands_every_layer_and_records_its_event_after_it(gpu, seed):
    # 1. Pool entries 5, 9, 2 hold known bytes; a LOAD of them into blocks 3, 0, 7 that
    #    records the client's event 4 + k after layer k; the client reads each layer after its event.
    gpu.mem[POOL:POOL + (1 << 13)] = np.random.default_rng(seed).integers(0, 255, 1 << 13, np.uint8)
    events = [f"client{i}" for i in range(4 + NUM_LAYERS)]
    dev = _device(gpu)
    op = _op(Direction.LOAD, [3, 0, 7], [5, 9, 2], record_events=4)
    inflight = _issue(gpu, dev, op, events)
    seen = {}
    for layer in range(NUM_LAYERS):
        gpu.wait("client stream", events[4 + layer])
        gpu.enqueue("client stream", lambda k=layer: seen.__setitem__(k, _client(gpu)[k, [3, 0, 7]].copy()))
    gpu.run(seed)
    # 2. Whatever order the streams ran in, each layer was whole when its event fired.
    for layer in range(NUM_LAYERS):
        assert np.array_equal(seen[layer], _pool(gpu)[[5, 9, 2], layer]), layer
    assert inflight.done == inflight.events[-1] and len(inflight.streams) == NUM_LAYERS


def test_layer_copier_layer_waits_for_the_one_depth_before_it(gpu):
    # 1. A LOAD over 4 layers at depth 2: layer k's stream waits for layer k - 2's end.
    dev = _device(gpu)
    inflight = _issue(gpu, dev, _op(Direction.LOAD, [1], [1]))
    waits = [(stream, event) for kind, stream, event in (c for c in gpu.calls if c[0] == "wait")]
    assert waits[:2] == [("LOAD2", inflight.events[0]), ("LOAD3", inflight.events[1])]
    # 2. The last stream waits for the other layers still in flight before recording done.
    assert ("LOAD3", inflight.events[2]) in waits


def test_layer_copier_saves_join_the_path_chain_and_release_gives_events_back(gpu):
    # 1. Two SAVEs in a row: the second's first layer waits on the first's layers at depth.
    dev = _device(gpu)
    first = _issue(gpu, dev, _op(Direction.SAVE, [1], [1]))
    assert dev.save_chains[COPY_ENGINE] == first.events[NUM_LAYERS - DEPTH:NUM_LAYERS]  # its last layers
    gpu.calls.clear()
    second = _issue(gpu, dev, _op(Direction.SAVE, [2], [2]))
    assert ("wait", "SAVE0", first.events[NUM_LAYERS - DEPTH]) in gpu.calls
    # 2. The first released: its events go back and leave the chain; the second's stay.
    LayerCopier(None, DEPTH, DEPTH).release(dev, first)
    assert first.events == [] and len(dev.idle_events) == NUM_LAYERS + 1
    assert dev.save_chains[COPY_ENGINE] == second.events[NUM_LAYERS - DEPTH:NUM_LAYERS]
