"""engine/process/options.py: one table of options is the parser, the env vars and the help;
a flag beats its PEGAFLOW_* variable, which beats the default; values parsed as a person writes
them; an unknown or old variable named in the log."""

from __future__ import annotations

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


def test_config_pin_threads_auto_or_a_positive_number(clean_env):
    assert config_from_args(["--pin-threads", "auto"]).pin_threads == 0
    assert config_from_args(["--pin-threads", "12"]).pin_threads == 12
    with pytest.raises(ConfigError, match="--pin-threads '0'"):
        config_from_args(["--pin-threads", "0"])


def test_config_from_args_log_level_any_case(clean_env):
    # 1. --log-level takes the level in any case, as PEGAFLOW_LOG_LEVEL does.
    assert config_from_args(["--log-level", "debug"]).log_level == "DEBUG"
    clean_env.setenv("PEGAFLOW_LOG_LEVEL", "warning")
    assert config_from_args([]).log_level == "WARNING"


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
    docs = (Path(__file__).resolve().parents[3] / "docs" / "configuration.md").read_text()
    for option in OPTIONS:
        assert f"| `--{option.flag}` | `{option.env}` |" in docs, option.flag


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
