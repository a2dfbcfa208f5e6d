"""engine/startup.py: the backend --backend resolves to, and what the start says of the pool's
geometry and of the engine's /dev/shm."""

from __future__ import annotations

import itertools
import logging
import os

import pytest

import engine.copy
from engine.config import EngineConfig
from engine.options import config_from_args
from engine.server import EngineServer
from engine.startup import backend_kind
from pegaflow.platform.errors import CudaError
from pegaflow.platform.values import format_size
from tests.conftest import shm_leftovers

_names = itertools.count()


def _started(caplog, *argv: str) -> list[logging.LogRecord]:
    """The engine's log records from start to stop, started from ``argv`` in this process."""
    name = f"t{os.getpid()}_start{next(_names)}"
    config = config_from_args(["--name", name, "--backend", "host", "--pin-threads", "1", *argv],
                              environ={})
    with caplog.at_level(logging.INFO, logger="engine"):
        server = EngineServer(config)
        server.shutdown()
    assert shm_leftovers(name) == []
    return [r for r in caplog.records if r.name.startswith("engine")]


def test_startup_pool_too_small_for_any_block_warns_to_raise_the_pool(caplog):
    # 1. `--pool-size 1KiB`: the slab is clamped to the pool, so no model's block fits;
    #    the start says so, and that it is the pool to raise (a larger slab cannot be).
    warnings = [r.getMessage() for r in _started(caplog, "--pool-size", "1KiB")
                if r.levelno == logging.WARNING]
    said = [w for w in warnings if "REGISTER will be refused" in w]
    assert len(said) == 1, warnings
    assert "1.0 KiB" in said[0] and "raise --pool-size" in said[0]


def test_startup_slab_too_small_for_any_block_warns_to_raise_the_slab(caplog):
    # 1. A pool of many slabs of 16 KiB: the slab is the one to raise.
    records = _started(caplog, "--pool-size", "1MiB", "--slab-size", "16KiB")
    said = [r.getMessage() for r in records if "REGISTER will be refused" in r.getMessage()]
    assert len(said) == 1 and "raise --slab-size" in said[0] and "--pool-size" not in said[0], said


def test_startup_pool_with_room_for_a_block_gives_no_such_warning(caplog):
    records = _started(caplog, "--pool-size", "4MiB", "--slab-size", "1MiB")
    assert not [r for r in records if "REGISTER will be refused" in r.getMessage()]


def test_startup_states_the_dev_shm_it_takes_in_one_info_line(caplog):
    # 1. An engine of 2 client slots with 64 KiB arenas (and 1024-record rings), a 4 MiB pool.
    name = f"t{os.getpid()}_shm{next(_names)}"
    config = config_from_args(["--name", name, "--backend", "host", "--pool-size", "4MiB",
                               "--slab-size", "1MiB", "--max-clients", "2", "--arena-size", "64KiB"],
                              environ={})
    with caplog.at_level(logging.INFO, logger="engine"):
        server = EngineServer(config)
    try:
        # 2. What its segments take in /dev/shm, file by file (semaphores aside).
        prefix = f"pegaflow.{os.getuid()}.{name}."
        sizes = {e[len(prefix):]: os.stat(f"/dev/shm/{e}").st_size for e in os.listdir("/dev/shm")
                 if e.startswith(prefix)}
    finally:
        server.shutdown()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("/dev/shm")]
    # 3. One INFO line says the total, the pool and the rings, as the files are.
    assert len(lines) == 1, lines
    rings = sum(size for what, size in sizes.items() if what.startswith("ring."))
    assert lines[0].startswith(f"/dev/shm: {format_size(sum(sizes.values()))} for engine {name!r}")
    assert f"pool {format_size(sizes['pool'])}" in lines[0]
    assert f"2 client rings of {format_size(sizes['ring.0'])} ({format_size(rings)}" in lines[0]


def test_backend_kind_auto_without_a_gpu_is_host_with_a_warning_saying_why(monkeypatch, caplog):
    # 1. No usable GPU (as in a container not given one): auto takes the host backend, and
    #    says so at WARNING with the reason, not at INFO where it goes unseen.
    monkeypatch.setattr(engine.copy, "cuda_unusable_reason", lambda: "the CUDA driver sees no device")
    with caplog.at_level(logging.INFO, logger="engine"):
        assert backend_kind(EngineConfig(backend="auto")) == "host"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "sees no device" in warnings[0] and "--backend host" in warnings[0]


def test_backend_kind_cuda_without_a_gpu_refuses_to_start(monkeypatch):
    monkeypatch.setattr(engine.copy, "cuda_unusable_reason", lambda: "no usable CUDA driver (x)")
    with pytest.raises(CudaError, match=r"--backend cuda, but no GPU is usable here: no usable CUDA"):
        backend_kind(EngineConfig(backend="cuda"))


def test_backend_kind_with_a_gpu_is_cuda_and_host_is_host(monkeypatch, caplog):
    monkeypatch.setattr(engine.copy, "cuda_unusable_reason", lambda: None)
    with caplog.at_level(logging.INFO, logger="engine"):
        assert [backend_kind(EngineConfig(backend=b)) for b in ("auto", "cuda", "host")] == \
            ["cuda", "cuda", "host"]
    assert not caplog.records


@pytest.mark.skipif(engine.copy.cuda_unusable_reason() is None, reason="a GPU is usable here")
def test_startup_auto_backend_on_a_host_without_a_gpu_warns(caplog):
    # 1. This host has no usable GPU: the engine starts with the host backend, with a WARNING.
    records = _started(caplog, "--backend", "auto", "--pool-size", "4MiB", "--slab-size", "1MiB")
    said = [r for r in records if "--backend auto: no usable GPU here" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
