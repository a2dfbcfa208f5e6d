"""Copy backends: ``host`` (memcpy between shared-memory buffers) and ``cuda``."""

from __future__ import annotations

import logging

from .base import DEVICE_STAGING_BYTES, CopyBackend

logger = logging.getLogger(__name__)


def detect_cuda() -> bool:
    """Whether a CUDA driver with at least one device is usable here."""
    try:
        from cuda.bindings import driver
        err, = driver.cuInit(0)
    except (ImportError, RuntimeError, OSError) as exc:  # no cuda-python, or no libcuda
        logger.info("no usable CUDA driver (%s: %s)", type(exc).__name__, exc)
        return False
    if err != driver.CUresult.CUDA_SUCCESS:
        logger.info("no usable CUDA driver (cuInit: %s)", err.name)
        return False
    err, count = driver.cuDeviceGetCount()
    return err == driver.CUresult.CUDA_SUCCESS and count > 0


def make_backend(kind: str, copy_backend: str = "auto",
                 device_staging_bytes: int = DEVICE_STAGING_BYTES, hold_saves: bool = False,
                 load_layer_groups: int = 1) -> CopyBackend:
    """``kind``: auto | cuda | host; auto means cuda when a GPU is present.
    ``device_staging_bytes``: GPU memory of the cuda backend's staged path; ``hold_saves``:
    its SAVEs held until their data is written (``held_saves.py``); ``load_layer_groups``: a
    fenced staged LOAD signalled a layer group at a time (``staged.py``)."""
    if kind == "auto":
        kind = "cuda" if detect_cuda() else "host"
    if kind == "cuda":
        from .cuda import CudaBackend
        return CudaBackend(copy_backend=copy_backend, device_staging_bytes=device_staging_bytes,
                           hold_saves=hold_saves, load_layer_groups=load_layer_groups)
    from .host import HostBackend
    return HostBackend()
