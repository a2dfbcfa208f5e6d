"""The connector's one frozen config.

Each option comes from ``kv_connector_extra_config`` first, then its ``PEGAFLOW_*``
environment variable (``ENV_VARS``), then the default; README.md's connector table says
what each means.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields

from pegaflow.errors import ConfigError
from pegaflow.shm import check_engine_name
from pegaflow.values import as_bool, as_float, as_int

ENV_VARS = {
    "engine_name": "PEGAFLOW_NAME", "load_mode": "PEGAFLOW_LOAD_MODE",
    "enable_save": "PEGAFLOW_ENABLE_SAVE", "enable_load": "PEGAFLOW_ENABLE_LOAD",
    "lookup_timeout_ms": "PEGAFLOW_LOOKUP_TIMEOUT_MS", "command_timeout_ms": "PEGAFLOW_COMMAND_TIMEOUT_MS",
    "reconnect_interval_s": "PEGAFLOW_RECONNECT_INTERVAL_S", "num_load_slots": "PEGAFLOW_NUM_LOAD_SLOTS",
    "disk_load_mode": "PEGAFLOW_DISK_LOAD_MODE",
}
LOAD_MODES = ("layerwise", "async", "auto")


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    engine_name: str = "pegaflow"
    load_mode: str = "auto"
    enable_save: bool = True
    enable_load: bool = True
    lookup_timeout_ms: float = 50.0
    command_timeout_ms: float = 5000.0
    reconnect_interval_s: float = 5.0
    num_load_slots: int = 64
    disk_load_mode: str = "async"  # how a hit the engine reads from its disk tier first loads

    def __post_init__(self) -> None:
        check_engine_name(self.engine_name)
        for key in ("load_mode", "disk_load_mode"):
            if getattr(self, key) not in LOAD_MODES:
                raise ConfigError(f"{key}={getattr(self, key)!r}: choose one of {', '.join(LOAD_MODES)}")
        for key in ("lookup_timeout_ms", "command_timeout_ms", "reconnect_interval_s"):
            if not 0 < getattr(self, key) < math.inf:  # nan fails too
                raise ConfigError(f"{key} must be a positive finite number, got {getattr(self, key)}")
        if self.num_load_slots < 1:
            raise ConfigError(f"num_load_slots must be at least 1, got {self.num_load_slots}")

    @property
    def is_async_load(self) -> bool:
        return self.load_mode == "async"

    @property
    def is_off(self) -> bool:
        """Nothing to look up or save: nothing registered, no engine slot taken."""
        return not (self.enable_load or self.enable_save)

    @classmethod
    def from_sources(cls, extra_config: dict | None, environ: dict | None = None) -> "ConnectorConfig":
        extra_config = dict(extra_config or {})
        environ = os.environ if environ is None else environ
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(k for k in extra_config if k not in known)
        if unknown:
            raise ConfigError(f"unknown kv_connector_extra_config keys {unknown}; known: {sorted(known)}")
        values = {}
        for name, spec in known.items():
            if extra_config.get(name) is not None:
                values[name] = _converted(spec.default, name, extra_config[name])
            elif environ.get(ENV_VARS[name]) is not None:
                values[name] = _converted(spec.default, ENV_VARS[name], environ[ENV_VARS[name]])
        return cls(**values)


def _converted(default, key: str, raw):
    """``raw`` as the type of ``default``, checked as the engine checks its flags; an error
    names ``key`` (the option, or its env var) and the value once."""
    if isinstance(default, bool):
        return as_bool(key, raw)
    if isinstance(default, int):
        return as_int(key, raw)
    if isinstance(default, float):
        return as_float(key, raw)
    if not isinstance(raw, str):
        raise ConfigError(f"{key}={raw!r}: expected text")
    return raw


def kv_transfer_config(engine_name: str = "pegaflow", **options):
    """vLLM's ``KVTransferConfig`` for pegaflow: ``LLM(..., kv_transfer_config=kv_transfer_config())``.

    ``options`` are ``kv_connector_extra_config`` keys (the table above), checked here so a
    typo fails before vLLM starts.
    """
    from vllm.config import KVTransferConfig
    extra = {"engine_name": engine_name, **options}
    ConnectorConfig.from_sources(extra, environ={})
    fields = {"kv_connector": "PegaKVConnector", "kv_connector_module_path": "pegaflow.connector",
              "kv_role": "kv_both", "kv_connector_extra_config": extra}
    if "kv_load_failure_policy" in getattr(KVTransferConfig, "__dataclass_fields__", {}):
        fields["kv_load_failure_policy"] = "recompute"  # a cache miss never fails a request
    return KVTransferConfig(**fields)
