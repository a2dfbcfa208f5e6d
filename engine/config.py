"""The engine's one frozen config: flags first, then ``PEGAFLOW_*`` env vars, then defaults.

Every option is one row of ``OPTIONS``: its flag, env var, default and help are made from
that row, so the three cannot drift (a test compares them, and the README's table).
"""

from __future__ import annotations

import argparse
import difflib
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pegaflow.platform.cli import ArgumentParser
from pegaflow.platform.errors import ConfigError
from pegaflow.platform.shm import check_engine_name
from pegaflow.platform.values import as_bool, as_float, format_size, parse_size, version_line

from .copy.base import DEVICE_STAGING_BYTES
from .copy.base import PATHS as COPY_PATHS

logger = logging.getLogger(__name__)


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
# Pinned before the engine serves, and the unit pinned in the background: at ~3 GB/s (the
# H200 host, small pages) 256 MiB takes ~0.1 s, well inside a 1 s start, and a 64 GiB
# pool is 256 registrations.
PIN_CHUNK_BYTES = 256 << 20


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
    remote_start_timeout_s: float = 5.0  # the store's setup at start, at most

    def __post_init__(self) -> None:
        check_engine_name(self.name)
        if self.pool_bytes <= 0:
            raise ConfigError(f"--pool-size must be positive, got {self.pool_bytes}")
        if self.slab_bytes <= 0:
            raise ConfigError(f"--slab-size must be positive, got {self.slab_bytes}")
        if self.slab_bytes > self.pool_bytes:
            raise ConfigError(f"--slab-size {format_size(self.slab_bytes)} exceeds --pool-size "
                              f"{format_size(self.pool_bytes)}")
        if self.backend not in _BACKENDS:
            raise ConfigError(f"--backend {self.backend!r}: choose auto, cuda or host")
        if self.device_staging_bytes < 0:
            raise ConfigError(f"--device-staging {self.device_staging_bytes}: must not be negative")
        if self.copy_backend == "staged" and not self.device_staging_bytes:
            raise ConfigError("--copy-backend staged needs --device-staging above 0")
        if self.backend == "host" and self.copy_backend not in ("auto",):
            raise ConfigError(f"--copy-backend {self.copy_backend} is a GPU copy path; --backend "
                              f"host copies with the CPU (leave --copy-backend at auto)")
        if self.copy_backend not in COPY_PATHS:
            raise ConfigError(f"--copy-backend {self.copy_backend!r}: choose {', '.join(COPY_PATHS)}")
        if not 1 <= self.num_slots <= MAX_SLOTS:
            raise ConfigError(f"--max-clients {self.num_slots}: must lie in [1, {MAX_SLOTS}]")
        if self.ring_slots < 2:
            raise ConfigError(f"--ring-slots {self.ring_slots}: must be at least 2")
        if self.arena_bytes < 4096:
            raise ConfigError(f"--arena-size {self.arena_bytes} bytes: must be at least 4KiB")
        if self.log_level not in _LOG_LEVELS:
            raise ConfigError(f"--log-level {self.log_level!r}: choose DEBUG, INFO, WARNING or ERROR")
        if not 0 < self.lease_ttl_s <= MAX_LEASE_TTL_S:  # nan fails too: it never expires anything
            raise ConfigError(f"--lease-ttl {self.lease_ttl_s:g}: must lie in (0, {MAX_LEASE_TTL_S:g}] seconds")
        if self.pin_chunk_bytes <= 0:
            raise ConfigError(f"--pin-chunk must be positive, got {self.pin_chunk_bytes}")
        if not 0 <= self.pin_threads <= MAX_PIN_THREADS:
            raise ConfigError(f"--pin-threads {self.pin_threads}: must lie in [1, {MAX_PIN_THREADS}] "
                              f"(or auto)")
        if self.pin_rate_bytes < 0:
            raise ConfigError(f"--pin-rate {self.pin_rate_bytes}: must not be negative")
        if self.disk_bytes < 0:
            raise ConfigError(f"--disk-size {self.disk_bytes}: must not be negative")
        if self.disk_admission not in DISK_ADMISSIONS:
            raise ConfigError(f"--disk-admission {self.disk_admission!r}: choose {', '.join(DISK_ADMISSIONS)}")
        if not 1 <= self.disk_threads <= MAX_DISK_THREADS:
            raise ConfigError(f"--disk-threads {self.disk_threads}: must lie in [1, {MAX_DISK_THREADS}]")
        if len(set(self.disk_paths)) != len(self.disk_paths):
            raise ConfigError(f"--disk-path names a directory twice: {','.join(self.disk_paths)}")
        self._check_remote()
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


