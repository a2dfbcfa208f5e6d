"""GPU tests of what a client exports: allocation handles with their offset, IPC events.

This process plays the client (torch owns the memory); a spawned process plays the
engine and uses only ``pegaflow.platform.cuda.driver``.  Skipped where CUDA is absent.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)
pytest.importorskip("cuda.bindings")

from pegaflow.platform import wire  # noqa: E402
from pegaflow.platform.cuda import driver  # noqa: E402
from pegaflow.platform.cuda.ipc import EventPool, export_allocation  # noqa: E402
from tests.spawn import start_child, stop_child  # noqa: E402

PAD_BYTES = (1 << 20) + 4096
NUM_BYTES = 1 << 20
SLEEP_CYCLES = 400_000_000  # ~0.2 s of GPU time at H200 clocks
TIMEOUT_S = 60.0


def _engine_side(conn) -> None:
    """The opener: map the client's allocation and events, read bytes when asked."""
    driver.use_device(0)
    exported, event_handles = conn.recv()
    base = driver.open_ipc_mem(exported.handle)
    events = [driver.open_ipc_event(h.tobytes()) for h in event_handles["handle"]]
    stream = driver.create_stream()
    while (cmd := conn.recv()) is not None:
        event_index, num_bytes = cmd
        if event_index is not None:
            driver.wait(stream, events[event_index])
        out = np.empty(num_bytes, dtype=np.uint8)
        driver.memcpy_async(out.ctypes.data, base + exported.base_offset, num_bytes, stream)
        driver.synchronize_stream(stream)
        conn.send(out)
    driver.close_ipc_mem(base)


@pytest.fixture
def engine_side():
    """A spawned opener process and the pipe to it."""
    conn, proc = start_child(_engine_side)
    yield conn
    stop_child(conn, proc, TIMEOUT_S)


def _recv(conn):
    assert conn.poll(TIMEOUT_S), "the engine-side process did not answer"
    return conn.recv()


@pytest.mark.gpu
def test_export_allocation_offset_is_distance_from_allocation_base():
    # 1. A tensor that starts 1 MiB + 4 KiB into a larger allocation.
    whole = torch.empty(PAD_BYTES + NUM_BYTES, dtype=torch.uint8, device="cuda")
    view = whole[PAD_BYTES:]
    # 2. The export names the allocation and carries the view's distance from its base.
    exported = export_allocation(view.data_ptr())
    base, size = driver.address_range(view.data_ptr())
    assert exported.base_offset == view.data_ptr() - base
    assert exported.base_offset >= PAD_BYTES
    assert exported.alloc_bytes == size >= PAD_BYTES + NUM_BYTES
    assert len(exported.handle) == wire.IPC_HANDLE_BYTES
    assert exported.device == torch.cuda.current_device()


@pytest.mark.gpu
def test_export_allocation_other_process_reads_same_bytes_at_offset(engine_side):
    # 1. Random bytes in a tensor that is not at its allocation's base.
    whole = torch.zeros(PAD_BYTES + NUM_BYTES, dtype=torch.uint8, device="cuda")
    view = whole[PAD_BYTES:]
    view.copy_(torch.randint(0, 256, (NUM_BYTES,), dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()
    events = EventPool(2)
    # 2. The other process opens the handle and reads at base + offset: the same bytes.
    engine_side.send((export_allocation(view.data_ptr()), events.handles()))
    engine_side.send((None, NUM_BYTES))
    assert np.array_equal(_recv(engine_side), view.cpu().numpy())
    events.close()


@pytest.mark.gpu
def test_event_pool_wait_in_other_process_sees_writes_before_record(engine_side):
    # 1. Share memory and events with the other process.
    buf = torch.zeros(NUM_BYTES, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    events = EventPool(4)
    engine_side.send((export_allocation(buf.data_ptr()), events.handles()))
    # 2. Write late (after ~0.2 s of GPU sleep), then record event 3 behind the write.
    stream = torch.cuda.current_stream()
    torch.cuda._sleep(SLEEP_CYCLES)
    buf.fill_(0x5A)
    events.record([3], stream.cuda_stream)
    assert not events.query(3)
    # 3. The reader waits on event 3 on its own stream: it sees the new bytes only.
    engine_side.send((3, NUM_BYTES))
    assert (_recv(engine_side) == 0x5A).all()
    assert events.query(3)
    events.close()


@pytest.mark.gpu
def test_event_pool_query_turns_true_when_work_before_record_ends():
    events = EventPool(1)
    stream = torch.cuda.current_stream()
    torch.cuda._sleep(SLEEP_CYCLES)
    events.record([0], stream.cuda_stream)
    assert not events.query(0)
    torch.cuda.synchronize()
    assert events.query(0)
    events.close()


@pytest.mark.gpu
def test_event_pool_handles_are_distinct_wire_records():
    events = EventPool(8)
    handles = events.handles()
    assert handles.dtype == wire.EVENT_HANDLE and len(handles) == 8
    assert len({h.tobytes() for h in handles["handle"]}) == 8
    events.close()
