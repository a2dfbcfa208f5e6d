"""CudaBackend.register_region: a region is opened on the engine's device of the GPU its UUID
names, not on the client's ordinal, and so are the client's events; a GPU the engine does not
see refuses the REGISTER (BAD_ARGUMENT, nothing opened).  On a stand-in driver (no GPU needed),
then on GPUs with a client process that sees one GPU (on a host of two or more: not the
engine's device 0), by the backend and through a real engine."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import numpy as np
import pytest

from engine.clients.client import ClientState
from engine.clients.registration import register_region
from engine.copy import cuda_clients, cuda_unusable_reason
from engine.copy.base import KERNEL, CopyDone, CopyOp, Direction, LayerPlacement
from engine.copy.visible_gpus import VisibleGpus
from engine.memory.pool import PagePool
from pegaflow.client.host_memory import layer_records
from pegaflow.platform import shm, wire
from pegaflow.platform.cuda import driver
from pegaflow.platform.cuda.ipc import export_allocation, region_record
from pegaflow.platform.errors import CommandError, UnknownGpuError
from pegaflow.platform.protocol import Register
from tests.engine.copy.test_visible_gpus import NODE
from tests.spawn import start_child, stop_child

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


# -- on GPUs: a client that sees one GPU, as a Kubernetes pod given one does -------------------

NUM_LAYERS, NUM_BLOCKS, GPU_PAGE = 2, 16, 8192
LAYER_BYTES = NUM_BLOCKS * GPU_PAGE
POOL_BYTES = 2 << 20  # 64 entries of NUM_LAYERS pages
TIMEOUT_S = 120.0
needs_gpu = pytest.mark.skipif(cuda_unusable_reason() is not None, reason="needs an NVIDIA GPU")


def _exporter_main(conn) -> None:
    """A client whose parent set its CUDA_VISIBLE_DEVICES: random KV bytes on its device 0,
    exported with their bytes; then it waits for None (its memory stays mapped till then)."""
    import torch
    torch.cuda.set_device(0)
    raw = torch.randint(0, 256, (NUM_LAYERS * LAYER_BYTES,), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    conn.send((export_allocation(raw.data_ptr()), raw.cpu().numpy()))
    conn.recv()


def _engine_client_main(conn, engine_name: str) -> None:
    """A client whose parent set its CUDA_VISIBLE_DEVICES, of a real engine: saves four random
    blocks, loads them into four others; sends what it saw (its device, its GPU's UUID, the
    answers, whether the loaded bytes are the saved ones)."""
    import torch

    from pegaflow.client.connection import EngineClient
    from pegaflow.client.host_memory import layer_major_records
    from pegaflow.platform.cuda.ipc import EventPool
    torch.cuda.set_device(0)
    raw = torch.randint(0, 256, (NUM_LAYERS * LAYER_BYTES,), dtype=torch.uint8, device="cuda")
    pages, events = raw.view(NUM_LAYERS, NUM_BLOCKS, GPU_PAGE), EventPool(NUM_LAYERS)
    torch.cuda.synchronize()
    exported = export_allocation(raw.data_ptr())
    client = EngineClient.connect(engine_name, timeout_s=TIMEOUT_S)
    client.register_region(0, region_record(exported, NUM_LAYERS, NUM_BLOCKS, GPU_PAGE),
                           layer_major_records(NUM_LAYERS, NUM_BLOCKS, GPU_PAGE))
    client.register_events(events.handles())
    hashes = [bytes([i + 1]) * 32 for i in range(4)]
    saved = client.wait(client.submit_save(7, [0, 1, 2, 3], hashes, layer=wire.ALL_LAYERS))
    found = client.lookup(7, hashes)
    pages[:, 8:12] = 0
    torch.cuda.synchronize()
    loaded = client.wait(client.submit_load(7, [8, 9, 10, 11], hashes, lease_id=found.lease_id, event_index=0))
    events.wait(range(NUM_LAYERS), torch.cuda.current_stream().cuda_stream)
    is_exact = bool(torch.equal(pages[:, 8:12], pages[:, 0:4]))
    client.close()
    events.close()
    conn.send({"device": exported.device, "gpu_uuid": exported.gpu_uuid, "saved": saved.is_ok,
               "hits": found.num_hit_blocks, "loaded": loaded.is_ok, "is_exact": is_exact})
    conn.recv()


def _start_seeing_only(monkeypatch, engine_device: int, target, *args):
    """``target`` in a child process that sees only the engine's ``engine_device`` (named by
    UUID, so whatever this process's own CUDA_VISIBLE_DEVICES is): its device 0."""
    with monkeypatch.context() as env:
        env.setenv("CUDA_VISIBLE_DEVICES", wire.gpu_uuid_text(driver.device_uuid(engine_device)))
        return start_child(target, *args)


