"""engine/clients/registration.py: every bound of REGISTER and REGISTER_EVENTS, at its edge (taken)
and one past it (refused, nothing recorded).  A recording backend stands in for the copy
backend; the client has no ring name, so ownership (tested through a real engine in
test_foreign.py) is not checked here."""

from __future__ import annotations

import numpy as np
import pytest

from engine.clients.client import ClientState
from engine.clients.registration import MAX_LAYERS, MIN_PAGE_BYTES, register_events, register_region
from engine.memory.pool import PagePool
from pegaflow.platform.errors import CommandError, ShmError
from pegaflow.platform.protocol import DECODERS, raw_submission, record_fields
from pegaflow.platform.ring import record_type
from pegaflow.platform.wire import EVENT_HANDLE, LAYER, REGION, SUBMISSION, Opcode, RegionKind, Status

PAGE = 4096
SLAB = 1 << 20


class RecordingBackend:
    """Records what it is asked to open; refuses when told to."""

    def __init__(self, refuse: bool = False):
        self.regions, self.events, self.refuse = [], [], refuse

    def register_region(self, slot, region_id, region):
        if self.refuse:
            raise ShmError("cannot map it")
        self.regions.append((slot, region_id))

    def register_events(self, slot, handles):
        if self.refuse:
            raise ShmError("cannot open them")
        self.events.append((slot, len(handles)))


def _client() -> ClientState:
    return ClientState(0, view=None, submissions=None, completions=None)


def _payload(num_blocks: int, alloc_bytes: int, layers: list[tuple[int, int, int]], page: int = PAGE,
             base_offset: int = 0) -> np.ndarray:
    """One REGION and LAYER records of (layer, offset_bytes, block_stride_bytes)."""
    region = np.zeros(1, REGION)
    region[0]["kind"], region[0]["num_blocks"], region[0]["page_bytes"] = RegionKind.HOST_SHM, num_blocks, page
    region[0]["alloc_bytes"], region[0]["base_offset"] = alloc_bytes, base_offset
    records = np.zeros(len(layers), LAYER)
    for i, (layer, offset, stride) in enumerate(layers):
        records[i]["layer"], records[i]["offset_bytes"], records[i]["block_stride_bytes"] = layer, offset, stride
    return np.concatenate([region.view(np.uint8), records.view(np.uint8)])


def _record(opcode: Opcode, **fields):
    """A SUBMISSION of ``opcode`` with these wire fields (as the engine reads one, by place)."""
    return record_type(SUBMISSION)(0, *record_fields(1, raw_submission(opcode, **fields), 0, 0))


def _register(client, payload, num_items: int, region_id: int = 0, backend=None, slab: int = SLAB):
    rec = _record(Opcode.REGISTER, num_items=num_items, region_id=region_id)
    backend = backend or RecordingBackend()
    register_region(client, DECODERS[Opcode.REGISTER](rec, payload), backend, PagePool(4 * slab, slab))
    return backend


def _refused(client, payload, num_items: int, status: Status = Status.BAD_ARGUMENT, **kwargs) -> None:
    """REGISTER is refused with ``status``: the client's registration is unchanged and the
    backend was given no region to map."""
    before = (dict(client.layers), dict(client.region_blocks), client.page_bytes)
    backend = kwargs.pop("backend", None) or RecordingBackend()
    with pytest.raises(CommandError) as info:
        _register(client, payload, num_items, backend=backend, **kwargs)
    assert info.value.status == status
    assert (dict(client.layers), dict(client.region_blocks), client.page_bytes) == before
    assert backend.regions == []


def test_registration_last_block_ending_at_the_region_end_is_taken_one_past_refused():
    # 4 blocks of 4 KiB at a 4 KiB stride fill a 16 KiB region exactly; in 12 KiB the
    # last block would lie past the end.
    client = _client()
    _register(client, _payload(4, 4 * PAGE, [(0, 0, PAGE)]), 1)
    assert client.region_blocks == {0: 4} and client.page_bytes == PAGE and 0 in client.layers
    _refused(_client(), _payload(4, 3 * PAGE, [(0, 0, PAGE)]), 1)
    # The offset counts too: one byte further and the last page ends past the region.
    _register(_client(), _payload(4, 5 * PAGE, [(0, PAGE, PAGE)]), 1)
    _refused(_client(), _payload(4, 5 * PAGE, [(0, PAGE + 1, PAGE)]), 1)
    # So does the base offset: it takes bytes from the front of the allocation.
    _register(_client(), _payload(4, 5 * PAGE, [(0, 0, PAGE)], base_offset=PAGE), 1)
    _refused(_client(), _payload(4, 5 * PAGE, [(0, 0, PAGE)], base_offset=PAGE + 1), 1)


def test_registration_stride_below_the_page_overlaps_and_is_refused():
    _register(_client(), _payload(4, 8 * PAGE, [(0, 0, PAGE)]), 1)
    _refused(_client(), _payload(4, 8 * PAGE, [(0, 0, PAGE - 1)]), 1)


def test_registration_negative_offset_and_wrapping_stride_are_refused():
    _register(_client(), _payload(2, 2 * PAGE, [(0, 0, PAGE)]), 1)
    _refused(_client(), _payload(2, 2 * PAGE, [(0, -1, PAGE)]), 1)
    _refused(_client(), _payload(2, 2 * PAGE, [(0, 0, 2**63 - 1)]), 1)  # would wrap in 64 bits


