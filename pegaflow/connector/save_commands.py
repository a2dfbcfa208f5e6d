"""The SAVE commands of a worker step: one of every layer, or, for a hybrid model, one per
KV cache group.

The engine's layer-L copy waits, on the GPU, for the event recorded after layer L was
written (``SAVE_EVENT + L``; a group's from its first layer on), so it overlaps the layers
still computing; after a full CUDA graph replay, which runs no per-layer hook, every layer
waits for one event recorded after the forward.  A voter (an MLA rank that shares one
stored copy) tags each block with what every rank computes alike (``save_tag``).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import numpy as np

from pegaflow.connector.kv_layers import SAVE_EVENT, KVLayers
from pegaflow.connector.metadata import SaveSpec, save_tag
from pegaflow.platform.errors import PegaflowError
from pegaflow.platform.wire import BLOCK_ID, NO_EVENT, encode_hashes

logger = logging.getLogger(__name__)


class SentSave(NamedTuple):
    command_id: int  # the engine's id of the SAVE
    req_ids: tuple[str, ...]  # the vLLM requests of the step's saves
    records: np.ndarray  # the HASH records it stores


class Sent(NamedTuple):
    saves: list[SentSave]
    lost: PegaflowError | None  # the error that broke the connection (the rest not sent)


class SaveCommands:
    def __init__(self, namespace: int, is_voter: bool):
        self.namespace = namespace
        self.is_voter = is_voter

    def send(self, client, saves: list[SaveSpec], layers: KVLayers, memory, step: int,
             one_event: bool) -> Sent:
        """The SAVE(s) of ``saves``, all written by step ``step``."""
        req_ids = tuple(s.req_id for s in saves)
        if not any(s.groups for s in saves):
            runs = [(s.req_id, len(s.block_ids)) for s in saves]
            return self._send(client, None, [b for s in saves for b in s.block_ids],
                              [h for s in saves for h in s.hashes], req_ids, layers, memory, one_event,
                              self._tags(step, runs))
        sent = []
        for group in range(layers.num_groups):  # a hybrid model: one SAVE per KV cache group
            parts = [(s.req_id, p) for s in saves for p in s.groups if p.group == group]
            if not parts or not layers.layers_of(group):  # (the drafter's group: not stored)
                continue
            ids, hashes = [b for _, p in parts for b in p.block_ids], [h for _, p in parts for h in p.hashes]
            tags = self._tags(step, [(r, len(p.block_ids)) for r, p in parts])
            one = self._send(client, group, ids, hashes, req_ids, layers, memory, one_event, tags)
            sent += one.saves
            if one.lost is not None:
                return Sent(sent, one.lost)
        return Sent(sent, None)

    def _tags(self, step: int, runs: list[tuple[str, int]]) -> list[int] | None:
        """A voter's tag per block: ``runs`` of (vLLM req_id, its number of blocks)."""
        if not self.is_voter:
            return None
        return [tag for req_id, count in runs for tag in [save_tag(step, req_id)] * count]

    def _send(self, client, group: int | None, block_ids, hashes, req_ids, layers: KVLayers, memory,
              one_event: bool, tags: list[int] | None) -> Sent:
        """One SAVE (of every layer, or of KV cache group ``group``'s)."""
        ids = np.fromiter(block_ids, dtype=BLOCK_ID, count=len(block_ids))
        records = encode_hashes(hashes)
        event = NO_EVENT
        if memory.has_events:  # a group's k-th layer waits for event + k (or all for one)
            event = SAVE_EVENT + (0 if one_event or group is None else layers.first_layer_of(group))
        extra = {} if group is None else {"group": group}
        if tags is not None:
            extra["tags"] = tags
        try:
            command_id = client.submit_save(self.namespace, ids, records, event_index=event,
                                            one_event=one_event and memory.has_events, **extra)
        except PegaflowError as exc:
            return Sent([], exc)
        logger.debug("pegaflow: SAVE %d of %d blocks for %s sent (%s%s)", command_id, len(ids),
                     req_ids, "one event after the forward" if one_event else "an event per layer",
                     "" if group is None else f", KV cache group {group}")
        return Sent([SentSave(command_id, req_ids, records)], None)


class LayersWritten:
    """The layers whose KV this step wrote, as ``save_kv_layer`` says (cuda: with an event
    recorded on vLLM's stream after each, one per engine layer)."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def add(self, layer_name: str, layers: KVLayers, memory) -> None:
        if memory.has_events:
            try:
                memory.events.record(layers.virtual[layer_name], memory.current_stream())
            except PegaflowError as exc:
                logger.error("pegaflow: cannot fence layer %s for saving (%s); this step's "
                             "saves are dropped", layer_name, exc)
                return
        self.names.add(layer_name)

    def is_partial(self, layers: KVLayers) -> bool:
        """Some layers written, not all: the step's saves are dropped.  (None written: a full
        CUDA graph replay wrote every layer, and one event after it fences them all.)"""
        if not self.names or self.names == layers.save_layers:
            return False
        logger.warning("pegaflow: %d layers were not written this step; its saves are dropped",
                       len(layers.save_layers) - len(self.names))
        return True


def record_forward_done(memory) -> bool:
    """Record the first save event where vLLM's stream stands after the forward (it is
    layer 0's in steps whose hooks run): every KV write of the step is before it."""
    if not memory.has_events:
        return True
    try:
        memory.events.record([SAVE_EVENT], memory.current_stream())
    except PegaflowError as exc:
        logger.error("pegaflow: cannot fence this step's saves (%s); they are dropped", exc)
        return False
    return True
