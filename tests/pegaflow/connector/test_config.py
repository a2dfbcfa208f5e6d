"""pegaflow.connector.config and .namespace: where each option comes from, and what makes bytes differ."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pegaflow.connector.config import ConnectorConfig
from pegaflow.connector.namespace import kv_fields, namespace_of, rank_namespace
from pegaflow.platform.errors import ConfigError

# -- ConnectorConfig.from_sources --------------------------------------------------------------


def test_connector_config_no_sources_gives_defaults():
    # 1. No extra_config and an empty environment: every field keeps its default.
    config = ConnectorConfig.from_sources(None, environ={})
    assert config == ConnectorConfig()
    assert (config.engine_name, config.load_mode, config.num_load_slots) == ("pegaflow", "auto", 64)
    assert config.enable_save and config.enable_load and not config.is_async_load


def test_connector_config_extra_config_beats_env_beats_default():
    # 1. The engine name in both sources, the load mode only in the env, the timeout nowhere.
    environ = {"PEGAFLOW_NAME": "from_env", "PEGAFLOW_LOAD_MODE": "async"}
    config = ConnectorConfig.from_sources({"engine_name": "from_extra"}, environ=environ)
    # 2. extra_config wins, then the env, then the default.
    assert config.engine_name == "from_extra"
    assert config.load_mode == "async" and config.is_async_load
    assert config.lookup_timeout_ms == 500.0


def test_connector_config_every_option_read_from_its_env_var():
    # 1. Every option set through its PEGAFLOW_* variable, all as strings.
    environ = {
        "PEGAFLOW_NAME": "eng-2", "PEGAFLOW_LOAD_MODE": "async", "PEGAFLOW_ENABLE_SAVE": "false",
        "PEGAFLOW_ENABLE_LOAD": "0", "PEGAFLOW_LOOKUP_TIMEOUT_MS": "7.5",
        "PEGAFLOW_COMMAND_TIMEOUT_MS": "900", "PEGAFLOW_RECONNECT_INTERVAL_S": "0.25",
        "PEGAFLOW_NUM_LOAD_SLOTS": "8", "PEGAFLOW_DISK_LOAD_MODE": "layerwise",
    }
    # 2. Each reaches its field, converted to the field's type.
    assert ConnectorConfig.from_sources({}, environ=environ) == ConnectorConfig(
        engine_name="eng-2", load_mode="async", enable_save=False, enable_load=False,
        lookup_timeout_ms=7.5, command_timeout_ms=900.0, reconnect_interval_s=0.25, num_load_slots=8,
        disk_load_mode="layerwise")


def test_connector_config_environ_none_reads_process_env(monkeypatch):
    # 1. Without an explicit environ, os.environ is the env source.
    monkeypatch.setenv("PEGAFLOW_NUM_LOAD_SLOTS", "3")
    assert ConnectorConfig.from_sources({}).num_load_slots == 3


@pytest.mark.parametrize("raw,expected", [
    ("1", True), ("true", True), ("YES", True), (" On ", True), (True, True), (1, True),
    ("0", False), ("False", False), ("no", False), ("off", False), (False, False), (0, False),
])
def test_connector_config_bool_spellings_parse(raw, expected):
    # 1. Each spelling, from extra_config and from the env (env values are strings).
    assert ConnectorConfig.from_sources({"enable_save": raw}, environ={}).enable_save is expected
    assert ConnectorConfig.from_sources({}, environ={"PEGAFLOW_ENABLE_LOAD": str(raw)}).enable_load is expected


@pytest.mark.parametrize("raw", ["maybe", "", "2", "tru", 2])
def test_connector_config_bad_bool_raises_config_error(raw):
    # 1. Anything but a known spelling is refused, naming the option.
    with pytest.raises(ConfigError, match="enable_load"):
        ConnectorConfig.from_sources({"enable_load": raw}, environ={})


def test_connector_config_unknown_key_raises_config_error_listing_it():
    # 1. A typo in kv_connector_extra_config is refused, not ignored.
    with pytest.raises(ConfigError, match="load_mod"):
        ConnectorConfig.from_sources({"load_mod": "async"}, environ={})


@pytest.mark.parametrize("key", ["load_mode", "disk_load_mode"])
@pytest.mark.parametrize("source", ["extra", "env"])
def test_connector_config_bad_load_mode_raises_config_error(source, key):
    # 1. load_mode and disk_load_mode must be layerwise or async, whichever source it came from.
    extra, environ = ({key: "eager"}, {}) if source == "extra" else ({}, {_env_name(key): "eager"})
    with pytest.raises(ConfigError, match=key):
        ConnectorConfig.from_sources(extra, environ=environ)


def test_connector_config_disk_hits_load_between_steps_by_default():
    # 1. A slow disk read delays only its own request unless told otherwise.
    assert ConnectorConfig.from_sources({}, environ={}).disk_load_mode == "async"


@pytest.mark.parametrize("name", ["", "a/b", "eng.1", "has space", "x" * 65])
def test_connector_config_bad_engine_name_raises_config_error(name):
    # 1. The engine name becomes part of POSIX shm names: refused from either source.
    with pytest.raises(ConfigError):
        ConnectorConfig.from_sources({"engine_name": name}, environ={})
    with pytest.raises(ConfigError):
        ConnectorConfig.from_sources({}, environ={"PEGAFLOW_NAME": name})


@pytest.mark.parametrize("key,raw", [
    ("lookup_timeout_ms", "fast"), ("num_load_slots", "1.5"), ("num_load_slots", "many"),
    ("command_timeout_ms", [5]),
])
def test_connector_config_unconvertible_number_raises_config_error(key, raw):
    # 1. A value that is not a number of the field's type is a ConfigError naming the option.
    with pytest.raises(ConfigError, match=key):
        ConnectorConfig.from_sources({key: raw}, environ={})


@pytest.mark.parametrize("key,raw", [
    ("lookup_timeout_ms", "0"), ("command_timeout_ms", "-1"), ("reconnect_interval_s", "0"),
    ("num_load_slots", "0"),
])
def test_connector_config_non_positive_number_raises_config_error(key, raw):
    # 1. Timeouts, intervals and slot counts must be positive.
    with pytest.raises(ConfigError, match=key):
        ConnectorConfig.from_sources({}, environ={_env_name(key): raw})


@pytest.mark.parametrize("key,raw,expected", [
    ("lookup_timeout_ms", float("nan"), "expected a finite number"),
    ("lookup_timeout_ms", float("inf"), "expected a finite number"),
    ("lookup_timeout_ms", "nan", "expected a finite number"),
    ("command_timeout_ms", "inf", "expected a finite number"),
    ("reconnect_interval_s", True, "expected a number"),
    ("num_load_slots", 2.7, "expected a whole number"),
    ("num_load_slots", "2.7", "expected a whole number"),
    ("num_load_slots", True, "expected a whole number"),
    ("num_load_slots", "true", "expected a whole number"),
    ("engine_name", 5, "expected text"),
])
def test_connector_config_bad_value_is_refused_naming_it_once(key, raw, expected):
    # 1. nan/inf never reach a deadline, 2.7 is never 2 slots nor true 1: each is refused.
    with pytest.raises(ConfigError) as refused:
        ConnectorConfig.from_sources({key: raw}, environ={})
    # 2. One message: the option and its value once, then what was expected.
    assert str(refused.value) == f"{key}={raw!r}: {expected}"


@pytest.mark.parametrize("key,raw", [("num_load_slots", "2.7"), ("lookup_timeout_ms", "nan")])
def test_connector_config_bad_env_value_names_the_variable(key, raw):
    with pytest.raises(ConfigError) as refused:
        ConnectorConfig.from_sources({}, environ={_env_name(key): raw})
    assert str(refused.value).startswith(f"{_env_name(key)}={raw!r}: expected a")


def test_connector_config_nan_timeout_built_directly_is_refused():
    # 1. The dataclass itself refuses what from_sources would (nan compares false to 0).
    with pytest.raises(ConfigError, match="lookup_timeout_ms"):
        ConnectorConfig(lookup_timeout_ms=float("nan"))


def _env_name(key: str) -> str:
    return "PEGAFLOW_" + key.upper()


def test_connector_config_is_frozen():
    # 1. One config per process: it cannot be changed after validation.
    config = ConnectorConfig()
    with pytest.raises(AttributeError):
        config.load_mode = "async"


# -- namespace ----------------------------------------------------------------------------------

BASE_FIELDS = {
    "model": "/models/llama-3-8b", "revision": "main", "dtype": "torch.bfloat16", "cache_dtype": "auto",
    "kv_layout": "LBNHC", "hash_algo": "sha256", "tp_size": 2, "pp_size": 1,
    "groups": [{"type": "FullAttentionSpec", "layers": 32, "block_size": 16, "num_kv_heads": 8,
                "head_size": 128, "dtype": "torch.bfloat16"}],
}


def test_namespace_of_equal_dicts_in_any_key_order_agree():
    # 1. The same fields, keys (also nested ones) inserted in reverse order.
    reordered = {k: BASE_FIELDS[k] for k in reversed(BASE_FIELDS)}
    reordered["groups"] = [dict(reversed(list(BASE_FIELDS["groups"][0].items())))]
    # 2. One namespace: a nonzero 64-bit integer.
    assert namespace_of(reordered) == namespace_of(dict(BASE_FIELDS))
    assert 0 < namespace_of(BASE_FIELDS) < 1 << 64


@pytest.mark.parametrize("key,value", [
    ("model", "/models/llama-3-70b"), ("revision", "v2"), ("dtype", "torch.float16"),
    ("cache_dtype", "fp8"), ("kv_layout", "LBHNC"), ("hash_algo", "sha256_cbor"),
    ("tp_size", 4), ("pp_size", 2),
])
def test_namespace_of_any_top_level_field_differs_namespace_differs(key, value):
    # 1. Change one field: the fingerprint changes.
    assert namespace_of({**BASE_FIELDS, key: value}) != namespace_of(BASE_FIELDS)


@pytest.mark.parametrize("key,value", [
    ("type", "SlidingWindowSpec"), ("layers", 16), ("block_size", 32), ("num_kv_heads", 4),
    ("head_size", 64), ("dtype", "torch.float8_e4m3fn"),
])
def test_namespace_of_any_group_field_differs_namespace_differs(key, value):
    # 1. Change one field of the KV cache group: the fingerprint changes.
    changed = {**BASE_FIELDS, "groups": [{**BASE_FIELDS["groups"][0], key: value}]}
    assert namespace_of(changed) != namespace_of(BASE_FIELDS)


def test_rank_namespace_each_tp_and_pp_rank_differs():
    # 1. Ranks of one deployment hold different heads or layers: one namespace each.
    namespaces = {rank_namespace(BASE_FIELDS, tp, pp) for tp in range(4) for pp in range(2)}
    assert len(namespaces) == 8
    # 2. The same rank always gets the same namespace (scheduler and worker must agree).
    assert rank_namespace(BASE_FIELDS, 1, 0) == rank_namespace(dict(BASE_FIELDS), 1)


def _fake_configs(**overrides):
    """The attributes kv_fields reads of VllmConfig and KVCacheConfig, with ``overrides``."""
    values = dict(model="/m/llama", revision=None, dtype="torch.bfloat16", cache_dtype="auto",
                  kv_cache_layout="LBNHC", hash_algo="sha256", tp_size=1, pp_size=1,
                  block_size=16, num_kv_heads=8, head_size=128, spec_dtype="torch.bfloat16", num_layers=4,
                  quantization=None, hf_overrides={}, load_format="auto", seed=0)
    values.update(overrides)
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(model=values["model"], revision=values["revision"], dtype=values["dtype"],
                                     quantization=values["quantization"],
                                     hf_overrides=values["hf_overrides"], seed=values["seed"],
                                     get_total_num_hidden_layers=lambda: values["num_layers"]),
        load_config=SimpleNamespace(load_format=values["load_format"]),
        cache_config=SimpleNamespace(cache_dtype=values["cache_dtype"], kv_cache_layout=values["kv_cache_layout"],
                                     prefix_caching_hash_algo=values["hash_algo"]),
        parallel_config=SimpleNamespace(tensor_parallel_size=values["tp_size"],
                                        pipeline_parallel_size=values["pp_size"]))
    spec = SimpleNamespace(block_size=values["block_size"], num_kv_heads=values["num_kv_heads"],
                           head_size=values["head_size"], dtype=values["spec_dtype"])
    group = SimpleNamespace(kv_cache_spec=spec, layer_names=[f"l{i}" for i in range(values["num_layers"])])
    return vllm_config, SimpleNamespace(kv_cache_groups=[group])


@pytest.mark.parametrize("override", [
    {"model": "/m/qwen"}, {"revision": "abc123"}, {"dtype": "torch.float16"}, {"cache_dtype": "fp8"},
    {"kv_cache_layout": "LHBNC"}, {"hash_algo": "xxhash"}, {"tp_size": 2}, {"pp_size": 2},
    {"block_size": 32}, {"num_kv_heads": 4}, {"head_size": 64}, {"spec_dtype": "torch.float8_e4m3fn"},
    {"num_layers": 8}, {"quantization": "fp8"}, {"hf_overrides": {"num_hidden_layers": 2}},
    {"load_format": "dummy"},
])
def test_kv_fields_any_config_change_changes_rank_namespace(override):
    # 1. Fields read from two vLLM configs that differ in one setting.
    base = kv_fields(*_fake_configs())
    changed = kv_fields(*_fake_configs(**override))
    # 2. Their namespaces differ for the same rank.
    assert rank_namespace(changed, 0) != rank_namespace(base, 0)


def test_kv_fields_same_configs_same_namespace():
    # 1. Scheduler and worker read equal configs: they agree on the namespace.
    assert rank_namespace(kv_fields(*_fake_configs()), 0) == rank_namespace(kv_fields(*_fake_configs()), 0)


def test_kv_transfer_config_names_the_connector_and_passes_options():
    pytest.importorskip("vllm")
    from pegaflow.connector import kv_transfer_config
    # 1. vLLM's config points at our class and module, both roles, with our options.
    config = kv_transfer_config("mine", load_mode="async")
    assert (config.kv_connector, config.kv_connector_module_path, config.kv_role) == (
        "PegaKVConnector", "pegaflow.connector", "kv_both")
    assert config.kv_connector_extra_config == {"engine_name": "mine", "load_mode": "async"}
    # 2. A cache miss never fails a request, from the config on (not only once the
    #    connector has started and changed it).
    assert getattr(config, "kv_load_failure_policy", "recompute") == "recompute"
    # 3. A misspelt option fails here, before vLLM starts.
    with pytest.raises(ConfigError, match="lod_mode"):
        kv_transfer_config(lod_mode="async")


def test_kv_transfer_config_passes_options_converted_and_refuses_none():
    pytest.importorskip("vllm")
    from pegaflow.connector import kv_transfer_config
    # 1. Numbers and switches given as text reach vLLM's config as numbers and bools.
    config = kv_transfer_config("mine", lookup_timeout_ms="200", num_load_slots="8", enable_save="off")
    assert config.kv_connector_extra_config == {"engine_name": "mine", "lookup_timeout_ms": 200.0,
                                                "num_load_slots": 8, "enable_save": False}
    # 2. None is no engine name (nor any option's value): refused, naming the key.
    with pytest.raises(ConfigError, match=r"^engine_name=None: give a value"):
        kv_transfer_config(None)
    with pytest.raises(ConfigError, match=r"^lookup_timeout_ms=None"):
        kv_transfer_config("mine", lookup_timeout_ms=None)
    # 3. Text that is no number: refused, naming the key and the value.
    with pytest.raises(ConfigError, match=r"lookup_timeout_ms='fast': expected a number"):
        kv_transfer_config("mine", lookup_timeout_ms="fast")


@pytest.mark.parametrize("key, value, expected", [
    ("lookup_timeout_ms", "200", "a number"), ("num_load_slots", 8.0, "a whole number"),
    ("enable_save", "yes", "true or false"), ("engine_name", None, "text"), ("load_mode", 1, "text"),
    ("num_load_slots", True, "a whole number"),
])
def test_connector_config_built_directly_refuses_a_value_of_another_type(key, value, expected):
    # 1. ConnectorConfig(...) itself (from_sources converts; a direct caller must):
    #    a ConfigError naming the field, never a TypeError from a comparison, nor kept as is.
    with pytest.raises(ConfigError, match=f"^{key}={value!r}: expected {expected}$"):
        ConnectorConfig(**{key: value})


def test_kv_fields_dummy_weights_of_another_seed_differ_real_weights_ignore_the_seed():
    # 1. Dummy weights are drawn from the seed: another seed, other KV bytes.
    dummy = [rank_namespace(kv_fields(*_fake_configs(load_format="dummy", seed=s)), 0) for s in (0, 1)]
    assert dummy[0] != dummy[1]
    # 2. Real weights do not depend on it: instances with other seeds share blocks.
    real = [rank_namespace(kv_fields(*_fake_configs(seed=s)), 0) for s in (0, 1)]
    assert real[0] == real[1]


def test_kv_fields_weights_replaced_in_place_change_the_namespace(tmp_path):
    # 1. A local model directory; the namespace of its current files.
    (tmp_path / "config.json").write_text("{}")
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\0" * 64)
    before = rank_namespace(kv_fields(*_fake_configs(model=str(tmp_path))), 0)
    assert rank_namespace(kv_fields(*_fake_configs(model=str(tmp_path))), 0) == before
    # 2. New weights written over the old file (another size): another namespace.
    weights.write_bytes(b"\1" * 128)
    assert rank_namespace(kv_fields(*_fake_configs(model=str(tmp_path))), 0) != before


def test_kv_fields_callable_hf_overrides_give_one_namespace_in_every_process():
    # vLLM accepts a function as hf_overrides: its repr holds an address that differs per
    # process, which would give the scheduler and the workers different namespaces.
    def shrink(config):
        return config

    fields = kv_fields(*_fake_configs(hf_overrides=shrink))
    assert "0x" not in fields["hf_overrides"] and fields["hf_overrides"].endswith('shrink"')


def test_kv_fields_hf_overrides_canonical_whatever_the_hash_seed_or_process():
    import enum
    import functools
    import subprocess
    import sys

    class Mode(enum.Enum):
        FAST = 1

    def shrink(config, layers):
        return config

    # 1. A set inside: sorted, so every process writes the same text.
    fields = kv_fields(*_fake_configs(hf_overrides={"b": {"y", "x", "z"}, "a": 1}))
    assert fields["hf_overrides"] == '{"a": 1, "b": ["x", "y", "z"]}'
    # 2. A partial (how vLLM itself passes a function) and values with a plain text (an
    #    Enum member, a Path): by name and text, no address.
    from pathlib import Path
    text = kv_fields(*_fake_configs(hf_overrides={
        "f": functools.partial(shrink, layers=2), "m": Mode.FAST, "p": Path("/m")}))["hf_overrides"]
    assert "0x" not in text and "shrink" in text and "Mode.FAST" in text and "/m" in text
    # 3. The same overrides in another process (another hash seed) give the same text.
    code = ("from pegaflow.connector.namespace import _stable_text; "
            "print(_stable_text({'b': {'y', 'x', 'z'}, 'c': frozenset({'q', 'p'})}))")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": "12345", "PATH": ""})
    from pegaflow.connector.namespace import _stable_text
    assert other.stdout.strip() == _stable_text({"b": {"y", "x", "z"}, "c": frozenset({"q", "p"})})


def test_kv_fields_hf_overrides_without_a_stable_text_share_nothing(caplog):
    # An object whose text is its address: this process's namespace is its own (no wrong
    # sharing, no failure to start), and a warning says so.
    import logging
    caplog.set_level(logging.WARNING, logger="pegaflow.connector.namespace")
    first = kv_fields(*_fake_configs(hf_overrides={"a": object()}))
    second = kv_fields(*_fake_configs(hf_overrides={"a": object()}))
    assert first["hf_overrides"] != second["hf_overrides"]
    assert "shares no KV blocks" in caplog.text
