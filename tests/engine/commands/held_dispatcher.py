"""A Dispatcher on in-memory clients whose copy backend holds every copy until a test ends it
(the in-process tests of the dispatcher and of transfers)."""

from __future__ import annotations

import os

import numpy as np

from pegaflow.platform.errors import CommandError
from pegaflow.platform.wire import Opcode, Status, encode_hashes


def held_dispatcher(refuse: bool = False):
    """A dispatcher on one in-memory client (one layer of 16 blocks, 4 IPC events) whose
    backend holds every copy until the test ends it with ``on_copy_done`` (or, with
    ``refuse``, refuses every copy at submit, as the CUDA backend refuses an op that fails
    its checks)."""
    from types import SimpleNamespace

    from engine.blocks.index import BlockIndex
    from engine.clients.client import ClientState
    from engine.commands.dispatcher import Dispatcher
    from engine.copy.base import CopyBackend, LayerPlacement
    from engine.memory.pool import PagePool
    from engine.stats import StatsWriter
    from pegaflow.platform.ring import RingConsumer, RingProducer, RingSegmentView, record_type, reset_slots
    from pegaflow.platform.wire import ALL_LAYERS, COMPLETION, NO_EVENT, STATS, SUBMISSION, WIRE_VERSION

    class HeldBackend(CopyBackend):
        name = "held"

        def __init__(self):
            self.held, self.unregistered, self.ops = [], [], {}

        def open_pool(self, pool): pass
        def register_region(self, *args): pass
        def register_events(self, *args): pass
        def unregister_client(self, slot): self.unregistered.append(slot)
        def submit(self, op):
            self.ops[op.token] = op
            if refuse:
                raise CommandError(Status.BLOCK_OUT_OF_RANGE, "refused at submit")
            self.held.append(op.token)
        def num_inflight(self): return len(self.held)

        def poll(self):
            return []

    class Segment:
        def __init__(self, size): self.buf, self.name = np.zeros(size, np.uint8), "mem"
        def array(self, dtype, count, offset=0): return np.frombuffer(self.buf, dtype, count, offset)

    backend = HeldBackend()
    dispatcher = Dispatcher(BlockIndex(PagePool(1 << 20, 1 << 20), 60.0), backend,
                            StatsWriter(np.zeros(1, STATS)))
    dispatcher.transfers.issuing.slice_s = float("inf")  # no loop here to issue the rest later
    make = record_type(SUBMISSION)

    def add_client(slot: int) -> SimpleNamespace:
        """Another in-memory client of the same dispatcher (same geometry, own ring)."""
        num_slots, arena = 8, 1 << 16
        view = RingSegmentView(Segment(64 + num_slots * (SUBMISSION.itemsize + COMPLETION.itemsize)
                                       + arena), num_slots, arena)
        reset_slots(view.submissions)
        reset_slots(view.completions)
        client = ClientState(slot, view, RingConsumer(view.submissions), RingProducer(view.completions),
                             pid=os.getpid(), is_attached=True)
        client.layers = {0: LayerPlacement(0, 0, 0, 4096)}
        client.region_blocks, client.page_bytes, client.num_events = {0: 16}, 4096, 4

        def send(command_id, opcode, payload=np.zeros(0, np.uint8), num_items=0,
                 event_index=NO_EVENT, flags=0, arg=0, layer=ALL_LAYERS, namespace=7):
            view.arena[:payload.nbytes] = payload.view(np.uint8)
            rec = make(0, command_id, opcode, flags, layer, 0, num_items, event_index, namespace, 0,
                       payload.nbytes, WIRE_VERSION, arg)
            dispatcher.handle(client, rec)

        return SimpleNamespace(client=client, view=view, send=send,
                               completions=RingConsumer(view.completions))

    first = add_client(0)
    return SimpleNamespace(dispatcher=dispatcher, backend=backend, add_client=add_client,
                           client=first.client, view=first.view, send=first.send,
                           completions=first.completions)


def save_payload(ids, hashes: list[bytes]) -> np.ndarray:
    return np.concatenate([np.asarray(ids, np.int32).view(np.uint8), encode_hashes(hashes).view(np.uint8)])


def store_blocks(h, command_id: int, ids, hashes) -> None:
    """SAVE ``hashes`` from ``ids`` and let the held copy finish."""
    from engine.copy.base import CopyDone
    h.send(command_id, Opcode.SAVE, save_payload(ids, hashes), len(ids))
    for token in list(h.backend.held):
        h.backend.held.remove(token)
        h.dispatcher.on_copy_done(CopyDone(token))
    assert h.completions.try_get().status == Status.OK
