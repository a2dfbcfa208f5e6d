"""pegaflow.connector.kv_layers: the event numbering every side of a step relies on."""

from __future__ import annotations

from pegaflow.connector.kv_layers import SAVE_EVENT, KVLayers


def test_kv_layers_event_ranges_are_disjoint_and_the_pool_holds_them_all():
    # Saves, each load slot and the start fence never share an event: a LOAD recording
    # into a SAVE's event would let the engine copy a layer before vLLM wrote it.
    layers = KVLayers(num_load_slots=3, num_virtual=5)
    save = set(range(SAVE_EVENT, SAVE_EVENT + 5))
    slots = [set(range(layers.load_event_base(s), layers.load_event_base(s) + 5)) for s in range(3)]
    fence = {layers.start_fence_event}
    every = [save, *slots, fence]
    assert sum(map(len, every)) == len(set().union(*every)) == layers.num_events == 21
    assert max(set().union(*every)) == layers.num_events - 1


def test_kv_layers_groups_overlaying_one_tensor_get_engine_layers_of_their_own():
    # Two KV cache groups whose layers share tensors (vLLM's hybrid layout), and a third
    # group (a drafter's, left out) with no layer here.
    import numpy as np

    from pegaflow.connector.layout import TensorInfo

    class Memory:
        def region_of(self, info):
            return "buf", info.data_ptr - 4096, np.zeros(1, dtype=[("num_layers", "u4"), ("num_blocks", "u4"),
                                                                    ("page_bytes", "u4")])

    def tensor(name, offset):
        return TensorInfo(name, 4096 + offset, (8, 2, 16, 128), (4096, 128, 256, 1), 2)

    tensors = {"l0": tensor("l0", 0), "l1": tensor("l1", 0), "l2": tensor("l2", 8 * 8192)}
    layers = KVLayers.of(tensors, Memory(), 8, 2, groups={"l0": 0, "l1": 1, "l2": 0})
    # 1. l1 overlays l0's memory but is another group's layer: its own engine layers.
    assert set(layers.virtual["l0"]).isdisjoint(layers.virtual["l1"])
    assert layers.save_layers == {"l0", "l1", "l2"}
    # 2. Each group's engine layers are a run, numbered group after group.
    assert list(layers.layers_of(0)) == sorted(layers.virtual["l0"] + layers.virtual["l2"])
    assert layers.first_layer_of(1) == layers.virtual["l1"][0] == len(layers.layers_of(0))
    # 3. A group with no layer here has none (its loads and saves are skipped, no error).
    assert len(layers.layers_of(2)) == 0
