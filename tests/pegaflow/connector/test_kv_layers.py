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
