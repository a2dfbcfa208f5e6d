"""Copy backends: ``host`` (memcpy between shared-memory buffers) and ``cuda``."""

from __future__ import annotations

from .base import DEVICE_STAGING_BYTES, CopyBackend


def cuda_unusable_reason() -> str | None:
    """Why no CUDA device is usable here (no cuda-python, no driver, no device), or None
    when one is."""
    try:
        from cuda.bindings import driver
        err, = driver.cuInit(0)
    except (ImportError, RuntimeError, OSError) as exc:  # no cuda-python, or no libcuda
        return f"no usable CUDA driver ({type(exc).__name__}: {exc})"
    if err != driver.CUresult.CUDA_SUCCESS:
        return f"no usable CUDA driver (cuInit: {err.name})"
    err, count = driver.cuDeviceGetCount()
    if err != driver.CUresult.CUDA_SUCCESS:
        return f"the CUDA driver lists no device (cuDeviceGetCount: {err.name})"
    return None if count > 0 else "the CUDA driver sees no device"


def detect_cuda() -> bool:
    """Whether a CUDA driver with at least one device is usable here."""
    return cuda_unusable_reason() is None


def make_backend(kind: str, copy_backend: str = "auto",
                 device_staging_bytes: int = DEVICE_STAGING_BYTES, hold_saves: bool = False,
                 load_layer_groups: int = 1) -> CopyBackend:
    """``kind``: cuda | host (the engine's start resolves ``--backend auto``).
    ``device_staging_bytes``: GPU memory of the cuda backend's staged path; ``hold_saves``:
    its SAVEs held until their data is written (``held_saves.py``); ``load_layer_groups``: a
    fenced staged LOAD signalled a layer group at a time (``staged.py``)."""
    if kind == "cuda":
        from .cuda import CudaBackend
        return CudaBackend(copy_backend=copy_backend, device_staging_bytes=device_staging_bytes,
                           hold_saves=hold_saves, load_layer_groups=load_layer_groups)
    from .host import HostBackend
    return HostBackend()
