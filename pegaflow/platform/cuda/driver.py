"""Thin wrappers over the CUDA driver API (``cuda.bindings.driver``); NVRTC is ``nvrtc.py``.

Every call goes through ``check``, which turns a failed ``CUresult`` (or ``nvrtcResult``)
into ``CudaError`` carrying the error's name.  Pointers are plain ints and IPC handles
are 64 raw bytes, so the engine and the client speak through these without torch.

Contexts: the engine and the client both use each device's *primary* context (the one
torch uses too).  ``use_device`` makes it current in the calling thread.
"""

from __future__ import annotations

import ctypes
import logging

import numpy as np
from cuda.bindings import driver

from pegaflow.platform.cuda.batch_copy import memcpy_batch_async  # noqa: F401  (``driver.memcpy_batch_async``)
from pegaflow.platform.cuda.results import check
from pegaflow.platform.errors import CudaError
from pegaflow.platform.wire import IPC_HANDLE_BYTES

logger = logging.getLogger(__name__)

_primary: dict[int, driver.CUcontext] = {}
_initialized = False


def init() -> None:
    """``cuInit`` once; a missing driver library becomes ``CudaError`` too."""
    global _initialized
    if _initialized:
        return
    try:
        check(driver.cuInit(0), "cuInit")
    except RuntimeError as exc:  # cuda.pathfinder's DynamicLibNotFoundError and kin
        raise CudaError(f"CUDA driver not loadable: {exc}") from exc
    _initialized = True



def device_name(device: int) -> str:
    init()
    raw = check(driver.cuDeviceGetName(256, check(driver.cuDeviceGet(device))))
    return raw.split(b"\0", 1)[0].decode()


def device_count() -> int:
    init()
    return int(check(driver.cuDeviceGetCount(), "cuDeviceGetCount"))


def device_uuid(device: int) -> bytes:
    """The 16 bytes of ``device``'s UUID (a MIG instance's own, under MIG): the same in every
    process, whichever ordinal its CUDA_VISIBLE_DEVICES gives the GPU there.  cuda-python 12
    has both ``cuDeviceGetUuid`` and ``cuDeviceGetUuid_v2`` (the one that answers a MIG
    instance's own), 13 only the first, which does: a client and its engine on either agree."""
    init()
    get_uuid = getattr(driver, "cuDeviceGetUuid_v2", driver.cuDeviceGetUuid)
    uuid = check(get_uuid(check(driver.cuDeviceGet(device), "cuDeviceGet")), "cuDeviceGetUuid")
    return bytes(uuid.bytes)


def compute_capability(device: int) -> tuple[int, int]:
    dev = check(driver.cuDeviceGet(device))
    attr = driver.CUdevice_attribute
    return tuple(check(driver.cuDeviceGetAttribute(a, dev), "cuDeviceGetAttribute") for a in (
        attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
        attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR))


