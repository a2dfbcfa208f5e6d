"""The engine's one frozen config: flags first, then ``PEGAFLOW_*`` env vars, then defaults."""

from __future__ import annotations

import argparse
import math
import os
import re
from dataclasses import dataclass

from engine.copy.base import DEVICE_STAGING_BYTES, PATHS as COPY_PATHS
from pegaflow.connector.config import as_bool
from pegaflow.errors import ConfigError
from pegaflow.shm import check_engine_name

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30, "t": 1 << 40,
          "tb": 1000**4, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """'4GiB' -> 4294967296; plain numbers are bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"size {text!r}: expected a number with an optional unit like 512MiB or 4GiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


MAX_SLOTS = 4096
MAX_IDLE_SPIN_S = 1.0


@dataclass(frozen=True, slots=True)
class EngineConfig:
    name: str = "pegaflow"
    pool_bytes: int = 4 << 30
    slab_bytes: int = 64 << 20
    backend: str = "auto"
    copy_backend: str = "auto"
    device_staging_bytes: int = DEVICE_STAGING_BYTES
    log_level: str = "INFO"
    num_slots: int = 64
    ring_slots: int = 1024
    arena_bytes: int = 8 << 20
    lease_ttl_s: float = 120.0
    idle_spin_s: float = 2e-3
    keep_pool: bool = False
    housekeeping_s: float = 1.0

    def __post_init__(self) -> None:
        check_engine_name(self.name)
        if self.pool_bytes <= 0:
            raise ConfigError(f"--pool-size must be positive, got {self.pool_bytes}")
        if self.slab_bytes <= 0:
            raise ConfigError(f"--slab-size must be positive, got {self.slab_bytes}")
        if self.slab_bytes > self.pool_bytes:
            raise ConfigError(f"--slab-size {self.slab_bytes} exceeds --pool-size {self.pool_bytes}")
        if self.backend not in ("auto", "cuda", "host"):
            raise ConfigError(f"--backend {self.backend!r}: choose auto, cuda or host")
        if self.device_staging_bytes < 0:
            raise ConfigError(f"--device-staging {self.device_staging_bytes}: must not be negative")
        if self.copy_backend == "staged" and not self.device_staging_bytes:
            raise ConfigError("--copy-backend staged needs --device-staging above 0")
        if self.copy_backend not in COPY_PATHS:
            raise ConfigError(f"--copy-backend {self.copy_backend!r}: choose {', '.join(COPY_PATHS)}")
        if not 1 <= self.num_slots <= MAX_SLOTS:
            raise ConfigError(f"--max-clients {self.num_slots}: must lie in [1, {MAX_SLOTS}]")
        if self.ring_slots < 2:
            raise ConfigError(f"--ring-slots {self.ring_slots}: must be at least 2")
        if self.arena_bytes < 4096:
            raise ConfigError(f"--arena-size {self.arena_bytes} bytes: must be at least 4KiB")
        if self.log_level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(f"--log-level {self.log_level!r}: choose DEBUG, INFO, WARNING or ERROR")
        if not 0 < self.lease_ttl_s < math.inf:  # nan fails too: it never expires anything
            raise ConfigError(f"--lease-ttl must be a positive number of seconds, got {self.lease_ttl_s}")
        if not 0 <= self.idle_spin_s <= MAX_IDLE_SPIN_S:
            raise ConfigError(f"--idle-spin-ms {self.idle_spin_s * 1e3:g}: must lie in "
                              f"[0, {MAX_IDLE_SPIN_S * 1e3:g}]")

    @property
    def usable_pool_bytes(self) -> int:
        """The pool holds whole slabs: what is allocated of ``pool_bytes``."""
        return self.pool_bytes // self.slab_bytes * self.slab_bytes


def _env(name: str, default: str) -> str:
    return os.environ.get(f"PEGAFLOW_{name}", default)


def _env_number(name: str, default, kind):
    raw = os.environ.get(f"PEGAFLOW_{name}")
    if raw is None:
        return default
    try:
        return kind(raw)
    except ValueError as exc:
        raise ConfigError(f"PEGAFLOW_{name}={raw!r}: expected a number") from exc


def _env_flag(name: str, default: bool) -> bool:
    raw = os.environ.get(f"PEGAFLOW_{name}")
    if raw is None:
        return default
    return bool(raw.strip()) and as_bool(f"PEGAFLOW_{name}", raw)  # set but empty: off


def build_parser() -> argparse.ArgumentParser:
    d = EngineConfig()
    p = argparse.ArgumentParser(
        prog="python -m engine",
        description="pegaflow engine: keeps vLLM KV blocks in pinned host memory shared by "
                    "every vLLM on this host.")
    p.add_argument("--name", default=_env("NAME", d.name),
                   help="engine name; clients attach by it (env PEGAFLOW_NAME; default %(default)s)")
    p.add_argument("--pool-size", default=_env("POOL_SIZE", "4GiB"),
                   help="host memory for KV blocks, e.g. 512MiB, 64GiB (env PEGAFLOW_POOL_SIZE; default %(default)s)")
    p.add_argument("--slab-size", default=_env("SLAB_SIZE", "64MiB"),
                   help="pool allocation unit per block size; clamped to the pool size (default %(default)s)")
    p.add_argument("--backend", choices=["auto", "cuda", "host"], default=_env("BACKEND", d.backend),
                   help="auto: cuda when a GPU is present, else host (default %(default)s)")
    p.add_argument("--copy-backend", choices=COPY_PATHS,
                   default=_env("COPY_BACKEND", d.copy_backend),
                   help="cuda copy path: kernel (SMs read and write the pool over PCIe), "
                        "copy-engine (one DMA per page), staged (pages packed in device "
                        "memory, one DMA per run of pool entries); auto stages what it can "
                        "and picks between the others by a measurement per page size "
                        "(default %(default)s)")
    p.add_argument("--device-staging", default=_env("DEVICE_STAGING", f"{DEVICE_STAGING_BYTES >> 20}MiB"),
                   help="GPU memory the staged path takes on each GPU the engine serves "
                        "(two slots each way); 0 turns it off (env PEGAFLOW_DEVICE_STAGING; "
                        "default %(default)s)")
    p.add_argument("--max-clients", type=int, default=_env_number("MAX_CLIENTS", d.num_slots, int),
                   help="client slots (one per vLLM scheduler or worker; default %(default)s)")
    p.add_argument("--ring-slots", type=int, default=d.ring_slots, help="commands per ring (default %(default)s)")
    p.add_argument("--arena-size", default="8MiB", help="payload arena per client (default %(default)s)")
    p.add_argument("--lease-ttl", type=float, default=_env_number("LEASE_TTL_S", d.lease_ttl_s, float),
                   help="seconds a lookup's lease pins its blocks if never used (default %(default)s)")
    p.add_argument("--idle-spin-ms", type=float,
                   default=_env_number("IDLE_SPIN_MS", d.idle_spin_s * 1e3, float),
                   help="after its last work the engine polls this long before sleeping: a "
                        "command arriving later first wakes it (0.1-2 ms on a VM), one arriving "
                        "sooner costs a busy core meanwhile (default %(default)g)")
    p.add_argument("--keep-pool", action=argparse.BooleanOptionalAction,
                   default=_env_flag("KEEP_POOL", d.keep_pool),
                   help="leave the pool and its table in /dev/shm when the engine stops (or "
                        "dies), and take in the blocks a kept pool of the same size holds at "
                        "start: the cache outlives an engine restart; the pool's memory stays "
                        "in use while no engine runs (env PEGAFLOW_KEEP_POOL; default off)")
    p.add_argument("--log-level", default=_env("LOG_LEVEL", d.log_level), type=str.upper,
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="default %(default)s")
    return p


def config_from_args(argv: list[str] | None = None) -> EngineConfig:
    args = build_parser().parse_args(argv)
    pool_bytes = parse_size(args.pool_size)
    return EngineConfig(
        name=args.name, pool_bytes=pool_bytes,
        slab_bytes=min(parse_size(args.slab_size), pool_bytes),
        backend=args.backend, copy_backend=args.copy_backend,
        device_staging_bytes=parse_size(args.device_staging), log_level=args.log_level.upper(),
        num_slots=args.max_clients, ring_slots=args.ring_slots,
        arena_bytes=parse_size(args.arena_size), lease_ttl_s=args.lease_ttl,
        idle_spin_s=args.idle_spin_ms / 1e3, keep_pool=args.keep_pool)
