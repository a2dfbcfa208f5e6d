"""NVRTC: the copy kernel's source compiled into a cubin for a device's architecture
(loaded by ``driver.load_function``)."""

from __future__ import annotations

from cuda.bindings import nvrtc

from pegaflow.platform.cuda.driver import check, compute_capability
from pegaflow.platform.errors import CudaError

NVRTC_OPTIONS = ("-default-device", "--std=c++17", "-lineinfo")  # and the GPU's architecture


def nvrtc_version() -> tuple[int, int]:
    major, minor = check(nvrtc.nvrtcVersion(), "nvrtcVersion")
    return int(major), int(minor)


def compile_cubin(source: str, name: str, device: int) -> bytes:
    """NVRTC-compile ``source`` for ``device``'s architecture into a cubin."""
    major, minor = compute_capability(device)
    prog = check(nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], []),
                 "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture=sm_{major}{minor}".encode(), *(o.encode() for o in NVRTC_OPTIONS)]
        (status,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if int(status) != 0:
            size = check(nvrtc.nvrtcGetProgramLogSize(prog))
            log = b" " * size
            check(nvrtc.nvrtcGetProgramLog(prog, log))
            raise CudaError(f"NVRTC failed on {name} (sm_{major}{minor}): "
                            f"{log.decode(errors='replace')}")
        size = check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = b" " * size
        check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return cubin
    finally:
        check(nvrtc.nvrtcDestroyProgram(prog), "nvrtcDestroyProgram")
