"""engine.copy.kernel_cache against a fake compiler and loader (no GPU): a kernel compiled
once is loaded from disk by the next start, keyed by what decides its bytes, and a cached
image that does not load, or a cache that cannot be written, costs only a compile."""

from __future__ import annotations

import pytest

from engine.copy import kernel_cache
from pegaflow.platform.errors import CudaError


@pytest.fixture
def compiler(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    state = {"compiles": 0, "arch": (9, 0), "nvrtc": (13, 0)}

    def compile_cubin(source, name, device):
        state["compiles"] += 1
        return f"cubin of {source} for sm_{state['arch'][0]}{state['arch'][1]}".encode()

    monkeypatch.setattr(kernel_cache.nvrtc, "compile_cubin", compile_cubin)
    monkeypatch.setattr(kernel_cache.driver, "compute_capability", lambda device: state["arch"])
    monkeypatch.setattr(kernel_cache.nvrtc, "nvrtc_version", lambda: state["nvrtc"])
    return state


def _load(image: bytes):
    if not image.startswith(b"cubin of "):
        raise CudaError("cuModuleLoadData: CUDA_ERROR_INVALID_IMAGE")
    return image


def test_kernel_cache_second_start_loads_without_compiling(compiler, tmp_path):
    first, cached = kernel_cache.load_kernel("src", "k.cu", 0, _load)
    assert not cached and compiler["compiles"] == 1
    second, cached = kernel_cache.load_kernel("src", "k.cu", 0, _load)
    assert cached and second == first and compiler["compiles"] == 1
    assert len(list((tmp_path / "pegaflow" / "kernels").glob("*.cubin"))) == 1


def test_kernel_cache_another_source_arch_or_nvrtc_compiles_again(compiler):
    kernel_cache.load_kernel("src", "k.cu", 0, _load)
    kernel_cache.load_kernel("src2", "k.cu", 0, _load)
    compiler["arch"] = (10, 0)
    _, cached = kernel_cache.load_kernel("src", "k.cu", 0, _load)
    assert not cached
    compiler["nvrtc"] = (13, 1)
    kernel_cache.load_kernel("src", "k.cu", 0, _load)
    assert compiler["compiles"] == 4


def test_kernel_cache_corrupt_image_is_compiled_again_and_replaced(compiler, tmp_path):
    kernel_cache.load_kernel("src", "k.cu", 0, _load)
    (path,) = (tmp_path / "pegaflow" / "kernels").glob("*.cubin")
    path.write_bytes(b"\x00garbage")
    image, cached = kernel_cache.load_kernel("src", "k.cu", 0, _load)
    assert not cached and image.startswith(b"cubin of src") and compiler["compiles"] == 2
    assert path.read_bytes() == image


def test_kernel_cache_unwritable_directory_still_gives_the_kernel(compiler, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    for _ in range(2):
        image, cached = kernel_cache.load_kernel("src", "k.cu", 0, _load)
        assert image.startswith(b"cubin of src") and not cached
    assert compiler["compiles"] == 2
