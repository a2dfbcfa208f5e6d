"""The name of the GPU a benchmark ran on, the one line every benchmark's JSON records.

Read through the CUDA driver (``cuDeviceGetName`` of device 0, after ``cuInit``): no torch
import and no CUDA context, so a bench's parent process can ask it beside the vLLM processes
it runs without taking GPU memory from them.  Device 0 is the first of ``CUDA_VISIBLE_DEVICES``,
the one torch and vLLM call ``cuda:0``.  A machine with no usable driver or no device: ``"none"``.
"""

from __future__ import annotations

NO_GPU = "none"


def gpu_name(device: int = 0) -> str:
    from engine.copy import detect_cuda
    if not detect_cuda():
        return NO_GPU
    from pegaflow.platform.cuda import driver
    return driver.device_name(device)