@dataclass(frozen=True)
class Option:
    """One engine setting: ``--<flag>``, env ``PEGAFLOW_<FLAG>``, its default and meaning."""
    flag: str
    field: str                       # EngineConfig's field
    default: str                     # as a person writes it (also what --help shows)
    help: str
    parse: Callable[[str], Any] = str  # text -> the field's value
    is_switch: bool = False          # --keep-pool / --no-keep-pool
    old_env: str = ""                # an earlier name of its env var, still read (with a warning)

    @property
    def env(self) -> str:
        return "PEGAFLOW_" + self.flag.replace("-", "_").upper()


def _choice(option_flag: str, choices: tuple[str, ...], upper: bool = False):
    def parse(text: str) -> str:
        value = text.strip().upper() if upper else text.strip()
        if value not in choices:
            raise ConfigError(f"--{option_flag} {text!r}: choose {', '.join(choices)}")
        return value
    return parse


def _disk_paths(text: str) -> tuple[str, ...]:
    return tuple(os.path.abspath(os.path.expanduser(p.strip())) for p in text.split(",") if p.strip())


def _pin_threads(text: str) -> int:
    value = text.strip().lower()
    if value == "auto":
        return 0
    if not value.isdigit() or int(value) == 0:
        raise ConfigError(f"--pin-threads {text!r}: a number of threads (1 or more), or auto")
    return int(value)


_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_BACKENDS = ("auto", "cuda", "host")

