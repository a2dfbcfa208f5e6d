"""The gather/scatter kernel (NVRTC source, compile, launch) and its staging ring.

One launch copies one layer's pages of one op between a client's GPU memory and the
pinned, mapped pool, reading or writing host memory directly over PCIe::

    client page k = client_base + block_ids[k] * client_stride
    pool page k   = pool_base + entry_offsets[k]          (pool_base includes l * page_bytes)

or, for the staged path (``staged.py``), the pages of ``num_layers`` layers between client
memory and a device staging slot, layer j's addresses stepping by ``j * client_layer_stride``
and ``j * pool_layer_stride``.

``block_ids`` and ``entry_offsets`` are int64 arrays in a mapped pinned staging ring that
every layer of the op shares; each CTA loads the ids of up to 512 of its pages into
shared memory with one PCIe round trip.  The grid is persistent and small so decode
keeps its SMs (16 CTAs of 512 threads give what any CTA count gives, near a DMA copy's
bandwidth: docs/benchmarks.md, "Figures behind the engine's constants"); each thread moves
16-byte words with streaming (evict-first) loads and stores, eight loads in flight
before its stores.
"""

from __future__ import annotations

import collections
import ctypes
import logging

import numpy as np

from pegaflow.platform.cuda import driver
from pegaflow.platform.errors import CudaError

from .kernel_cache import load_kernel

logger = logging.getLogger(__name__)

THREADS = 512
KERNEL_NAME = "pegaflow_copy_pages"
ALIGN_BYTES = 16

SOURCE = r"""
struct CopyArgs {
  const long long* block_ids;
  const long long* entry_offsets;
  unsigned long long client_base;
  long long client_stride;
  unsigned long long pool_base;
  long long page_bytes;
  long long client_layer_stride;
  long long pool_layer_stride;
  int num_pages;
  int num_layers;
  int to_pool;
  int unused;
};

#define THREADS 512
#define UNROLL 8

__device__ __forceinline__ void copy_page(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                          long long num_words) {
  for (long long first = threadIdx.x; first < num_words; first += THREADS * UNROLL) {
    uint4 r[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const long long i = first + (long long)u * THREADS;
      if (i < num_words) r[u] = __ldcs(src + i);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const long long i = first + (long long)u * THREADS;
      if (i < num_words) __stcs(dst + i, r[u]);
    }
  }
}

extern "C" __global__ void __launch_bounds__(THREADS) pegaflow_copy_pages(const CopyArgs a) {
  __shared__ long long s_client[THREADS];
  __shared__ long long s_pool[THREADS];
  const long long num_words = a.page_bytes >> 4;
  const long long grid = gridDim.x;
  const long long total = (long long)a.num_pages * a.num_layers;  // layer-major (layer, page)
  for (long long first = blockIdx.x; first < total; first += grid * THREADS) {
    const long long p = first + threadIdx.x * grid;
    if (p < total) {
      const long long layer = p / a.num_pages;
      const long long page = p - layer * a.num_pages;
      s_client[threadIdx.x] = a.block_ids[page] * a.client_stride + layer * a.client_layer_stride;
      s_pool[threadIdx.x] = a.entry_offsets[page] + layer * a.pool_layer_stride;
    }
    __syncthreads();
    const int count = (int)min((long long)THREADS, (total - first + grid - 1) / grid);
    for (int k = 0; k < count; ++k) {
      char* client = (char*)(a.client_base + s_client[k]);
      char* pool = (char*)(a.pool_base + s_pool[k]);
      if (a.to_pool) copy_page((const uint4*)client, (uint4*)pool, num_words);
      else copy_page((const uint4*)pool, (uint4*)client, num_words);
    }
    __syncthreads();
  }
}
"""


