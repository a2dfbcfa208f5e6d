"""tools/lib/gpu.py: the one place a benchmark reads the GPU's name."""

from __future__ import annotations

import pytest

import engine.copy
from tools.lib.gpu import NO_GPU, gpu_name


def test_gpu_name_without_a_usable_driver_is_none(monkeypatch):
    monkeypatch.setattr(engine.copy, "detect_cuda", lambda: False)
    assert gpu_name() == NO_GPU == "none"


def test_gpu_name_is_the_drivers_name_of_the_device_asked(monkeypatch):
    # 1. A driver with devices: the name is the driver's, of the device asked (0 by default).
    from pegaflow.platform.cuda import driver
    monkeypatch.setattr(engine.copy, "detect_cuda", lambda: True)
    monkeypatch.setattr(driver, "device_name", lambda device: f"NVIDIA H200 #{device}")
    assert gpu_name() == "NVIDIA H200 #0"
    assert gpu_name(1) == "NVIDIA H200 #1"


@pytest.mark.gpu
def test_gpu_name_on_a_gpu_is_torchs_name_of_cuda_0():
    # The name the benchmarks recorded before (torch's) and the driver's are the same string.
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    assert gpu_name() == torch.cuda.get_device_name(0)