OPTIONS: tuple[Option, ...] = (
    Option("name", "name", "pegaflow", "engine name; clients attach by it"),
    Option("pool-size", "pool_bytes", "4GiB", "host memory for KV blocks, with its unit: e.g. "
           "512MiB, 64GiB (binary units) or 64GB (decimal)", parse_size),
    Option("slab-size", "slab_bytes", "64MiB", "pool allocation unit per block size (the largest "
           "block it stores); clamped to the pool size", parse_size),
    Option("backend", "backend", "auto", "auto: cuda when a GPU is present, else host",
           _choice("backend", _BACKENDS)),
    Option("copy-backend", "copy_backend", "auto", "cuda copy path: kernel (SMs read and write the "
           "pool over PCIe), copy-engine (one DMA per page), staged (pages packed in device memory, "
           "one DMA per run of pool entries, whatever the page size); auto stages what it can "
           "(pages up to 256 KiB) and picks between the others by a measurement per page size",
           _choice("copy-backend", COPY_PATHS)),
    Option("device-staging", "device_staging_bytes", f"{DEVICE_STAGING_BYTES >> 20}MiB",
           "GPU memory the staged path takes on each GPU the engine serves (two slots each way); "
           "0 turns it off", parse_size),
    Option("max-clients", "num_slots", "64", "client slots (one per vLLM scheduler or worker); "
           "each takes ring and arena memory in /dev/shm at start", int),
    Option("ring-slots", "ring_slots", "1024", "commands in flight per client ring", int),
    Option("arena-size", "arena_bytes", "8MiB", "payload arena per client (block ids and hashes "
           "of its commands in flight)", parse_size),
    Option("lease-ttl", "lease_ttl_s", "120", "seconds a lookup's lease pins its blocks if never "
           f"used, in (0, {MAX_LEASE_TTL_S:g}]", float, old_env="PEGAFLOW_LEASE_TTL_S"),
    Option("idle-spin-ms", "idle_spin_s", "2", "after its last work the engine polls this long "
           "before sleeping: a command arriving later first wakes it (0.1-2 ms on a VM), one "
           "arriving sooner costs a busy core meanwhile", lambda text: float(text) / 1e3),
    Option("lookup-wait-ms", "lookup_wait_s", "40", "the most a LOOKUP whose prefix goes on with "
           "blocks another client is still saving waits for them (a decode vLLM right after its "
           "prefill vLLM, a replica right after its twin); past it the READY part is served; 0: "
           "never wait; keep it below the connector's lookup_timeout_ms (50)",
           lambda text: float(text) / 1e3),
    Option("keep-pool", "keep_pool", "off", "leave the pool and its table in /dev/shm when the "
           "engine stops (or dies), and take in the blocks a kept pool of the same size holds at "
           "start: the cache outlives an engine restart; the pool's memory stays in use while no "
           "engine runs", lambda text: as_bool("--keep-pool", text), is_switch=True),
    Option("pin-chunk", "pin_chunk_bytes", f"{PIN_CHUNK_BYTES >> 20}MiB", "the pool is faulted in "
           "and pinned a chunk at a time (whole slabs): the engine serves once the first is, and "
           "pins the others in the background, its usable pool growing a chunk at a time; a chunk "
           "as large as the pool pins it all before serving", parse_size),
    Option("pin-threads", "pin_threads", "auto", "threads that fault the pool in; auto: one per "
           "core, up to 16", _pin_threads),
    Option("pin-rate", "pin_rate_bytes", "0", "the most bytes a second the background pinning "
           "takes, e.g. 2GiB (0: no limit), to leave memory bandwidth to what runs beside it",
           parse_size),
    Option("disk-path", "disk_paths", "", "the disk tier: directories (comma-separated, one per "
           "drive) where blocks evicted from the pool are kept, one file each with its key and "
           "checksum; read back into the pool on a hit, and taken in again by the next engine on "
           "the same paths; a path is created if its parent exists (empty: no disk tier)", _disk_paths),
    Option("disk-size", "disk_bytes", "0", "bytes of blocks each --disk-path holds, e.g. 500GiB "
           "(0: 90 % of the least free space among the paths at start)", parse_size),
    Option("disk-admission", "disk_admission", "evicted", "which blocks go to disk: evicted (every "
           "block about to leave the pool), reused (only those a lookup hit at least once) or all "
           "(every block as it is stored: what was written before a stop outlives it)",
           _choice("disk-admission", DISK_ADMISSIONS)),
    Option("disk-threads", "disk_threads", "8", "threads doing the disk tier's reads and writes "
           "(requests in flight)", int),
    Option("remote", "remote", "off", "the remote tier: mooncake (a Mooncake Store shared by the "
           "engines of many hosts: READY blocks are published to it, a lookup's prefix goes on "
           "through the blocks it holds) or off", _choice("remote", REMOTE_KINDS)),
    Option("remote-master", "remote_master", "127.0.0.1:50051", "the remote store's master (host:port)"),
    Option("remote-metadata", "remote_metadata", "http://127.0.0.1:8080/metadata", "the remote store's "
           "metadata server (the master's own HTTP one, or etcd://host:port)"),
    Option("remote-protocol", "remote_protocol", "tcp", "how blocks move between hosts: tcp or rdma",
           _choice("remote-protocol", REMOTE_PROTOCOLS)),
    Option("remote-device", "remote_device", "", "RDMA devices for --remote-protocol rdma, e.g. "
           "mlx5_0,mlx5_1 (empty: the store picks)"),
    Option("remote-host", "remote_host", "", "the address the other hosts reach this engine at "
           "(empty: this host's address on the route to the master)"),
    Option("remote-segment-size", "remote_segment_bytes", "1GiB", "memory this engine contributes "
           "to the remote store (blocks of every engine are kept in it; they go when this engine "
           "stops); 0: it stores into the others' segments only", parse_size),
    Option("remote-publish", "remote_publish", "all", "which blocks go to the remote store: all "
           "(every block once READY in the pool) or reused (a block once a lookup hit it: used twice)",
           _choice("remote-publish", REMOTE_PUBLISH)),
    Option("remote-timeout-ms", "remote_timeout_s", "40", "the most a LOOKUP waits for the remote "
           "store's answer on which blocks it holds (past it, or with the store unreachable, the "
           "rest of the prefix is a miss); keep it below the connector's lookup_timeout_ms (50)",
           lambda text: float(text) / 1e3),
    Option("remote-start-timeout", "remote_start_timeout_s", "5", "seconds the engine waits at start "
           "for the remote store's setup (the master and metadata server answering) before it gives "
           "up with an error; SIGTERM stops it sooner", lambda text: as_float("--remote-start-timeout", text)),
    Option("log-level", "log_level", "INFO", "log level", _choice("log-level", _LOG_LEVELS, upper=True)),
)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="pegaflow-engine",
        description="pegaflow engine: keeps vLLM KV blocks in pinned host memory shared by "
                    "every vLLM on this host.  Each flag can also be set by its PEGAFLOW_* "
                    "environment variable; a flag beats its variable.")
    p.add_argument("--version", action="version", version=version_line("pegaflow engine"))
    p.add_argument("--clean", metavar="NAME", help="start nothing: remove the shared memory (pool, "
                   "segments, semaphores, locks) a dead engine of this name left, a kept pool "
                   "included; refused while it runs")
    for option in OPTIONS:
        text = f"{option.help} (env {option.env}" + (f"; default {option.default})" if option.default else ")")
        if option.is_switch:
            p.add_argument(f"--{option.flag}", action=argparse.BooleanOptionalAction, default=None,
                           help=text)
        else:
            p.add_argument(f"--{option.flag}", default=None, metavar=option.flag.replace("-", "_").upper(),
                           help=text.replace("%", "%%"))
    return p


