"""engine/config.py: every option's value checked in one place (ranges, bounds, combinations), as
EngineConfig and through the flags that fill it; the parsing of flags and env vars is
tests/engine/process/test_options.py's."""

from __future__ import annotations

import os

import pytest

from engine.config import EngineConfig
from engine.process.options import OPTIONS, config_from_args
from pegaflow.platform.errors import ConfigError
from tests.engine.process.option_env import clear_option_env


@pytest.fixture
def clean_env(monkeypatch):
    """No PEGAFLOW_* variable of the host leaks into a test; the test sets its own."""
    return clear_option_env(monkeypatch)


# -- config_from_args ---------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [
    ["--pool-size", "lots"], ["--slab-size", "4XB"], ["--arena-size", "-1"], ["--pool-size", "0"],
    ["--name", "bad/name"], ["--max-clients", "0"], ["--ring-slots", "1"], ["--arena-size", "1KiB"],
    ["--lease-ttl", "0"], ["--idle-spin-ms", "-1"], ["--idle-spin-ms", "1001"],
])
def test_config_from_args_bad_flag_value_raises_config_error(clean_env, argv):
    # 1. A value argparse accepts but the config cannot: a ConfigError, not a traceback.
    with pytest.raises(ConfigError):
        config_from_args(argv)


# -- EngineConfig validation ----------------------------------------------------------------------


@pytest.mark.parametrize("fields,message", [
    ({"name": ""}, "engine name"), ({"name": "x" * 65}, "engine name"),
    ({"pool_bytes": 0}, "--pool-size"), ({"slab_bytes": -1}, "--slab-size"),
    ({"pool_bytes": 1 << 20, "slab_bytes": 2 << 20}, "--slab-size 2.0 MiB exceeds --pool-size"),
    ({"backend": "gpu"}, "--backend"), ({"copy_backend": "dma"}, "--copy-backend"),
    ({"num_slots": 0}, "--max-clients"), ({"num_slots": 4097}, "--max-clients"),
    ({"ring_slots": 1}, "--ring-slots"), ({"arena_bytes": 4095}, "--arena-size"),
    ({"lease_ttl_s": 0.0}, "--lease-ttl"), ({"log_level": "LOUD"}, "log"),
    ({"idle_spin_s": -1e-3}, "--idle-spin-ms"), ({"idle_spin_s": 1.5}, "--idle-spin-ms"),
    ({"device_staging_bytes": -1}, "--device-staging"),
    ({"copy_backend": "staged", "device_staging_bytes": 0}, "--device-staging"),
    ({"pin_chunk_bytes": 0}, "--pin-chunk"), ({"pin_threads": -1}, "--pin-threads"),
    ({"pin_threads": 257}, "--pin-threads"), ({"pin_rate_bytes": -1}, "--pin-rate"),
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
    {"lease_ttl_s": 1e-3}, {"lease_ttl_s": 86400.0}, {"remote_timeout_s": 2.0},
])
def test_engine_config_boundary_values_accepted(fields):
    # 1. The limits themselves are valid, and kept as given.
    config = EngineConfig(**fields)
    assert {field: getattr(config, field) for field in fields} == fields


DURATION_FLAGS = ("lease-ttl", "idle-spin-ms", "remote-timeout-ms", "lookup-wait-ms", "remote-start-timeout")


@pytest.mark.parametrize("flag", DURATION_FLAGS)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e300", "-1", "86401000"])
def test_config_duration_flag_refuses_nan_inf_and_absurd_values(clean_env, flag, value):
    # Every duration flag: a value that is no duration, or one past its documented bound
    # (a lease that never ends, a spin or wait of days), is one ConfigError naming the flag.
    with pytest.raises(ConfigError, match=f"--{flag}"):
        config_from_args([f"--{flag}={value}"], environ={})


def test_config_duration_flags_are_every_duration_option():
    # A new duration option is covered above, or this fails.
    durations = {o.flag for o in OPTIONS if o.field.endswith("_s")}
    assert durations == set(DURATION_FLAGS)