class _CopyArgs(ctypes.Structure):
    _fields_ = [
        ("block_ids", ctypes.c_uint64),
        ("entry_offsets", ctypes.c_uint64),
        ("client_base", ctypes.c_uint64),
        ("client_stride", ctypes.c_int64),
        ("pool_base", ctypes.c_uint64),
        ("page_bytes", ctypes.c_int64),
        ("client_layer_stride", ctypes.c_int64),
        ("pool_layer_stride", ctypes.c_int64),
        ("num_pages", ctypes.c_int32),
        ("num_layers", ctypes.c_int32),
        ("to_pool", ctypes.c_int32),
        ("unused", ctypes.c_int32),
    ]


assert ctypes.sizeof(_CopyArgs) == 80


def is_aligned(*values: int) -> bool:
    """Whether every address, stride and size allows the kernel's 16-byte words."""
    acc = 0
    for v in values:
        acc |= int(v)
    return acc % ALIGN_BYTES == 0


class CopyKernel:
    """The compiled kernel in one device's context, with a reusable parameter block."""

    def __init__(self, device: int, num_ctas: int) -> None:
        self.num_ctas = num_ctas
        (self._module, self._function), cached = load_kernel(
            SOURCE, "pegaflow_copy.cu", device, lambda cubin: driver.load_function(cubin, KERNEL_NAME))
        self._args = _CopyArgs()
        self._params = (ctypes.c_void_p * 1)(ctypes.addressof(self._args))
        logger.info("%s %s for device %d", "loaded the kept" if cached else "compiled", KERNEL_NAME, device)

    def launch(self, stream, ids_ptr: int, offsets_ptr: int, num_pages: int, client_base: int,
               client_stride: int, pool_base: int, page_bytes: int, to_pool: bool,
               num_layers: int = 1, client_layer_stride: int = 0,
               pool_layer_stride: int = 0) -> None:
        """Enqueue one layer's copy, or ``num_layers`` layers' whose client and pool
        addresses step by the given strides; the driver copies the parameter block at
        launch."""
        a = self._args
        a.block_ids, a.entry_offsets, a.num_pages = ids_ptr, offsets_ptr, num_pages
        a.client_base, a.client_stride = client_base, client_stride
        a.pool_base, a.page_bytes, a.to_pool = pool_base, page_bytes, int(to_pool)
        a.num_layers, a.client_layer_stride = num_layers, client_layer_stride
        a.pool_layer_stride = pool_layer_stride
        grid = max(1, min(self.num_ctas, num_pages * num_layers))
        driver.launch(self._function, grid, THREADS, stream, ctypes.addressof(self._params))

    def close(self) -> None:
        driver.unload_module(self._module)


class StagingRing:
    """A first-in, first-out allocator of int64 words in pinned, mapped host memory.

    Ops take a slice for their ids at submit and give it back when they complete, in any
    order; space is reused once every older slice is back.
    """

    def __init__(self, num_words: int) -> None:
        self.num_words = num_words
        self._address, raw = driver.host_alloc(num_words * 8)
        self.words = raw.view(np.int64)
        self._head = 0
        self._live: collections.deque[list] = collections.deque()  # [start, end, is_free]

    def address(self, word: int) -> int:
        """Where kernels read word ``word`` (unified addressing: the host address)."""
        return self._address + 8 * word

    def try_alloc(self, num_words: int) -> list | None:
        """A slice ``[start, end, is_free]`` of ``num_words`` words, or None if full."""
        start = self._fit(num_words)
        if start is None:
            return None
        self._head = start + num_words
        entry = [start, start + num_words, False]
        self._live.append(entry)
        return entry

    def _fit(self, n: int) -> int | None:
        if n > self.num_words:
            return None
        if not self._live:
            return 0
        tail = self._live[0][0]
        if self._head > tail:  # free space is [head, end) and [0, tail)
            if self._head + n <= self.num_words:
                return self._head
            return 0 if n <= tail else None
        return self._head if self._head + n <= tail else None  # wrapped: [head, tail)

    def free(self, entry: list) -> None:
        entry[2] = True
        while self._live and self._live[0][2]:
            self._live.popleft()

    def close(self) -> None:
        if self._live:
            raise CudaError(f"staging ring closed with {len(self._live)} slices in use")
        self.words = None
        driver.host_free(self._address)
