"""A worker's KV layers as the engine knows them, and the numbering of its IPC events.

vLLM names attention layers; the engine copies *engine layers*: a vLLM layer whose K and V
live apart (or whose pages split otherwise) is several engine layers, and a layer that
shares another's memory (an alias, e.g. cross-layer KV sharing) is that layer's.  The
regions are what REGISTER tells the engine: one per allocation, with its layers' offsets
and strides.

Events, one pool per worker (``num_events`` of them), numbered::

    [0, V)                        SAVE: layer k's copy waits for event k (SAVE_EVENT + k),
                                  or all for SAVE_EVENT alone after a full-graph forward
    [(1 + s) V, (2 + s) V)        LOAD slot s: the engine records event k after layer k
    (1 + num_load_slots) V        the start fence: where vLLM's stream stood when a step's
                                  loads went out (the engine starts them after it)

where V is the number of engine layers.

A hybrid model's KV cache groups (vLLM's hybrid KV cache manager: full attention, sliding
window) each get their own engine layers, numbered group after group, so a group's SAVE
or LOAD (``CommandFlag.LAYER_GROUP``) names its events from the group's first layer on.
Groups overlay each other's memory (vLLM gives a block id to one group at a time), so a
layer is an alias of another only within its own group.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from pegaflow.client.host_memory import layer_records
from pegaflow.connector.layout import TensorInfo, alias_key, derive_sublayers
from pegaflow.platform.errors import LayoutError

logger = logging.getLogger(__name__)

SAVE_EVENT = 0


@dataclass
class KVLayers:
    num_load_slots: int
    virtual: dict[str, tuple[int, ...]] = field(default_factory=dict)  # vLLM layer -> engine layers
    save_layers: set[str] = field(default_factory=set)                # canonical (not aliased) names
    regions: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # (REGION, LAYER records)
    num_virtual: int = 0
    page_bytes: int = 0
    # KV cache group -> its engine layers [first, first + count); one group unless hybrid.
    group_layers: list[tuple[int, int]] = field(default_factory=list)

    @classmethod
    def of(cls, tensors: dict[str, TensorInfo], memory, num_blocks: int, num_load_slots: int,
           groups: dict[str, int] | None = None) -> "KVLayers":
        """The map of vLLM's KV tensors (``memory`` finds each one's allocation); ``groups``:
        each layer's KV cache group (None: every layer in group 0)."""
        layers = cls(num_load_slots)
        group_of = groups or {}
        num_groups = 1 + max(group_of.values(), default=0)
        canonical: dict[tuple, str] = {}
        by_alloc: dict[object, tuple[np.ndarray, list]] = {}
        page_bytes = None
        for group in range(num_groups):
            first_of_group = layers.num_virtual
            for name, info in tensors.items():
                if group_of.get(name, 0) != group:
                    continue
                key = (group, alias_key(info))
                if key in canonical:
                    layers.virtual[name] = layers.virtual[canonical[key]]
                    continue
                canonical[key] = name
                subs = derive_sublayers(info, num_blocks)
                if page_bytes is not None and any(s.page_bytes != page_bytes for s in subs):
                    raise LayoutError(f"{name}: pages of {subs[0].page_bytes} bytes, others have {page_bytes}")
                page_bytes = subs[0].page_bytes
                alloc, offset, region = memory.region_of(info)
                records = by_alloc.setdefault(alloc, (region, []))[1]
                first = layers.num_virtual
                for i, sub in enumerate(subs):
                    records.append((first + i, offset + sub.offset_bytes, sub.block_stride_bytes, group))
                layers.virtual[name] = tuple(range(first, first + len(subs)))
                layers.save_layers.add(name)
                layers.num_virtual += len(subs)
            layers.group_layers.append((first_of_group, layers.num_virtual - first_of_group))
        for region, records in by_alloc.values():
            region["num_layers"], region["num_blocks"], region["page_bytes"] = len(records), num_blocks, page_bytes
            layers.regions.append((region, layer_records(*map(list, zip(*records)))))
        layers.page_bytes = page_bytes
        return layers

    @property
    def num_groups(self) -> int:
        return max(len(self.group_layers), 1)

    def first_layer_of(self, group: int) -> int:
        return self.layers_of(group).start

    def layers_of(self, group: int) -> range:
        """The engine layers of KV cache group ``group`` (none for a group whose layers were
        all left out, e.g. a speculative drafter's)."""
        if not self.group_layers:
            return range(0, self.num_virtual)
        if group >= len(self.group_layers):
            return range(0)
        first, count = self.group_layers[group]
        return range(first, first + count)

    def load_event_base(self, slot: int) -> int:
        return (1 + slot) * self.num_virtual

    @property
    def start_fence_event(self) -> int:
        return (1 + self.num_load_slots) * self.num_virtual

    @property
    def num_events(self) -> int:
        return self.start_fence_event + 1