@pytest.mark.parametrize("pool,slab,chunk,expected", [
    (64 << 30, 64 << 20, 256 << 20, 256 << 20),   # the default: 4 slabs
    (64 << 30, 64 << 20, 100 << 20, 128 << 20),   # rounded up to whole slabs
    (1 << 30, 64 << 20, 4 << 30, 1 << 30),        # at most the pool: all of it before serving
    (10 ** 10, 10 ** 9, 1, 8 * 10 ** 9),          # slabs off a page: chunks end on a page
])
def test_engine_config_pin_chunk_is_whole_slabs_ending_on_a_page(pool, slab, chunk, expected):
    assert EngineConfig(pool_bytes=pool, slab_bytes=slab, pin_chunk_bytes=chunk).pin_chunk == expected


def test_engine_config_is_frozen():
    # 1. One config per process: it cannot be changed after validation.
    with pytest.raises(AttributeError):
        EngineConfig().pool_bytes = 1


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


def test_config_disk_paths_are_absolute_and_distinct(clean_env):
    config = config_from_args(["--disk-path", " a/b , /c "], environ={})
    assert config.disk_paths == (os.path.abspath("a/b"), "/c")
    with pytest.raises(ConfigError, match="twice"):
        config_from_args(["--disk-path", "/c,/c/"], environ={})
    with pytest.raises(ConfigError, match="disk-admission"):
        config_from_args(["--disk-admission", "everything"], environ={})


def test_config_gpu_copy_path_with_the_host_backend_is_refused():
    with pytest.raises(ConfigError, match="--copy-backend staged is a GPU copy path"):
        EngineConfig(backend="host", copy_backend="staged")


def test_config_decimal_and_binary_sizes_mean_what_they_say(clean_env):
    # 4GB is 4 * 10**9 bytes: accepted, as whole slabs of it (the remainder is not allocated).
    config = config_from_args(["--pool-size", "4GB"], environ={})
    assert config.pool_bytes == 4 * 10**9 and config.usable_pool_bytes == 59 * (64 << 20)


def test_config_remote_values_are_checked(clean_env):
    with pytest.raises(ConfigError, match="remote-master"):
        config_from_args(["--remote-master", "nohost"], environ={})
    with pytest.raises(ConfigError, match="remote-protocol"):
        config_from_args(["--remote-protocol", "udp"], environ={})
    with pytest.raises(ConfigError, match="remote-timeout-ms"):
        config_from_args(["--remote-timeout-ms", "0"], environ={})
    with pytest.raises(ConfigError, match="lookup-wait-ms"):
        config_from_args(["--lookup-wait-ms", "-1"], environ={})
    with pytest.raises(ConfigError, match="remote"):
        config_from_args(["--remote", "redis"], environ={})
    assert config_from_args([], environ={}).remote == "off"
    for bad in ("0", "-1", "nan", "inf", "601", "soon"):
        with pytest.raises(ConfigError, match="--remote-start-timeout"):
            config_from_args(["--remote-start-timeout", bad], environ={})
    assert config_from_args(["--remote-start-timeout", "2.5"], environ={}).remote_start_timeout_s == 2.5


def _option_checks_outside_config() -> list[str]:
    """Each ``if <options only>: raise ConfigError`` of engine/ outside config.py: an ``if``
    whose test reads no name but EngineConfig's fields (and constants)."""
    import ast
    import dataclasses
    from pathlib import Path

    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    engine = Path(__file__).resolve().parents[2] / "engine"
    found = []
    for path in sorted(engine.rglob("*.py")):
        if path == engine / "config.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.If):
                continue
            raised = {n.id for r in node.body if isinstance(r, ast.Raise) for n in ast.walk(r)
                      if isinstance(n, ast.Name)}
            if "ConfigError" not in raised:
                continue
            names = {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node.test)
                     if isinstance(n, (ast.Name, ast.Attribute))} - {"self"}
            names = {n for n in names if not n.isupper()}  # constants (PATHS, STAGED) stay
            if names and names <= fields:
                found.append(f"{path.relative_to(engine)}:{node.lineno} {ast.unparse(node.test)}")
    return found


def test_engine_config_is_the_one_home_of_each_option_check():
    # 1. No other engine module refuses an option's value on its own: the config did.
    assert _option_checks_outside_config() == []


def test_engine_config_load_layer_groups_below_one_raises_config_error():
    with pytest.raises(ConfigError, match="--load-layer-groups"):
        EngineConfig(load_layer_groups=0)
