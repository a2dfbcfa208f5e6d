"""The engine's one frozen config, validated at construction: flags first, then
``PEGAFLOW_*`` env vars, then defaults (``options.py`` reads them).

Every option is one row of ``options.OPTIONS``: its flag, env var, default and help are
made from that row, so the three cannot drift (a test compares them, and the README's table).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pegaflow.platform.errors import ConfigError
from pegaflow.platform.shm import check_engine_name
from pegaflow.platform.values import format_size

from .copy.base import DEVICE_STAGING_BYTES
from .copy.base import PATHS as COPY_PATHS

MAX_SLOTS = 4096
MAX_IDLE_SPIN_S = 1.0
MAX_LOOKUP_WAIT_S = 10.0
MAX_PIN_THREADS = 256
MAX_DISK_THREADS = 256
MAX_LEASE_TTL_S = 86400.0  # a lease pins its blocks at most a day (past that it is a leak)
MAX_REMOTE_TIMEOUT_S = 2.0  # a LOOKUP waits this long for the store at most (the connector's own wait is 5 s)
MAX_REMOTE_START_TIMEOUT_S = 600.0
DISK_ADMISSIONS = ("evicted", "reused", "all")
REMOTE_KINDS = ("off", "mooncake")
REMOTE_PROTOCOLS = ("tcp", "rdma")
REMOTE_PUBLISH = ("all", "reused")
# Pinned before the engine serves, and the unit pinned in the background: small enough to
# pin well inside a 1 s start, large enough that a 64 GiB pool is 256 registrations
# (docs/benchmarks.md, "Figures behind the engine's constants").
PIN_CHUNK_BYTES = 256 << 20
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
BACKENDS = ("auto", "cuda", "host")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    name: str = "pegaflow"
    pool_bytes: int = 4 << 30
    slab_bytes: int = 64 << 20
    backend: str = "auto"
    copy_backend: str = "auto"
    device_staging_bytes: int = DEVICE_STAGING_BYTES
    hold_saves: bool = False  # cuda: a SAVE waits in the engine, not a copy stream (held_saves.py)
    load_layer_groups: int = 1  # cuda: a fenced staged LOAD's events a layer group at a time (staged.py)
    log_level: str = "INFO"
    num_slots: int = 64
    ring_slots: int = 1024
    arena_bytes: int = 8 << 20
    lease_ttl_s: float = 120.0
    idle_spin_s: float = 2e-3
    keep_pool: bool = False
    pin_chunk_bytes: int = PIN_CHUNK_BYTES
    pin_threads: int = 0  # 0: one per core, up to 16
    pin_rate_bytes: int = 0  # bytes a second; 0: no limit
    housekeeping_s: float = 1.0
    disk_paths: tuple[str, ...] = ()  # the disk tier's directories (none: no disk tier)
    disk_bytes: int = 0  # per path; 0: 90 % of the path's free space at start
    disk_admission: str = "evicted"
    disk_threads: int = 8
    remote: str = "off"  # the remote tier's store (off: none)
    remote_master: str = "127.0.0.1:50051"  # the store's master, host:port
    remote_metadata: str = "http://127.0.0.1:8080/metadata"  # its metadata server
    remote_protocol: str = "tcp"
    remote_device: str = ""  # RDMA devices (rdma only; empty: the store picks)
    remote_host: str = ""  # the address other hosts reach this engine at (empty: the one routed to the master)
    remote_segment_bytes: int = 1 << 30  # memory this engine contributes to the store
    remote_publish: str = "all"
    remote_timeout_s: float = 0.04  # a LOOKUP's remote existence check, at most
    lookup_wait_s: float = 0.04  # a LOOKUP's wait for the saves in flight its prefix goes on with
    compute_once: bool = True  # claims on blocks being prefilled, waited for by other instances
    remote_start_timeout_s: float = 5.0  # the store's setup at start, at most

    def __post_init__(self) -> None:
        check_engine_name(self.name)
        self._check_pool_and_copies()
        self._check_clients()
        self._check_pinning()
        self._check_disk()
        self._check_remote()
        self._check_waits()

    def _check_pool_and_copies(self) -> None:
        if self.pool_bytes <= 0:
            raise ConfigError(f"--pool-size must be positive, got {self.pool_bytes}")
        if self.slab_bytes <= 0:
            raise ConfigError(f"--slab-size must be positive, got {self.slab_bytes}")
        if self.slab_bytes > self.pool_bytes:
            raise ConfigError(f"--slab-size {format_size(self.slab_bytes)} exceeds --pool-size "
                              f"{format_size(self.pool_bytes)}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"--backend {self.backend!r}: choose auto, cuda or host")
        if self.load_layer_groups < 1:
            raise ConfigError(f"--load-layer-groups {self.load_layer_groups}: must be at least 1")
        if self.device_staging_bytes < 0:
            raise ConfigError(f"--device-staging {self.device_staging_bytes}: must not be negative")
        if self.copy_backend == "staged" and not self.device_staging_bytes:
            raise ConfigError("--copy-backend staged needs --device-staging above 0")
        if self.backend == "host" and self.copy_backend not in ("auto",):
            raise ConfigError(f"--copy-backend {self.copy_backend} is a GPU copy path; --backend "
                              f"host copies with the CPU (leave --copy-backend at auto)")
        if self.copy_backend not in COPY_PATHS:
            raise ConfigError(f"--copy-backend {self.copy_backend!r}: choose {', '.join(COPY_PATHS)}")

    def _check_clients(self) -> None:
        if not 1 <= self.num_slots <= MAX_SLOTS:
            raise ConfigError(f"--max-clients {self.num_slots}: must lie in [1, {MAX_SLOTS}]")
        if self.ring_slots < 2:
            raise ConfigError(f"--ring-slots {self.ring_slots}: must be at least 2")
        if self.arena_bytes < 4096:
            raise ConfigError(f"--arena-size {self.arena_bytes} bytes: must be at least 4KiB")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"--log-level {self.log_level!r}: choose DEBUG, INFO, WARNING or ERROR")
        if not 0 < self.lease_ttl_s <= MAX_LEASE_TTL_S:  # nan fails too: it never expires anything
            raise ConfigError(f"--lease-ttl {self.lease_ttl_s:g}: must lie in (0, {MAX_LEASE_TTL_S:g}] seconds")

    def _check_pinning(self) -> None:
        if self.pin_chunk_bytes <= 0:
            raise ConfigError(f"--pin-chunk must be positive, got {self.pin_chunk_bytes}")
        if not 0 <= self.pin_threads <= MAX_PIN_THREADS:
            raise ConfigError(f"--pin-threads {self.pin_threads}: must lie in [1, {MAX_PIN_THREADS}] "
                              f"(or auto)")
        if self.pin_rate_bytes < 0:
            raise ConfigError(f"--pin-rate {self.pin_rate_bytes}: must not be negative")

    def _check_disk(self) -> None:
        if self.disk_bytes < 0:
            raise ConfigError(f"--disk-size {self.disk_bytes}: must not be negative")
        if self.disk_admission not in DISK_ADMISSIONS:
            raise ConfigError(f"--disk-admission {self.disk_admission!r}: choose {', '.join(DISK_ADMISSIONS)}")
        if not 1 <= self.disk_threads <= MAX_DISK_THREADS:
            raise ConfigError(f"--disk-threads {self.disk_threads}: must lie in [1, {MAX_DISK_THREADS}]")
        if len(set(self.disk_paths)) != len(self.disk_paths):
            raise ConfigError(f"--disk-path names a directory twice: {','.join(self.disk_paths)}")

    def _check_waits(self) -> None:
        if not 0 <= self.lookup_wait_s <= MAX_LOOKUP_WAIT_S:
            raise ConfigError(f"--lookup-wait-ms {self.lookup_wait_s * 1e3:g}: must lie in "
                              f"[0, {MAX_LOOKUP_WAIT_S * 1e3:g}]")
        if not 0 <= self.idle_spin_s <= MAX_IDLE_SPIN_S:
            raise ConfigError(f"--idle-spin-ms {self.idle_spin_s * 1e3:g}: must lie in "
                              f"[0, {MAX_IDLE_SPIN_S * 1e3:g}]")

    def _check_remote(self) -> None:
        if self.remote not in REMOTE_KINDS:
            raise ConfigError(f"--remote {self.remote!r}: choose {', '.join(REMOTE_KINDS)}")
        if self.remote_protocol not in REMOTE_PROTOCOLS:
            raise ConfigError(f"--remote-protocol {self.remote_protocol!r}: choose {', '.join(REMOTE_PROTOCOLS)}")
        if self.remote_publish not in REMOTE_PUBLISH:
            raise ConfigError(f"--remote-publish {self.remote_publish!r}: choose {', '.join(REMOTE_PUBLISH)}")
        host, _, port = self.remote_master.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"--remote-master {self.remote_master!r}: expected host:port")
        if self.remote_segment_bytes < 0:
            raise ConfigError(f"--remote-segment-size {self.remote_segment_bytes}: must not be negative")
        if not 0 < self.remote_start_timeout_s <= MAX_REMOTE_START_TIMEOUT_S:  # (nan fails too)
            raise ConfigError(f"--remote-start-timeout {self.remote_start_timeout_s:g}: must lie in "
                              f"(0, {MAX_REMOTE_START_TIMEOUT_S:g}] seconds")
        if not 0 < self.remote_timeout_s <= MAX_REMOTE_TIMEOUT_S:
            raise ConfigError(f"--remote-timeout-ms {self.remote_timeout_s * 1e3:g}: must lie in "
                              f"(0, {MAX_REMOTE_TIMEOUT_S * 1e3:g}]")

    @property
    def usable_pool_bytes(self) -> int:
        """The pool holds whole slabs: what is allocated of ``pool_bytes``."""
        return self.pool_bytes // self.slab_bytes * self.slab_bytes

    @property
    def pin_chunk(self) -> int:
        """``pin_chunk_bytes`` rounded up to whole slabs that end on a page (so chunks are
        registered apart), at most the pool."""
        unit = math.lcm(self.slab_bytes, 4096)
        return min(self.usable_pool_bytes, -(-self.pin_chunk_bytes // unit) * unit)
