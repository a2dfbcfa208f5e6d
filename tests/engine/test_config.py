"""engine.config: sizes, flags over PEGAFLOW_* env vars over defaults, and validation."""

from __future__ import annotations

import os

import pytest

from engine.config import EngineConfig
from engine.process.options import OPTIONS, config_from_args
from pegaflow.platform.errors import ConfigError

_ENV_VARS = [option.env for option in OPTIONS]


@pytest.fixture
def clean_env(monkeypatch):
    """No PEGAFLOW_* variable of the host leaks into a test; the test sets its own."""
    for name in _ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


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
    clean_env.setenv("PEGAFLOW_BACKEND", "cuda")
    clean_env.setenv("PEGAFLOW_COPY_BACKEND", "kernel")
    clean_env.setenv("PEGAFLOW_MAX_CLIENTS", "12")
    clean_env.setenv("PEGAFLOW_LEASE_TTL", "30")
    clean_env.setenv("PEGAFLOW_LOG_LEVEL", "DEBUG")
    clean_env.setenv("PEGAFLOW_IDLE_SPIN_MS", "10")
    clean_env.setenv("PEGAFLOW_KEEP_POOL", "1")
    clean_env.setenv("PEGAFLOW_DEVICE_STAGING", "64MiB")
    config = config_from_args([])
    # 2. Each reaches the config.
    assert config == EngineConfig(name="from_env", pool_bytes=1 << 30, slab_bytes=16 << 20, backend="cuda",
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
    ("PEGAFLOW_COPY_BACKEND", "dma"), ("PEGAFLOW_MAX_CLIENTS", "many"), ("PEGAFLOW_LEASE_TTL", "soon"),
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
    from engine.process.options import OPTIONS
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


def test_config_pin_threads_auto_or_a_positive_number(clean_env):
    assert config_from_args(["--pin-threads", "auto"]).pin_threads == 0
    assert config_from_args(["--pin-threads", "12"]).pin_threads == 12
    with pytest.raises(ConfigError, match="--pin-threads '0'"):
        config_from_args(["--pin-threads", "0"])


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


# -- one table for flags, env vars, defaults and help --------------------------------------------


def test_options_table_is_the_parser_the_env_and_the_help(clean_env):
    # 1. The parser has exactly the table's flags (and --help, --version, the --clean command).
    from engine.process.options import build_parser
    parser = build_parser()
    flags = {s for a in parser._actions for s in a.option_strings if s.startswith("--")}
    expected = {f"--{o.flag}" for o in OPTIONS} | {f"--no-{o.flag}" for o in OPTIONS if o.is_switch}
    assert flags - {"--help", "--version", "--clean"} == expected
    # 2. Each flag's help names its env var and its default (none said for an empty one).
    text = " ".join(parser.format_help().split())
    for option in OPTIONS:
        said = f"env {option.env}; default {option.default})" if option.default else f"env {option.env})"
        assert said in text, option.flag
    assert "default )" not in text and "``" not in text
    # 3. The table's defaults are EngineConfig's defaults.
    assert config_from_args([], environ={}) == EngineConfig()


_SAMPLES = {  # flag -> (what a person writes, the value it means)
    "name": ("x1", "x1"), "pool-size": ("1GiB", 1 << 30), "slab-size": ("1MiB", 1 << 20),
    "backend": ("cuda", "cuda"), "copy-backend": ("kernel", "kernel"), "device-staging": ("8MiB", 8 << 20),
    "max-clients": ("7", 7), "ring-slots": ("64", 64), "arena-size": ("1MiB", 1 << 20),
    "lease-ttl": ("9", 9.0), "idle-spin-ms": ("0.5", 0.5e-3), "keep-pool": ("on", True),
    "hold-saves": ("on", True), "load-layer-groups": ("4", 4), "pin-chunk": ("64MiB", 64 << 20),
    "pin-threads": ("3", 3), "pin-rate": ("1GiB", 1 << 30), "log-level": ("debug", "DEBUG"),
    "disk-path": ("/tmp/pfd0,/tmp/pfd1", ("/tmp/pfd0", "/tmp/pfd1")), "disk-size": ("2GiB", 2 << 30),
    "disk-admission": ("all", "all"), "disk-threads": ("3", 3), "remote": ("mooncake", "mooncake"),
    "remote-master": ("10.0.0.1:50051", "10.0.0.1:50051"),
    "remote-metadata": ("http://10.0.0.1:8080/metadata", "http://10.0.0.1:8080/metadata"),
    "remote-protocol": ("rdma", "rdma"), "remote-device": ("mlx5_0", "mlx5_0"),
    "remote-host": ("10.0.0.2", "10.0.0.2"), "remote-segment-size": ("2GiB", 2 << 30),
    "remote-publish": ("reused", "reused"), "remote-timeout-ms": ("20", 20e-3),
    "lookup-wait-ms": ("15", 15e-3), "remote-start-timeout": ("3", 3.0), "compute-once": ("off", False),
}


@pytest.mark.parametrize("option", OPTIONS, ids=lambda o: o.flag)
def test_options_each_env_var_and_flag_set_their_field(clean_env, option):
    # 1. Every option has a sample here, with the value it means: a new row without one fails.
    sample, meant = _SAMPLES[option.flag]
    default = getattr(EngineConfig(), option.field)
    # 2. Its env var alone sets its field to the value the sample means, and so does its flag.
    from_env = getattr(config_from_args([], environ={option.env: sample}), option.field)
    switch = f"--no-{option.flag}" if default is True else f"--{option.flag}"  # (a switch on by default)
    argv = [switch] if option.is_switch else [f"--{option.flag}", sample]
    from_flag = getattr(config_from_args(argv, environ={}), option.field)
    expected = pytest.approx(meant, rel=1e-12) if isinstance(meant, float) else meant
    assert from_env == expected and from_flag == expected
    assert meant != default  # (else the sample would show nothing)


def test_options_docs_table_lists_every_flag_with_its_env_var():
    # docs/configuration.md's engine flag table cannot drift from the code: a row per flag, its variable beside it.
    from pathlib import Path
    docs = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    for option in OPTIONS:
        assert f"| `--{option.flag}` | `{option.env}` |" in docs, option.flag


def test_config_disk_paths_are_absolute_and_distinct(clean_env):
    config = config_from_args(["--disk-path", " a/b , /c "], environ={})
    assert config.disk_paths == (os.path.abspath("a/b"), "/c")
    with pytest.raises(ConfigError, match="twice"):
        config_from_args(["--disk-path", "/c,/c/"], environ={})
    with pytest.raises(ConfigError, match="disk-admission"):
        config_from_args(["--disk-admission", "everything"], environ={})


def test_warn_unknown_env_names_the_likely_setting(caplog):
    # 1. A misspelt variable is named, with the one meant; known ones are quiet.
    from engine.process.options import warn_unknown_env
    unknown = warn_unknown_env({"PEGAFLOW_POOL_SIZ": "5", "PEGAFLOW_POOL_SIZE": "1GiB",
                                "PEGAFLOW_LOAD_MODE": "async", "OTHER": "1"})
    assert unknown == ["PEGAFLOW_POOL_SIZ"]
    assert "did you mean PEGAFLOW_POOL_SIZE?" in caplog.text


def test_config_old_env_name_still_applies_with_a_warning(clean_env, caplog):
    # PEGAFLOW_LEASE_TTL_S (the old name) keeps working, unless the new name is set too.
    from engine.process.options import warn_unknown_env
    assert config_from_args([], environ={"PEGAFLOW_LEASE_TTL_S": "5"}).lease_ttl_s == 5.0
    both = {"PEGAFLOW_LEASE_TTL_S": "5", "PEGAFLOW_LEASE_TTL": "7"}
    assert config_from_args([], environ=both).lease_ttl_s == 7.0
    assert warn_unknown_env({"PEGAFLOW_LEASE_TTL_S": "5"}) == []
    assert "PEGAFLOW_LEASE_TTL_S is the old name of PEGAFLOW_LEASE_TTL (still read when" in caplog.text


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
