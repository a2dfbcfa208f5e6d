"""CudaBackend.register_region on a stand-in driver (no GPU needed): a region is opened on the
engine's device of the GPU its UUID names, not on the client's ordinal, and so are the client's
events; a GPU the engine does not see refuses the REGISTER (BAD_ARGUMENT, nothing opened)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from engine.clients.client import ClientState
from engine.clients.registration import register_region
from engine.copy import cuda_clients
from engine.copy.base import KERNEL
from engine.copy.visible_gpus import VisibleGpus
from engine.memory.pool import PagePool
from pegaflow.client.host_memory import layer_records
from pegaflow.platform import wire
from pegaflow.platform.errors import CommandError, UnknownGpuError
from pegaflow.platform.protocol import Register
from tests.engine.copy.test_visible_gpus import NODE

cuda = pytest.importorskip("engine.copy.cuda")

PAGE = 4096


class StandInDriver:
    """Records which device each mapping, event and context switch is made on."""

    def __init__(self, monkeypatch):
        self.current, self.mapped, self.events = None, [], []
        monkeypatch.setattr(cuda.driver, "use_device", self.use_device)  # (one module: cuda_clients' too)
        monkeypatch.setattr(cuda.driver, "open_ipc_event", lambda handle: self.events.append(self.current))
        monkeypatch.setattr(cuda_clients.MAPPINGS, "acquire", self.acquire)

    def use_device(self, device: int) -> None:
        self.current = device

    def acquire(self, device: int, handle: bytes) -> int:
        self.mapped.append(device)
        return 1 << 40


def _backend(engine_sees: tuple[bytes, ...]) -> "cuda.CudaBackend":
    """A CudaBackend whose devices exist already (no kernels, no pool): one per GPU it sees."""
    backend = object.__new__(cuda.CudaBackend)
    backend._gpus = VisibleGpus(engine_sees)
    backend._devices = {i: SimpleNamespace(device=i) for i in range(len(engine_sees))}
    backend._clients = cuda_clients.ClientMappings()
    backend.copy_backend = KERNEL
    return backend


def _region(gpu_uuid: bytes, client_device: int) -> np.void:
    """A CUDA_IPC REGION as the client's ``region_record`` writes it."""
    r = np.zeros(1, wire.REGION)[0]
    r["kind"], r["client_device"], r["gpu_uuid"] = wire.RegionKind.CUDA_IPC, client_device, gpu_uuid
    r["num_blocks"], r["page_bytes"], r["alloc_bytes"] = 4, PAGE, 4 * PAGE
    r["handle"] = b"h".ljust(wire.IPC_HANDLE_BYTES, b"\0")
    return r


def test_cuda_backend_region_of_a_remapped_client_opens_on_the_engines_device(monkeypatch):
    # 1. The engine sees the node's four GPUs; the client, under CUDA_VISIBLE_DEVICES=3, sent
    #    its memory on its device 0, which is the node's GPU 3.
    fake = StandInDriver(monkeypatch)
    backend = _backend(NODE)
    backend.register_region(5, 0, _region(NODE[3], client_device=0))
    # 2. Mapped on the engine's device 3, and recorded there for the copies' streams.
    assert fake.mapped == [3] and backend._clients.regions[(5, 0)].device == 3
    # 3. The client's events open on device 3 too.
    backend.register_events(5, np.zeros(2, wire.EVENT_HANDLE))
    assert fake.events == [3, 3] and len(backend._clients.events(5, 3)) == 2


def test_cuda_backend_region_of_a_gpu_the_engine_does_not_see_opens_nothing(monkeypatch):
    fake = StandInDriver(monkeypatch)
    backend = _backend(NODE[:2])
    with pytest.raises(UnknownGpuError, match=wire.gpu_uuid_text(NODE[3])):
        backend.register_region(5, 0, _region(NODE[3], client_device=0))
    assert fake.mapped == [] and backend._clients.regions == {} and set(backend._devices) == {0, 1}


def test_cuda_backend_register_of_an_unseen_gpu_is_refused_with_its_uuid_and_nothing_recorded(monkeypatch):
    # 1. REGISTER through the engine's registration, on a GPU the engine does not see.
    StandInDriver(monkeypatch)
    backend, client = _backend(NODE[:2]), ClientState(0, view=None, submissions=None, completions=None)
    register = Register(0, _region(NODE[3], client_device=0), layer_records([0], [0], [PAGE]))
    with pytest.raises(CommandError) as info:
        register_region(client, register, backend, PagePool(4 << 20, 1 << 20))
    # 2. Refused as a bad argument, saying why; the client has nothing registered.
    assert info.value.status == wire.Status.BAD_ARGUMENT
    assert wire.gpu_uuid_text(NODE[3]) in str(info.value) and f"1: {wire.gpu_uuid_text(NODE[1])}" in str(info.value)
    assert client.layers == {} and client.region_blocks == {} and client.page_bytes == 0
