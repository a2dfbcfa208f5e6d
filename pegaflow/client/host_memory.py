"""KV memory in host shared memory: what the host backend copies to and from.

With ``--backend host`` there is no GPU: a client (a test, ``pegaflow.smoke``, or the
connector in CI) keeps its "device" KV caches in a segment it creates, and REGISTERs
the segment's name.  The client is the creator, so it alone unlinks it.
"""

from __future__ import annotations

import numpy as np

from pegaflow.platform import shm
from pegaflow.platform.errors import ShmError
from pegaflow.platform.wire import HOST_GPU_UUID, LAYER, REGION, SHM_NAME_BYTES, RegionKind


class HostKVBuffer:
    def __init__(self, num_bytes: int, what: str = "kv"):
        self.name = shm.private_buffer_name(what)
        if len(self.name.encode()) >= SHM_NAME_BYTES:
            raise ValueError(f"segment name {self.name!r} is too long")
        self.segment = shm.create_segment(self.name, num_bytes)
        try:
            shm.reserve(self.segment)  # no SIGBUS later in whoever writes it first
        except ShmError:
            self.segment.close()
            self.segment.unlink()
            raise
        self.num_bytes = num_bytes
        self.data = self.segment.array(np.uint8, num_bytes)
        self.address = self.segment.address()  # where its owner's tensors see it (in_place.py)
        _LIVE[self.name] = self  # found by address when vLLM hands us its tensors

    def region_record(self, num_blocks: int, page_bytes: int, num_layers: int,
                      base_offset: int = 0) -> np.ndarray:
        region = np.zeros(1, dtype=REGION)
        region["kind"] = RegionKind.HOST_SHM
        region["gpu_uuid"] = np.void(HOST_GPU_UUID)
        region["num_layers"], region["num_blocks"] = num_layers, num_blocks
        region["page_bytes"], region["base_offset"] = page_bytes, base_offset
        region["alloc_bytes"] = self.num_bytes
        region["shm_name"] = self.name.encode()
        return region

    def close(self) -> None:
        _LIVE.pop(self.name, None)
        self.data = None
        self.segment.close()
        self.segment.unlink()


def layer_records(layers: list[int], offsets: list[int], strides: list[int],
                  groups: list[int] | None = None) -> np.ndarray:
    """LAYER records (every layer in group 0 unless ``groups`` says otherwise)."""
    records = np.zeros(len(layers), dtype=LAYER)
    records["layer"], records["offset_bytes"], records["block_stride_bytes"] = layers, offsets, strides
    if groups is not None:
        records["group"] = groups
    return records


def layer_major_records(num_layers: int, num_blocks: int, page_bytes: int) -> np.ndarray:
    """LAYER records of a layer-major cache of one page per block: layer l's block b at
    ``(l * num_blocks + b) * page_bytes``."""
    layer_bytes = num_blocks * page_bytes
    return layer_records(list(range(num_layers)), [i * layer_bytes for i in range(num_layers)],
                         [page_bytes] * num_layers)


_LIVE: dict[str, "HostKVBuffer"] = {}


def find_buffer(address: int, num_bytes: int) -> tuple["HostKVBuffer", int] | None:
    """The live buffer of this process holding ``[address, address + num_bytes)``, and the offset."""
    for buffer in _LIVE.values():
        base = buffer.address
        if base <= address and address + num_bytes <= base + buffer.num_bytes:
            return buffer, address - base
    return None