def _value(option: Option, raw: Any, source: str) -> Any:
    if isinstance(raw, bool):
        return raw
    try:
        return option.parse(raw)
    except ConfigError as exc:
        message = str(exc)
        raise ConfigError(message if message.startswith(source) else f"{source}: {message}") from None
    except ValueError as exc:
        raise ConfigError(f"{source}={raw!r}: expected a number") from exc


def known_env_vars() -> frozenset[str]:
    """Every ``PEGAFLOW_*`` variable pegaflow reads, the connector's included."""
    from pegaflow.connector.config import ENV_VARS
    return frozenset(o.env for o in OPTIONS) | frozenset(ENV_VARS.values())


def warn_unknown_env(environ=None) -> list[str]:
    """Log (and return) each set ``PEGAFLOW_*`` variable that is no setting: a typo or an
    old name would otherwise be ignored without a word."""
    environ = os.environ if environ is None else environ
    known = known_env_vars()
    for option in OPTIONS:
        if option.old_env and option.old_env in environ:
            is_new_set = bool(environ.get(option.env, "").strip())
            logger.warning("%s is the old name of %s%s; rename it", option.old_env, option.env,
                           " (which is set and wins)" if is_new_set else
                           f" (still read when neither --{option.flag} nor {option.env} is given)")
    old = {o.old_env for o in OPTIONS if o.old_env}
    unknown = sorted(k for k in environ if k.startswith("PEGAFLOW_") and k not in known and k not in old)
    for var in unknown:
        close = difflib.get_close_matches(var, sorted(known), n=1)
        logger.warning("%s is not a pegaflow setting and is ignored%s", var,
                       f" (did you mean {close[0]}?)" if close else "")
    return unknown


def config_from_args(argv: list[str] | None = None, environ=None) -> EngineConfig:
    environ = os.environ if environ is None else environ
    args = vars(build_parser().parse_args(argv))
    values = {}
    for option in OPTIONS:
        flag_value = args[option.flag.replace("-", "_")]
        if flag_value is not None:
            values[option.field] = _value(option, flag_value, f"--{option.flag}")
        elif environ.get(option.env, "").strip():
            values[option.field] = _value(option, environ[option.env], option.env)
        elif option.old_env and environ.get(option.old_env, "").strip():
            values[option.field] = _value(option, environ[option.old_env], option.old_env)
        else:
            values[option.field] = _value(option, option.default, f"default of --{option.flag}")
    values["slab_bytes"] = min(values["slab_bytes"], values["pool_bytes"])
    return EngineConfig(**values)
