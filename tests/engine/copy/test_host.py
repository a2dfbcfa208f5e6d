"""engine/copy/host.py's REGISTER check of a region's GPU: host memory carries the stand-in
UUID (``wire.HOST_GPU_UUID``) and is taken; any other value of the field, garbage included, is
refused with an error naming it, and nothing is opened."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.copy.host import HostBackend
from pegaflow.client.host_memory import HostKVBuffer
from pegaflow.platform.errors import UnknownGpuError
from pegaflow.platform.wire import GPU_UUID_BYTES, HOST_GPU_UUID, gpu_uuid_text

PAGE = 4096


@pytest.fixture(scope="module")
def kv():
    buffer = HostKVBuffer(4 * PAGE, "thost")
    yield buffer
    buffer.close()


def test_host_backend_region_of_host_memory_is_opened(kv):
    backend = HostBackend()
    region = kv.region_record(4, PAGE, 1)[0]
    assert region["gpu_uuid"].tobytes() == HOST_GPU_UUID
    backend.register_region(0, 0, region)
    assert set(backend._regions) == {(0, 0)}
    backend.close()


@settings(max_examples=200, deadline=None)
@given(gpu_uuid=st.binary(min_size=GPU_UUID_BYTES, max_size=GPU_UUID_BYTES).filter(lambda u: u != HOST_GPU_UUID),
       client_device=st.sampled_from([0, 1, 2**31, 2**32 - 1]))
def test_host_backend_region_naming_any_other_gpu_is_refused_and_opens_nothing(kv, gpu_uuid, client_device):
    # 1. A host region like any other, but its GPU field holds another value (a real GPU's
    #    UUID, zeros, garbage), and any client ordinal.
    backend = HostBackend()
    region = kv.region_record(4, PAGE, 1)[0]
    region["gpu_uuid"], region["client_device"] = np.void(gpu_uuid), client_device
    # 2. Refused with a typed error that names the value and the host's one stand-in.
    with pytest.raises(UnknownGpuError) as info:
        backend.register_region(0, 0, region)
    assert gpu_uuid_text(gpu_uuid) in str(info.value) and "it sees 0: host" in str(info.value)
    assert backend._regions == {}
