"""tools/lib/engine_variants.py: a variant's engine flags, its name in JSON keys, and the
serving benches' configurations it becomes."""

from __future__ import annotations

from tools.lib.engine_variants import engine_flags, variant_config, variant_name, variant_of, with_variants


def test_engine_variants_are_flags_without_dashes_joined_by_plus():
    assert engine_flags("load-layer-groups=4+hold-saves") == ["--load-layer-groups=4", "--hold-saves"]
    assert engine_flags("default") == engine_flags(None) == []
    assert variant_name("load-layer-groups=4+hold-saves") == "load-layer-groups4+hold-saves"
    assert variant_name(None) == "default"
    # Every flag a variant of the defaults sweep names is one the engine takes, with the value meant.
    from engine.process.options import config_from_args
    config = config_from_args(engine_flags("load-layer-groups=8+hold-saves"), environ={})
    assert config.hold_saves is True and config.load_layer_groups == 8


def test_engine_variants_take_pegaflows_place_among_the_configurations():
    # 1. Each variant a configuration of its own, where pegaflow stood (default: pegaflow itself).
    variants = ["default", "hold-saves", "load-layer-groups=4"]
    assert with_variants(["none", "pegaflow", "native"], variants) == [
        "none", "pegaflow", "pegaflow+hold-saves", "pegaflow+load-layer-groups=4", "native"]
    # 2. Appended where pegaflow was not asked for; nothing changes without variants.
    assert with_variants(["none"], ["hold-saves"]) == ["none", "pegaflow+hold-saves"]
    assert with_variants(["none", "pegaflow"], None) == ["none", "pegaflow"]
    # 3. A configuration's name gives its variant back.
    assert variant_of(variant_config("load-layer-groups=4+hold-saves")) == "load-layer-groups=4+hold-saves"
    assert variant_of("pegaflow") is None and variant_of("pegaflow-rs") is None