def primary_context(device: int) -> driver.CUcontext:
    """Retain (once per process) the primary context of ``device``."""
    if device not in _primary:
        init()
        dev = check(driver.cuDeviceGet(device), "cuDeviceGet")
        _primary[device] = check(driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    return _primary[device]


def use_device(device: int) -> driver.CUcontext:
    """Make ``device``'s primary context current in this thread."""
    ctx = primary_context(device)
    check(driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return ctx


def ensure_context(device: int) -> None:
    """Make a context current only if the thread has none (torch's stays in place)."""
    init()
    if int(check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")) == 0:
        use_device(device)


def create_stream(low_priority: bool = True) -> driver.CUstream:
    """A non-blocking stream of the current context, at its lowest priority by default."""
    least, greatest = check(driver.cuCtxGetStreamPriorityRange(), "cuCtxGetStreamPriorityRange")
    flags = driver.CUstream_flags.CU_STREAM_NON_BLOCKING
    return check(driver.cuStreamCreateWithPriority(flags, least if low_priority else greatest),
                 "cuStreamCreateWithPriority")


def create_event(interprocess: bool = False, timing: bool = False) -> driver.CUevent:
    flags = 0 if timing else int(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING)
    if interprocess:
        flags |= int(driver.CUevent_flags.CU_EVENT_INTERPROCESS)
    return check(driver.cuEventCreate(flags), "cuEventCreate")


def event_done(event) -> bool:
    """``cuEventQuery`` without blocking: True once all work before the record is done."""
    (status,) = driver.cuEventQuery(event)
    if status == driver.CUresult.CUDA_ERROR_NOT_READY:
        return False
    check((status,), "cuEventQuery")
    return True


def record(event, stream) -> None:
    check(driver.cuEventRecord(event, stream), "cuEventRecord")


def wait(stream, event) -> None:
    check(driver.cuStreamWaitEvent(stream, event, 0), "cuStreamWaitEvent")


def _handle_bytes(handle) -> bytes:
    return ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES)


def _handle_from(cls, data: bytes):
    if len(data) != IPC_HANDLE_BYTES:
        raise CudaError(f"an IPC handle has {IPC_HANDLE_BYTES} bytes, got {len(data)}")
    handle = cls()
    ctypes.memmove(handle.getPtr(), data, IPC_HANDLE_BYTES)
    return handle


def address_range(ptr: int) -> tuple[int, int]:
    """``(base, size)`` of the allocation holding device pointer ``ptr``."""
    base, size = check(driver.cuMemGetAddressRange(ptr), "cuMemGetAddressRange")
    return int(base), int(size)


def pointer_device(ptr: int) -> int:
    attr = driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    return int(check(driver.cuPointerGetAttribute(attr, ptr), "cuPointerGetAttribute"))


def ipc_mem_handle(base: int) -> bytes:
    return _handle_bytes(check(driver.cuIpcGetMemHandle(base), "cuIpcGetMemHandle"))


def open_ipc_mem(handle: bytes) -> int:
    flags = driver.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
    ptr = check(driver.cuIpcOpenMemHandle(_handle_from(driver.CUipcMemHandle, handle), flags),
                "cuIpcOpenMemHandle")
    return int(ptr)


def close_ipc_mem(ptr: int) -> None:
    check(driver.cuIpcCloseMemHandle(ptr), "cuIpcCloseMemHandle")


def ipc_event_handle(event) -> bytes:
    return _handle_bytes(check(driver.cuIpcGetEventHandle(event), "cuIpcGetEventHandle"))


def open_ipc_event(handle: bytes) -> driver.CUevent:
    return check(driver.cuIpcOpenEventHandle(_handle_from(driver.CUipcEventHandle, handle)),
                 "cuIpcOpenEventHandle")


def host_register(address: int, size: int) -> None:
    """Pin and map host memory for every context (PORTABLE | DEVICEMAP)."""
    flags = driver.CU_MEMHOSTREGISTER_PORTABLE | driver.CU_MEMHOSTREGISTER_DEVICEMAP
    check(driver.cuMemHostRegister(address, size, flags), "cuMemHostRegister")


def host_unregister(address: int) -> None:
    check(driver.cuMemHostUnregister(address), "cuMemHostUnregister")


def host_device_pointer(address: int) -> int:
    """The current context's device address of pinned, mapped host memory."""
    return int(check(driver.cuMemHostGetDevicePointer(address, 0), "cuMemHostGetDevicePointer"))


def host_alloc(size: int) -> tuple[int, np.ndarray]:
    """Pinned, mapped, portable host memory: ``(address, uint8 view)``."""
    flags = driver.CU_MEMHOSTALLOC_PORTABLE | driver.CU_MEMHOSTALLOC_DEVICEMAP
    address = int(check(driver.cuMemHostAlloc(size, flags), "cuMemHostAlloc"))
    return address, host_view(address, size)


def host_view(address: int, size: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(address))


def host_free(address: int) -> None:
    check(driver.cuMemFreeHost(address), "cuMemFreeHost")


def device_alloc(size: int) -> int:
    return int(check(driver.cuMemAlloc(size), "cuMemAlloc"))


def device_free(ptr: int) -> None:
    check(driver.cuMemFree(ptr), "cuMemFree")


def memcpy_async(dst: int, src: int, size: int, stream) -> None:
    check(driver.cuMemcpyAsync(dst, src, size, stream), "cuMemcpyAsync")


def synchronize_stream(stream) -> None:
    check(driver.cuStreamSynchronize(stream), "cuStreamSynchronize")


def synchronize_event(event) -> None:
    check(driver.cuEventSynchronize(event), "cuEventSynchronize")


def elapsed_ms(start, end) -> float:
    return check(driver.cuEventElapsedTime(start, end), "cuEventElapsedTime")


def load_function(image: bytes, name: str):
    """Load a cubin into the current context; ``(module, function)``."""
    module = check(driver.cuModuleLoadData(image), "cuModuleLoadData")
    return module, check(driver.cuModuleGetFunction(module, name.encode()), "cuModuleGetFunction")


def launch(function, grid: int, threads: int, stream, params_address: int) -> None:
    """``cuLaunchKernel`` of a 1-D grid; ``params_address`` points at the void* array."""
    check(driver.cuLaunchKernel(function, grid, 1, 1, threads, 1, 1, 0, stream,
                                params_address, 0), "cuLaunchKernel")


def unload_module(module) -> None:
    check(driver.cuModuleUnload(module), "cuModuleUnload")


def destroy_event(event) -> None:
    check(driver.cuEventDestroy(event), "cuEventDestroy")


def destroy_stream(stream) -> None:
    check(driver.cuStreamDestroy(stream), "cuStreamDestroy")
