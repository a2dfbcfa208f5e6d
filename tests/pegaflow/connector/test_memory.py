"""How a worker exposes its KV memory to the engine (``pegaflow/connector/memory.py``), the host
side: a tensor inside a live ``HostKVBuffer`` is named by that buffer and its offset in it; one
outside every buffer is refused with a LayoutError; ``share`` moves a private tensor's storage
into shared memory in place and ``close`` unlinks only what it made."""

from __future__ import annotations

import numpy as np
import pytest

from pegaflow.client.host_memory import HostKVBuffer, find_buffer
from pegaflow.connector.layout import TensorInfo
from pegaflow.connector.memory import HostMemory
from pegaflow.platform.errors import LayoutError
from pegaflow.platform.wire import RegionKind


def _info(name: str, address: int, num_bytes: int) -> TensorInfo:
    return TensorInfo(name, address, (num_bytes,), (1,), 1)


def test_memory_host_region_of_a_tensor_in_a_buffer_is_the_buffer_at_its_offset():
    buffer = HostKVBuffer(1 << 16, "memtest")
    try:
        key, offset, region = HostMemory("e").region_of(_info("layer.1", buffer.address + 4096, 8192))
        assert (key, offset) == (buffer.name, 4096)
        assert int(region["kind"][0]) == RegionKind.HOST_SHM and int(region["alloc_bytes"][0]) == 1 << 16
        assert region["shm_name"][0].decode() == buffer.name
        # A tensor running past the buffer's end is not in it.
        with pytest.raises(LayoutError, match="layer.2"):
            HostMemory("e").region_of(_info("layer.2", buffer.address + (1 << 16) - 4096, 8192))
    finally:
        buffer.close()


def test_memory_host_share_moves_private_storage_in_place_and_close_unlinks_only_it():
    torch = pytest.importorskip("torch")
    kept = HostKVBuffer(1 << 16, "memkept")
    tensor = torch.randint(0, 256, (8 << 20,), dtype=torch.uint8)  # private anonymous memory, as vLLM's CPU build's
    before = tensor.clone()
    memory = HostMemory("memshare")
    try:
        inside = torch.from_numpy(kept.data[:4096])  # already in a buffer: left as it is
        memory.share([tensor, tensor[100:200], inside])
        # 1. One buffer made, for the one private storage; its bytes where they were.
        assert len(memory.moved) == 1
        found = find_buffer(tensor.data_ptr(), tensor.numel())
        assert found is not None and found[0] is memory.moved[0]
        assert torch.equal(tensor, before)
        # 2. close unlinks it, not the buffer someone else made.
        memory.close()
        assert memory.moved == [] and find_buffer(tensor.data_ptr(), tensor.numel()) is None
        assert find_buffer(kept.address, 4096) is not None
        assert np.array_equal(kept.data[:4], np.zeros(4, np.uint8))
    finally:
        memory.close()
        kept.close()