def test_registration_page_size_bounds():
    _register(_client(), _payload(1, MIN_PAGE_BYTES, [(0, 0, MIN_PAGE_BYTES)], page=MIN_PAGE_BYTES), 1)
    _refused(_client(), _payload(1, 4 * PAGE, [(0, 0, PAGE)], page=MIN_PAGE_BYTES - 1), 1)
    # A page may be the whole region, not a byte more.
    _register(_client(), _payload(1, PAGE, [(0, 0, PAGE)]), 1)
    _refused(_client(), _payload(1, PAGE - 1, [(0, 0, PAGE)]), 1)


def test_registration_blocks_and_bytes_must_be_positive():
    _refused(_client(), _payload(0, 4 * PAGE, [(0, 0, PAGE)]), 1)
    _refused(_client(), _payload(1, PAGE, [(0, 0, PAGE)], base_offset=PAGE), 1)


def test_registration_layer_count_bounds_and_payload_size():
    layers = [(i, 0, PAGE) for i in range(MAX_LAYERS)]
    _register(_client(), _payload(1, PAGE, layers), MAX_LAYERS, slab=MAX_LAYERS * PAGE)
    _refused(_client(), _payload(1, PAGE, layers + [(MAX_LAYERS, 0, PAGE)]), MAX_LAYERS + 1,
             Status.BAD_PAYLOAD, slab=(MAX_LAYERS + 1) * PAGE)
    _refused(_client(), _payload(1, PAGE, []), 0, Status.BAD_PAYLOAD)
    payload = _payload(1, PAGE, [(0, 0, PAGE)])
    _refused(_client(), payload[:-1], 1, Status.BAD_PAYLOAD)  # a byte short
    _refused(_client(), payload, 2, Status.BAD_PAYLOAD)  # fewer records than num_items


def test_registration_layer_index_bounds_and_repeats():
    _register(_client(), _payload(1, PAGE, [(MAX_LAYERS - 1, 0, PAGE)]), 1)
    _refused(_client(), _payload(1, PAGE, [(MAX_LAYERS, 0, PAGE)]), 1)
    _refused(_client(), _payload(1, PAGE, [(3, 0, PAGE), (3, 0, PAGE)]), 2)


def test_registration_second_region_must_agree_and_add_new_layers():
    client = _client()
    _register(client, _payload(2, 2 * PAGE, [(0, 0, PAGE)]), 1, region_id=0)
    _refused(client, _payload(2, 2 * PAGE, [(1, 0, PAGE)]), 1, region_id=0)  # id taken
    _refused(client, _payload(2, 4 * PAGE, [(1, 0, 2 * PAGE)], page=2 * PAGE), 1, region_id=1)  # page size
    _refused(client, _payload(2, 2 * PAGE, [(0, 0, PAGE)]), 1, region_id=1)  # layer taken
    _register(client, _payload(2, 2 * PAGE, [(1, 0, PAGE)]), 1, region_id=1)
    assert sorted(client.layers) == [0, 1] and client.region_blocks == {0: 2, 1: 2}


def test_registration_block_of_all_layers_must_fit_a_slab():
    # Two layers of 4 KiB pages: an 8 KiB block fits an 8 KiB slab, not one a byte smaller;
    # a later region's layers add to the block of those registered before.
    _register(_client(), _payload(1, PAGE, [(0, 0, PAGE), (1, 0, PAGE)]), 2, slab=2 * PAGE)
    _refused(_client(), _payload(1, PAGE, [(0, 0, PAGE), (1, 0, PAGE)]), 2, slab=2 * PAGE - 1)
    client = _client()
    _register(client, _payload(1, PAGE, [(0, 0, PAGE)]), 1, slab=2 * PAGE)
    _register(client, _payload(1, PAGE, [(1, 0, PAGE)]), 1, region_id=1, slab=2 * PAGE)
    _refused(client, _payload(1, PAGE, [(2, 0, PAGE)]), 1, region_id=2, slab=2 * PAGE)


def test_registration_backend_refusal_records_nothing():
    _refused(_client(), _payload(1, PAGE, [(0, 0, PAGE)]), 1, backend=RecordingBackend(refuse=True))


def test_registration_events_once_and_whole_handles_only():
    client, backend = _client(), RecordingBackend()
    handles = np.zeros(3, EVENT_HANDLE).view(np.uint8)
    rec = _record(Opcode.REGISTER_EVENTS, num_items=3)

    def events(payload):
        return DECODERS[Opcode.REGISTER_EVENTS](rec, payload)
    with pytest.raises(CommandError) as info:
        register_events(client, events(handles[:-1]), backend)
    assert info.value.status == Status.BAD_PAYLOAD and client.num_events == 0
    register_events(client, events(handles), backend)
    assert client.num_events == 3 and backend.events == [(0, 3)]
    with pytest.raises(CommandError) as info:
        register_events(client, events(handles), backend)
    assert info.value.status == Status.BAD_ARGUMENT and backend.events == [(0, 3)]
    refused = _client()
    with pytest.raises(CommandError) as info:
        register_events(refused, events(handles), RecordingBackend(refuse=True))
    assert info.value.status == Status.BAD_ARGUMENT and refused.num_events == 0
