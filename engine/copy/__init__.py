"""Copy backends: ``host`` (memcpy between shared-memory buffers) and ``cuda``."""

from __future__ import annotations

from engine.copy.base import CopyBackend


def detect_cuda() -> bool:
    """Whether a CUDA driver with at least one device is usable here."""
    try:
        from cuda.bindings import driver
        err, = driver.cuInit(0)
    except (ImportError, RuntimeError, OSError):  # no cuda-python, or no driver library (libcuda)
        return False
    if err != driver.CUresult.CUDA_SUCCESS:
        return False
    err, count = driver.cuDeviceGetCount()
    return err == driver.CUresult.CUDA_SUCCESS and count > 0


def make_backend(kind: str, copy_backend: str = "auto") -> CopyBackend:
    """``kind``: auto | cuda | host; auto means cuda when a GPU is present."""
    if kind == "auto":
        kind = "cuda" if detect_cuda() else "host"
    if kind == "cuda":
        from engine.copy.cuda import CudaBackend
        return CudaBackend(copy_backend=copy_backend)
    from engine.copy.host import HostBackend
    return HostBackend()
