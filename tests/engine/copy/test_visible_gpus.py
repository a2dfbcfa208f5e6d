"""engine/copy/visible_gpus.py against fake device tables: a client's GPU, named by UUID, found
at the engine's own ordinal whatever CUDA_VISIBLE_DEVICES numbered it in the client; a GPU the
engine does not see refused with an error naming it and those the engine sees."""

from __future__ import annotations

import pytest

from engine.copy.visible_gpus import VisibleGpus
from pegaflow.platform.cuda import driver
from pegaflow.platform.errors import UnknownGpuError
from pegaflow.platform.wire import HOST_GPU_UUID, gpu_uuid_text

# A node of four GPUs, by their UUIDs in the node's (PCI) order.
NODE = tuple(bytes([0x10 * (i + 1)] * 4) + bytes(range(i, i + 12)) for i in range(4))


def seen_under(cuda_visible_devices: str) -> VisibleGpus:
    """The GPUs a process sees under ``CUDA_VISIBLE_DEVICES`` (node indices, in its order),
    numbered from 0 as CUDA numbers them there."""
    return VisibleGpus(tuple(NODE[int(i)] for i in cuda_visible_devices.split(",")))


@pytest.mark.parametrize("client_visible,client_device,engine_visible,engine_device", [
    ("3", 0, "0,1,2,3", 3),    # a Kubernetes pod given the node's fourth GPU: its device 0
    ("1,3", 1, "0,1,2,3", 3),  # the client's second GPU
    ("2,0", 0, "0,1,2,3", 2),  # an order other than the node's
    ("3", 0, "2,3", 1),        # the engine sees part of the node: its own numbering still
    ("0", 0, "0,1,2,3", 0),    # one numbering on both sides
])
def test_visible_gpus_client_device_resolves_to_the_engines_ordinal_of_the_same_gpu(
        client_visible, client_device, engine_visible, engine_device):
    # 1. The client names its device by the UUID its own table gives that ordinal.
    uuid = seen_under(client_visible).uuids[client_device]
    # 2. The engine finds that GPU at its own ordinal (not the client's).
    engine = seen_under(engine_visible)
    assert engine.ordinal_of(uuid, client_device) == engine_device
    assert engine.uuids[engine_device] == uuid


def test_visible_gpus_gpu_the_engine_does_not_see_raises_unknown_gpu_error_naming_it_and_those_it_sees():
    # 1. The engine sees GPUs 0 and 1 of the node; the client's memory is on GPU 3.
    engine = seen_under("0,1")
    with pytest.raises(UnknownGpuError) as info:
        engine.ordinal_of(NODE[3], 0)
    # 2. The error names the GPU by UUID, the client's ordinal for it, each GPU the engine
    #    sees with its ordinal, and how to run the engine so that it sees them all.
    text = str(info.value)
    assert gpu_uuid_text(NODE[3]) in text and "the client's device 0" in text
    assert f"0: {gpu_uuid_text(NODE[0])}, 1: {gpu_uuid_text(NODE[1])}" in text
    assert "NVIDIA_VISIBLE_DEVICES=all" in text


def test_visible_gpus_engine_that_sees_no_gpu_says_so():
    with pytest.raises(UnknownGpuError, match="it sees no GPU"):
        VisibleGpus(()).ordinal_of(NODE[0], 0)


def test_visible_gpus_of_driver_lists_each_device_at_its_ordinal(monkeypatch):
    # 1. A driver that sees the node's GPUs 2 and 0, in that order (CUDA_VISIBLE_DEVICES=2,0).
    monkeypatch.setattr(driver, "device_count", lambda: 2)
    monkeypatch.setattr(driver, "device_uuid", lambda device: (NODE[2], NODE[0])[device])
    # 2. The table holds their UUIDs by the driver's ordinals.
    assert VisibleGpus.of_driver().uuids == (NODE[2], NODE[0])


def test_visible_gpus_host_sees_only_its_stand_in_and_refuses_any_other_without_the_gpu_hint():
    host = VisibleGpus.host()
    assert host.ordinal_of(HOST_GPU_UUID, 0) == 0
    with pytest.raises(UnknownGpuError) as info:
        host.ordinal_of(NODE[0], 0)
    assert "it sees 0: host" in str(info.value) and "NVIDIA_VISIBLE_DEVICES" not in str(info.value)
