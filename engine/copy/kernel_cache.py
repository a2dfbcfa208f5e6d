"""Compiled copy kernels kept on disk between engine starts.

NVRTC takes a good part of a second to compile the copy kernel, which every start would
otherwise spend before it serves.  A cubin is kept under ``$XDG_CACHE_HOME/pegaflow/kernels``
(``~/.cache`` when unset), named by a hash of everything that decides its bytes: the source,
its name, the compile options, the GPU's architecture and NVRTC's version.  A cached image
the driver will not load is compiled again and replaced; a cache that cannot be read or
written costs only the compile.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

from pegaflow.platform.cuda import driver, nvrtc
from pegaflow.platform.errors import CudaError

logger = logging.getLogger(__name__)


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pegaflow" / "kernels"


def _key(source: str, name: str, device: int) -> str:
    major, minor = driver.compute_capability(device)
    parts = [source, name, " ".join(nvrtc.NVRTC_OPTIONS), f"sm_{major}{minor}",
             "nvrtc %d.%d" % nvrtc.nvrtc_version()]
    return hashlib.blake2b("\0".join(parts).encode(), digest_size=16).hexdigest()


def load_kernel(source: str, name: str, device: int, load: Callable[[bytes], object]):
    """``load(cubin)`` of ``source`` compiled for ``device``, from the cache when it holds
    it; what ``load`` returns, and whether the compile was spared."""
    path = cache_dir() / f"{name}-{_key(source, name, device)}.cubin"
    try:
        cached = path.read_bytes()
    except FileNotFoundError:
        cached = None
    except OSError as exc:
        logger.debug("kernel cache %s unreadable (%s): compiling", path, exc)
        cached = None
    if cached:
        try:
            return load(cached), True
        except CudaError as exc:
            logger.warning("cached kernel %s does not load (%s): compiling it again", path, exc)
    cubin = nvrtc.compile_cubin(source, name, device)
    loaded = load(cubin)
    _store(path, cubin)
    return loaded, False


def _store(path: Path, cubin: bytes) -> None:
    """Written under another name, then renamed: a reader never sees half a cubin."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(cubin)
        os.replace(tmp, path)
    except OSError as exc:
        logger.info("cannot keep the compiled kernel in %s (%s): the next start compiles it "
                    "again", path.parent, exc)
        try:
            tmp.unlink()
        except OSError:  # never written (no directory), or not ours to remove
            logger.debug("left %s as it is", tmp)
