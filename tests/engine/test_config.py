"""engine.config: sizes, flags over PEGAFLOW_* env vars over defaults, and validation."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig, config_from_args, parse_size
from pegaflow.errors import ConfigError

_ENV_VARS = ["PEGAFLOW_NAME", "PEGAFLOW_POOL_SIZE", "PEGAFLOW_SLAB_SIZE", "PEGAFLOW_BACKEND",
             "PEGAFLOW_COPY_BACKEND", "PEGAFLOW_MAX_CLIENTS", "PEGAFLOW_LEASE_TTL_S", "PEGAFLOW_LOG_LEVEL",
             "PEGAFLOW_IDLE_SPIN_MS", "PEGAFLOW_KEEP_POOL", "PEGAFLOW_DEVICE_STAGING"]


@pytest.fixture
def clean_env(monkeypatch):
    """No PEGAFLOW_* variable of the host leaks into a test; the test sets its own."""
    for name in _ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# -- parse_size ---------------------------------------------------------------------------------


@pytest.mark.parametrize("text,expected", [
    ("4GiB", 4 << 30), ("512MiB", 512 << 20), ("1.5GB", 1_500_000_000), ("100", 100),
    ("64KiB", 64 << 10), ("2TiB", 2 << 40), ("8kb", 8000), ("3 mib", 3 << 20), (" 7G ", 7 << 30),
    ("10B", 10), ("1.5KiB", 1536), ("0", 0), ("2MB", 2_000_000), ("3TB", 3 * 10**12), ("5M", 5 << 20),
])
def test_parse_size_units_give_bytes(text, expected):
    # 1. Binary (KiB, G) and decimal (GB, kb) units, any case, spaces around.
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "4 GiBs", "4XB", "-1", "1e9", "4 G iB", "1,5GB", "0x10", "four"])
def test_parse_size_bad_text_raises_config_error(text):
    # 1. Anything else is refused with the offending text in the message.
    with pytest.raises(ConfigError, match="size"):
        parse_size(text)


# -- config_from_args ---------------------------------------------------------------------------


def test_config_from_args_no_flags_no_env_gives_defaults(clean_env):
    # 1. Nothing given: the documented defaults, slab 64 MiB of a 4 GiB pool.
    config = config_from_args([])
    assert config == EngineConfig()
    assert (config.name, config.pool_bytes, config.slab_bytes) == ("pegaflow", 4 << 30, 64 << 20)
    assert (config.backend, config.copy_backend, config.log_level) == ("auto", "auto", "INFO")
    assert (config.num_slots, config.ring_slots, config.arena_bytes) == (64, 1024, 8 << 20)


def test_config_from_args_env_used_when_flag_absent(clean_env):
    # 1. Every env-configurable option set only through its PEGAFLOW_* variable.
    clean_env.setenv("PEGAFLOW_NAME", "from_env")
    clean_env.setenv("PEGAFLOW_POOL_SIZE", "1GiB")
    clean_env.setenv("PEGAFLOW_SLAB_SIZE", "16MiB")
    clean_env.setenv("PEGAFLOW_BACKEND", "host")
    clean_env.setenv("PEGAFLOW_COPY_BACKEND", "kernel")
    clean_env.setenv("PEGAFLOW_MAX_CLIENTS", "12")
    clean_env.setenv("PEGAFLOW_LEASE_TTL_S", "30")
    clean_env.setenv("PEGAFLOW_LOG_LEVEL", "DEBUG")
    clean_env.setenv("PEGAFLOW_IDLE_SPIN_MS", "10")
    clean_env.setenv("PEGAFLOW_KEEP_POOL", "1")
    clean_env.setenv("PEGAFLOW_DEVICE_STAGING", "64MiB")
    config = config_from_args([])
    # 2. Each reaches the config.
    assert config == EngineConfig(name="from_env", pool_bytes=1 << 30, slab_bytes=16 << 20, backend="host",
                                  copy_backend="kernel", num_slots=12, lease_ttl_s=30.0, log_level="DEBUG",
                                  idle_spin_s=10e-3, keep_pool=True, device_staging_bytes=64 << 20)
    # 3. The flag's negative form beats the env.
    assert config_from_args(["--no-keep-pool"]).keep_pool is False


def test_config_from_args_flag_beats_env(clean_env):
    # 1. Env and flag both set, with different values.
    clean_env.setenv("PEGAFLOW_POOL_SIZE", "1GiB")
    clean_env.setenv("PEGAFLOW_NAME", "from_env")
    clean_env.setenv("PEGAFLOW_MAX_CLIENTS", "12")
    config = config_from_args(["--pool-size", "2GiB", "--name", "from_flag", "--max-clients", "5"])
    # 2. The flag wins.
    assert (config.pool_bytes, config.name, config.num_slots) == (2 << 30, "from_flag", 5)


def test_config_from_args_sizes_and_numbers_parsed(clean_env):
    # 1. Size flags take units; ring slots and TTL are numbers.
    config = config_from_args(["--pool-size", "256MiB", "--slab-size", "1MiB", "--arena-size", "64KiB",
                               "--ring-slots", "32", "--lease-ttl", "2.5", "--idle-spin-ms", "0.5",
                               "--device-staging", "0"])
    assert config.device_staging_bytes == 0
    assert (config.pool_bytes, config.slab_bytes, config.arena_bytes) == (256 << 20, 1 << 20, 64 << 10)
    assert (config.ring_slots, config.lease_ttl_s, config.idle_spin_s) == (32, 2.5, 0.5e-3)


def test_config_from_args_slab_larger_than_pool_clamped_to_pool(clean_env):
    # 1. A pool smaller than the default 64 MiB slab: the slab shrinks to the pool.
    config = config_from_args(["--pool-size", "16MiB"])
    assert config.slab_bytes == config.pool_bytes == 16 << 20


@pytest.mark.parametrize("argv", [
    ["--pool-size", "lots"], ["--slab-size", "4XB"], ["--arena-size", "-1"], ["--pool-size", "0"],
    ["--name", "bad/name"], ["--max-clients", "0"], ["--ring-slots", "1"], ["--arena-size", "1KiB"],
    ["--lease-ttl", "0"], ["--idle-spin-ms", "-1"], ["--idle-spin-ms", "1001"],
])
def test_config_from_args_bad_flag_value_raises_config_error(clean_env, argv):
    # 1. A value argparse accepts but the config cannot: a ConfigError, not a traceback.
    with pytest.raises(ConfigError):
        config_from_args(argv)


@pytest.mark.parametrize("var,value", [
    ("PEGAFLOW_POOL_SIZE", "lots"), ("PEGAFLOW_NAME", "a.b"), ("PEGAFLOW_BACKEND", "gpu"),
    ("PEGAFLOW_COPY_BACKEND", "dma"), ("PEGAFLOW_MAX_CLIENTS", "many"), ("PEGAFLOW_LEASE_TTL_S", "soon"),
    ("PEGAFLOW_LOG_LEVEL", "LOUD"), ("PEGAFLOW_IDLE_SPIN_MS", "long"), ("PEGAFLOW_IDLE_SPIN_MS", "-2"),
    ("PEGAFLOW_KEEP_POOL", "maybe"),
])
def test_config_from_args_bad_env_value_raises_config_error(clean_env, var, value):
    # 1. Env defaults bypass argparse's type and choices checks: the config must catch them,
    #    as a ConfigError (which ``python -m engine`` prints as one line), not a traceback.
    clean_env.setenv(var, value)
    with pytest.raises(ConfigError):
        config_from_args([])


# -- EngineConfig validation ----------------------------------------------------------------------


@pytest.mark.parametrize("fields,message", [
    ({"name": ""}, "engine name"), ({"name": "x" * 65}, "engine name"),
    ({"pool_bytes": 0}, "--pool-size"), ({"slab_bytes": -1}, "--slab-size"),
    ({"backend": "gpu"}, "--backend"), ({"copy_backend": "dma"}, "--copy-backend"),
    ({"num_slots": 0}, "--max-clients"), ({"num_slots": 4097}, "--max-clients"),
    ({"ring_slots": 1}, "--ring-slots"), ({"arena_bytes": 4095}, "--arena-size"),
    ({"lease_ttl_s": 0.0}, "--lease-ttl"), ({"log_level": "LOUD"}, "log"),
    ({"idle_spin_s": -1e-3}, "--idle-spin-ms"), ({"idle_spin_s": 1.5}, "--idle-spin-ms"),
    ({"device_staging_bytes": -1}, "--device-staging"),
    ({"copy_backend": "staged", "device_staging_bytes": 0}, "--device-staging"),
])
def test_engine_config_out_of_range_field_raises_config_error(fields, message):
    # 1. Each bad field is refused at construction, naming the flag to fix.
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**fields)


@pytest.mark.parametrize("fields", [
    {"num_slots": 1}, {"num_slots": 4096}, {"ring_slots": 2}, {"arena_bytes": 4096},
    {"backend": "cuda"}, {"backend": "host"}, {"copy_backend": "kernel"}, {"copy_backend": "copy-engine"},
    {"copy_backend": "staged"}, {"device_staging_bytes": 0},
    {"name": "A" * 64}, {"idle_spin_s": 0.0}, {"idle_spin_s": 1.0},
])
def test_engine_config_boundary_values_accepted(fields):
    # 1. The limits themselves are valid.
    EngineConfig(**fields)


def test_engine_config_is_frozen():
    # 1. One config per process: it cannot be changed after validation.
    with pytest.raises(AttributeError):
        EngineConfig().pool_bytes = 1


def test_config_from_args_log_level_any_case(clean_env):
    # 1. --log-level takes the level in any case, as PEGAFLOW_LOG_LEVEL does.
    assert config_from_args(["--log-level", "debug"]).log_level == "DEBUG"
    clean_env.setenv("PEGAFLOW_LOG_LEVEL", "warning")
    assert config_from_args([]).log_level == "WARNING"


@pytest.mark.parametrize("fields,message", [
    ({"num_slots": 0}, r"--max-clients 0: must lie in \[1, 4096\]"),
    ({"ring_slots": 1}, "--ring-slots 1: must be at least 2"),
    ({"arena_bytes": 1024}, "--arena-size 1024 bytes: must be at least 4KiB"),
])
def test_engine_config_range_errors_name_the_value_and_the_bounds(fields, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**fields)


@pytest.mark.parametrize("ttl", [float("nan"), float("inf"), 0.0, -1.0])
def test_engine_config_lease_ttl_must_be_finite_and_positive(ttl):
    # A nan TTL would never expire a lease nor drop a stale half-written block.
    with pytest.raises(ConfigError, match="lease-ttl"):
        EngineConfig(lease_ttl_s=ttl)
