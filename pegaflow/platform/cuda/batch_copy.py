"""Many page copies in one driver call (``cuMemcpyBatchAsync``), or one ``cuMemcpyAsync``
per page where the driver lacks it; ``driver.memcpy_batch_async`` is this."""

from __future__ import annotations

import ctypes
import logging

import numpy as np
from cuda.bindings import driver

from pegaflow.platform.cuda.results import check
from pegaflow.platform.errors import CudaError

logger = logging.getLogger(__name__)


class _BatchCopy:
    """``cuMemcpyBatchAsync`` resolved as a C function, so address arrays pass as pointers.

    Building one ``CUdeviceptr`` object per page in Python costs milliseconds per call
    (FACTS); through ctypes the numpy arrays go in as they are.  CUDA 13 dropped the
    ``failIdx`` argument of the 12.8 signature; ``cuGetProcAddress`` picks by ABI version.
    """

    def __init__(self) -> None:
        version = check(driver.cuDriverGetVersion(), "cuDriverGetVersion")
        self.takes_fail_index = version < 13000
        self.fn = self._resolve(version) if version >= 12080 else None
        if self.fn is None:
            logger.warning("cuMemcpyBatchAsync unavailable (driver %d): the copy-engine path "
                           "issues one cuMemcpyAsync per page", version)
        self.attrs = driver.CUmemcpyAttributes()
        self.attrs.srcAccessOrder = driver.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        self.attrs.flags = driver.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
        self.attr_index = (ctypes.c_size_t * 1)(0)
        self.fail_index = ctypes.c_size_t(0)

    def _resolve(self, version: int):
        abi = 12080 if self.takes_fail_index else 13000
        flags = driver.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
        pfn, status = check(driver.cuGetProcAddress(b"cuMemcpyBatchAsync", abi, flags),
                            "cuGetProcAddress")
        found = driver.CUdriverProcAddressQueryResult.CU_GET_PROC_ADDRESS_SUCCESS
        if status != found or not int(pfn):
            return None
        p = ctypes.c_void_p
        args = [p, p, p, ctypes.c_size_t, p, p, ctypes.c_size_t]
        args += [p, p] if self.takes_fail_index else [p]
        return ctypes.CFUNCTYPE(ctypes.c_int, *args)(int(pfn))

    def __call__(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream) -> None:
        args = [dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, len(dsts),
                self.attrs.getPtr(), ctypes.addressof(self.attr_index), 1]
        if self.takes_fail_index:
            args.append(ctypes.addressof(self.fail_index))
        status = self.fn(*args, int(stream))
        if status != 0:
            raise CudaError(f"cuMemcpyBatchAsync: {driver.CUresult(status).name}")


_batch_copy: _BatchCopy | None = None


def memcpy_batch_async(dsts: np.ndarray, srcs: np.ndarray, size, stream) -> None:
    """Copy ``size`` bytes (one int for all, or an array) from each ``srcs[i]`` to
    ``dsts[i]`` (address arrays) on ``stream``.

    One ``cuMemcpyBatchAsync`` (sources read in stream order; it needs a non-default
    stream).  The arrays are read during the call only.
    """
    global _batch_copy
    if _batch_copy is None:
        _batch_copy = _BatchCopy()
    dsts = np.ascontiguousarray(dsts, dtype=np.uint64)
    srcs = np.ascontiguousarray(srcs, dtype=np.uint64)
    sizes = np.broadcast_to(np.asarray(size, dtype=np.uint64), dsts.shape)
    if _batch_copy.fn is not None:
        _batch_copy(dsts, srcs, np.ascontiguousarray(sizes), stream)
        return
    for dst, src, num_bytes in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
        check(driver.cuMemcpyAsync(dst, src, num_bytes, stream), "cuMemcpyAsync")
