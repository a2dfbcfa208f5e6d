"""The connector's one frozen config.

Each option comes from ``kv_connector_extra_config`` first, then its ``PEGAFLOW_*``
environment variable (``ENV_VARS``), then the default; README.md's connector table says
what each means.  vLLM's ``kv_role`` sets what the connector does (docs/disaggregation.md):
``kv_producer`` (a prefill server) saves and never loads, ``kv_consumer`` (a decode server)
loads and does not save unless ``enable_save`` says so, ``kv_both`` does both.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields

from pegaflow.platform.env_vars import CONNECTOR_ENV_VARS
from pegaflow.platform.errors import ConfigError
from pegaflow.platform.shm import check_engine_name
from pegaflow.platform.values import as_bool, as_float, as_int
from pegaflow.platform.wire import KvRole

ENV_VARS = CONNECTOR_ENV_VARS
KV_ROLES = ("kv_both", "kv_producer", "kv_consumer")
LOAD_MODES = ("layerwise", "async", "auto")
MAX_COMPUTE_ONCE_WAIT_MS = 10_000.0  # the engine's claims last no longer (engine/prefill_claims.py)


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    engine_name: str = "pegaflow"
    load_mode: str = "auto"
    enable_save: bool = True
    enable_load: bool = True
    # A miss recomputes the whole prefix (a cold 10k-token prompt of an 8B model: 268 ms alone on
    # an H100); under two replicas' bursts of loads the engine answered lookups in up to 250 ms
    # (docs/replicas.md)
    lookup_timeout_ms: float = 500.0
    command_timeout_ms: float = 5000.0
    reconnect_interval_s: float = 5.0
    num_load_slots: int = 64
    disk_load_mode: str = "async"  # how a hit the engine reads from its disk tier first loads
    lookup_wait_ms: float = -1.0  # a LOOKUP's wait for blocks still being saved (<0: the engine's)
    # Compute once (docs/replicas.md): a miss claims the blocks this vLLM computes; a lookup
    # that reaches another vLLM's claim waits for them, at most compute_once_wait_ms, and only
    # where that looks no longer than computing them at prefill_tokens_per_s
    compute_once: bool = True
    compute_once_wait_ms: float = 3000.0
    prefill_tokens_per_s: float = 10000.0
    kv_role: str = "kv_both"  # vLLM's, not an extra-config key

    def __post_init__(self) -> None:
        self._check_types()
        check_engine_name(self.engine_name)
        for key in ("load_mode", "disk_load_mode"):
            if getattr(self, key) not in LOAD_MODES:
                raise ConfigError(f"{key}={getattr(self, key)!r}: choose one of {', '.join(LOAD_MODES)}")
        for key in ("lookup_timeout_ms", "command_timeout_ms", "reconnect_interval_s"):
            if not 0 < getattr(self, key) < math.inf:  # nan fails too
                raise ConfigError(f"{key} must be a positive finite number, got {getattr(self, key)}")
        if self.num_load_slots < 1:
            raise ConfigError(f"num_load_slots must be at least 1, got {self.num_load_slots}")
        if self.kv_role not in KV_ROLES:
            raise ConfigError(f"kv_role={self.kv_role!r}: choose one of {', '.join(KV_ROLES)}")
        if self.kv_role == "kv_producer" and self.enable_load:
            raise ConfigError("kv_role kv_producer never loads: enable_load must be off")
        if not 0 <= self.compute_once_wait_ms <= MAX_COMPUTE_ONCE_WAIT_MS:
            raise ConfigError(f"compute_once_wait_ms must lie in [0, {MAX_COMPUTE_ONCE_WAIT_MS:g}], "
                              f"got {self.compute_once_wait_ms}")
        if not 1 <= self.prefill_tokens_per_s < 2**32:  # (nan fails too)
            raise ConfigError(f"prefill_tokens_per_s must lie in [1, 2**32), got {self.prefill_tokens_per_s}")
        if self.lookup_wait_ms >= self.lookup_timeout_ms:
            raise ConfigError(f"lookup_wait_ms={self.lookup_wait_ms:g} must stay below lookup_timeout_ms="
                              f"{self.lookup_timeout_ms:g}: the engine must answer before the connector gives up")

    def _check_types(self) -> None:
        """Each field of its default's type (``from_sources`` converts text: '200' -> 200.0)."""
        for spec in fields(self):
            value, default = getattr(self, spec.name), spec.default
            if isinstance(default, bool):
                ok, kind = isinstance(value, bool), "true or false"
            elif isinstance(default, (int, float)):
                ok = isinstance(value, (int, float) if isinstance(default, float) else int) \
                    and not isinstance(value, bool)
                kind = "a number" if isinstance(default, float) else "a whole number"
            else:
                ok, kind = isinstance(value, str), "text"
            if not ok:
                raise ConfigError(f"{spec.name}={value!r}: expected {kind}")

    @property
    def wire_kv_role(self) -> KvRole:
        """The role shown in the engine's client list (pegaflow-stat)."""
        return KvRole[self.kv_role.removeprefix("kv_").upper()]

    @property
    def lookup_wait_arg(self) -> int | None:
        """What a LOOKUP asks the engine to wait for saves in flight (None: its default)."""
        return None if self.lookup_wait_ms < 0 else int(self.lookup_wait_ms)

    @property
    def is_claiming(self) -> bool:
        """Whether its lookups take part in compute once: it claims only what it will save."""
        return self.compute_once and self.enable_save and self.enable_load

    @property
    def lookup_deadline_ms(self) -> float:
        """How long a lookup may go unanswered before it is a miss: a wait for another
        vLLM's claim comes on top of the usual deadline."""
        return self.lookup_timeout_ms + (self.compute_once_wait_ms if self.is_claiming else 0.0)

    @property
    def is_async_load(self) -> bool:
        return self.load_mode == "async"

    @property
    def is_off(self) -> bool:
        """Nothing to look up or save: nothing registered, no engine slot taken."""
        return not (self.enable_load or self.enable_save)

    @classmethod
    def from_sources(cls, extra_config: dict | None, environ: dict | None = None,
                     kv_role: str = "kv_both") -> "ConnectorConfig":
        """``kv_role``: vLLM's; a producer's loads are off, and so are a consumer's saves
        unless ``enable_save`` is given."""
        extra_config = dict(extra_config or {})
        environ = os.environ if environ is None else environ
        known = {f.name: f for f in fields(cls) if f.name in ENV_VARS}
        unknown = sorted(k for k in extra_config if k not in known)
        if unknown:
            raise ConfigError(f"unknown kv_connector_extra_config keys {unknown}; known: {sorted(known)}")
        given_none = sorted(k for k, v in extra_config.items() if v is None)
        if given_none:
            raise ConfigError(f"{given_none[0]}=None: give a value, or leave the key out for its default")
        values = {}
        for name, spec in known.items():
            if name in extra_config:
                values[name] = _converted(spec.default, name, extra_config[name])
            elif environ.get(ENV_VARS[name]) is not None:
                values[name] = _converted(spec.default, ENV_VARS[name], environ[ENV_VARS[name]])
        if kv_role == "kv_producer":
            values["enable_load"] = False
        elif kv_role == "kv_consumer":
            values.setdefault("enable_save", False)
        return cls(**values, kv_role=kv_role)


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


def kv_transfer_config(engine_name: str = "pegaflow", kv_role: str = "kv_both", **options):
    """vLLM's ``KVTransferConfig`` for pegaflow: ``LLM(..., kv_transfer_config=kv_transfer_config())``.

    ``options`` are ``kv_connector_extra_config`` keys (the table above), checked here so a
    typo fails before vLLM starts, and passed on converted (``lookup_timeout_ms="200"`` as 200.0).
    """
    from vllm.config import KVTransferConfig
    given = {"engine_name": engine_name, **options}
    config = ConnectorConfig.from_sources(given, environ={}, kv_role=kv_role)
    extra = {key: getattr(config, key) for key in given}
    fields = {"kv_connector": "PegaKVConnector", "kv_connector_module_path": "pegaflow.connector",
              "kv_role": kv_role, "kv_connector_extra_config": extra}
    if "kv_load_failure_policy" in getattr(KVTransferConfig, "__dataclass_fields__", {}):
        fields["kv_load_failure_policy"] = "recompute"  # a cache miss never fails a request
    return KVTransferConfig(**fields)