def _answer(conn):
    assert conn.poll(TIMEOUT_S), "the client process did not answer"
    return conn.recv()


@pytest.mark.gpu
@needs_gpu
def test_cuda_backend_region_of_a_client_seeing_one_gpu_opens_on_the_engines_ordinal_of_it(monkeypatch):
    # 1. This process (the engine) sees every GPU; the client sees only the last of them,
    #    which it calls device 0 (with two GPUs: the client's 0 is the engine's 1).
    pytest.importorskip("torch")
    engine_device = driver.device_count() - 1
    conn, proc = _start_seeing_only(monkeypatch, engine_device, _exporter_main)
    pool = shm.create_segment(shm.ipc_name("gputest", f"regions{os.getpid()}"), POOL_BYTES)
    backend = None
    try:
        exported, before = _answer(conn)
        assert exported.device == 0 and exported.gpu_uuid == driver.device_uuid(engine_device)
        # 2. Registered, the region is opened on the engine's ordinal of that GPU.
        backend = cuda.CudaBackend(copy_backend="copy-engine")
        backend.attach_pool(pool)
        backend.register_region(0, 0, region_record(exported, NUM_LAYERS, NUM_BLOCKS, GPU_PAGE)[0])
        assert backend._clients.regions[(0, 0)].device == engine_device
        # 3. A SAVE of four blocks copies exactly the client's bytes (read on that device).
        block_ids, entries = np.array([3, 5, 8, 13]), np.arange(4)
        layers = [LayerPlacement(i, 0, i * LAYER_BYTES, GPU_PAGE) for i in range(NUM_LAYERS)]
        backend.submit(CopyOp(1, Direction.SAVE, 0, layers, GPU_PAGE, block_ids.astype(np.int64),
                              entries.astype(np.int64) * NUM_LAYERS * GPU_PAGE))
        deadline, done = time.monotonic() + TIMEOUT_S, []
        while not done:
            done = backend.poll()
            assert time.monotonic() < deadline, "the SAVE never completed"
        assert done == [CopyDone(1)]
        saved = pool.array(np.uint8, POOL_BYTES).reshape(-1, NUM_LAYERS, GPU_PAGE)[:4]
        expected = before.reshape(NUM_LAYERS, NUM_BLOCKS, GPU_PAGE)[:, block_ids].transpose(1, 0, 2)
        np.testing.assert_array_equal(saved, expected)
    finally:
        if backend is not None:
            backend.close()
        pool.close()
        pool.unlink()
        stop_child(conn, proc, TIMEOUT_S)


@pytest.mark.gpu
@needs_gpu
def test_engine_process_client_seeing_one_gpu_is_served_on_the_engines_ordinal_of_it(monkeypatch, engine_factory):
    # 1. A real engine (--backend cuda) that sees every GPU; a client that sees only the last.
    pytest.importorskip("torch")
    engine_device = driver.device_count() - 1
    engine = engine_factory(pool_size="64MiB", slab_size="1MiB", extra=("--backend", "cuda"))
    conn, proc = _start_seeing_only(monkeypatch, engine_device, _engine_client_main, engine.name)
    try:
        # 2. Its blocks save and load back exactly, and the engine says which of its devices
        #    the client's device 0 is.
        gpu_uuid = driver.device_uuid(engine_device)
        assert _answer(conn) == {"device": 0, "gpu_uuid": gpu_uuid, "saved": True, "hits": 4, "loaded": True,
                                 "is_exact": True}
        assert (f"on {wire.gpu_uuid_text(gpu_uuid)}, the client's device 0, this engine's device "
                f"{engine_device}") in engine.stderr_text()
    finally:
        stop_child(conn, proc, TIMEOUT_S)
