"""The engine's settings as a person gives them: one ``Option`` per ``EngineConfig`` field,
read from its flag, else its ``PEGAFLOW_*`` variable, else its default (in that order),
and the warning for a ``PEGAFLOW_*`` variable that is no setting."""

from __future__ import annotations

import argparse
import difflib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pegaflow.platform.cli import ArgumentParser
from pegaflow.platform.env_vars import CONNECTOR_ENV_VARS
from pegaflow.platform.errors import ConfigError
from pegaflow.platform.values import as_bool, as_float, parse_size, version_line

from ..config import (
    BACKENDS,
    DISK_ADMISSIONS,
    LOG_LEVELS,
    MAX_LEASE_TTL_S,
    PIN_CHUNK_BYTES,
    REMOTE_KINDS,
    REMOTE_PROTOCOLS,
    REMOTE_PUBLISH,
    EngineConfig,
)
from ..copy.base import DEVICE_STAGING_BYTES
from ..copy.base import PATHS as COPY_PATHS

logger = logging.getLogger(__name__)


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



OPTIONS: tuple[Option, ...] = (
    Option("name", "name", "pegaflow", "engine name; clients attach by it"),
    Option("pool-size", "pool_bytes", "4GiB", "host memory for KV blocks, with its unit: e.g. "
           "512MiB, 64GiB (binary units) or 64GB (decimal)", parse_size),
    Option("slab-size", "slab_bytes", "64MiB", "pool allocation unit per block size (the largest "
           "block it stores); clamped to the pool size", parse_size),
    Option("backend", "backend", "auto", "auto: cuda when a GPU is present, else host",
           _choice("backend", BACKENDS)),
    Option("copy-backend", "copy_backend", "auto", "cuda copy path: kernel (SMs read and write the "
           "pool over PCIe), copy-engine (one DMA per page), staged (pages packed in device memory, "
           "one DMA per run of pool entries, whatever the page size); auto stages what it can "
           "(pages up to 256 KiB) and picks between the others by a measurement per page size",
           _choice("copy-backend", COPY_PATHS)),
    Option("device-staging", "device_staging_bytes", f"{DEVICE_STAGING_BYTES >> 20}MiB",
           "GPU memory the staged path takes on each GPU the engine serves (two staging buffers each way); "
           "0 turns it off", parse_size),
    Option("hold-saves", "hold_saves", "false", "cuda: hold a SAVE in the engine until the client's "
           "GPU has written its data, instead of queueing its copies behind that wait in a stream "
           "every client's saves share; turn it on for several vLLMs on one engine (docs/replicas.md)",
           lambda text: as_bool("--hold-saves", text), is_switch=True),
    Option("load-layer-groups", "load_layer_groups", "1", "cuda: a staged LOAD that vLLM's forward "
           "waits on layer by layer goes in this many groups of layers, each group's layers ready "
           "as it lands, so the forward's first layers run while the rest is on its way (1: every "
           "layer ready with the last byte; see docs/benchmarks.md for what 4 measured)", int),
    Option("max-clients", "num_slots", "64", "client slots (one per vLLM scheduler or worker); "
           "each takes ring and arena memory in /dev/shm at start", int),
    Option("ring-slots", "ring_slots", "1024", "commands in flight per client ring", int),
    Option("arena-size", "arena_bytes", "8MiB", "payload arena per client (block ids and hashes "
           "of its commands in flight)", parse_size),
    Option("lease-ttl", "lease_ttl_s", "120", "seconds a lookup's lease pins its blocks if never "
           f"used, in (0, {MAX_LEASE_TTL_S:g}]", float, old_env="PEGAFLOW_LEASE_TTL_S"),
    Option("idle-spin-ms", "idle_spin_s", "2", "after its last work the engine polls this long "
           "before sleeping: a command arriving later first wakes it, one arriving sooner costs "
           "a busy core meanwhile", lambda text: float(text) / 1e3),
    Option("lookup-wait-ms", "lookup_wait_s", "40", "the most a LOOKUP whose prefix goes on with "
           "blocks another client is still saving waits for them (a decode vLLM right after its "
           "prefill vLLM, a replica right after its twin); past it the READY part is served; 0: "
           "never wait; keep it below the connector's lookup_timeout_ms (500)",
           lambda text: float(text) / 1e3),
    Option("compute-once", "compute_once", "on", "a prefix several vLLMs are sent at once is "
           "computed by one of them: a LOOKUP that misses claims the blocks its vLLM will compute, "
           "and another vLLM's LOOKUP that reaches them waits for their saves if that looks no "
           "longer than computing them (docs/replicas.md); off: every vLLM computes its own",
           lambda text: as_bool("--compute-once", text), is_switch=True),
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
           "rest of the prefix is a miss); keep it below the connector's lookup_timeout_ms (500)",
           lambda text: float(text) / 1e3),
    Option("remote-start-timeout", "remote_start_timeout_s", "5", "seconds the engine waits at start "
           "for the remote store's setup (the master and metadata server answering) before it gives "
           "up with an error; SIGTERM stops it sooner", lambda text: as_float("--remote-start-timeout", text)),
    Option("log-level", "log_level", "INFO", "log level", _choice("log-level", LOG_LEVELS, upper=True)),
)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="pegaflow-engine",
        description="pegaflow engine: keeps vLLM KV blocks in pinned host memory shared by "
                    "every vLLM on this host.  Each flag can also be set by its PEGAFLOW_* "
                    "environment variable; a flag beats its variable.")
    p.add_argument("--version", action="version", version=version_line("pegaflow-engine"))
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
    return frozenset(o.env for o in OPTIONS) | frozenset(CONNECTOR_ENV_VARS.values())


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
    return config_from_parsed(build_parser().parse_args(argv), environ)


def config_from_parsed(parsed: argparse.Namespace, environ=None) -> EngineConfig:
    """The config of a command line ``build_parser`` parsed, over ``environ``'s PEGAFLOW_*."""
    environ = os.environ if environ is None else environ
    args = vars(parsed)
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
