"""pegaflow's engine started with other flags, measured beside its defaults in one run of a bench
(``--engine-variants``: bench_ttft, bench_serving, bench_replicas).

A variant is the engine's flags written without their dashes and joined by ``+``: ``default``
(none), ``hold-saves``, ``load-layer-groups=4+hold-saves``.  In the serving benches each variant
is a configuration of its own, ``pegaflow`` (``default``) or ``pegaflow+<variant>``
(``pegaflow+hold-saves``), run with a fresh engine and interleaved with the others under
``--repeat`` (A B C A B C); bench_ttft runs its pegaflow phase once per variant and repeat, in
the same order.
"""

from __future__ import annotations

import argparse

PREFIX = "pegaflow+"  # a variant's configuration name: this, then the variant


def add_variants_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine-variants", nargs="+", metavar="FLAGS",
                   help="run pegaflow once per variant, each a fresh engine started with its flags, written "
                        "without dashes and joined by '+' ('default': none), e.g. default hold-saves "
                        "load-layer-groups=4+hold-saves")


def engine_flags(variant: str | None) -> list[str]:
    """The engine's flags of ``variant`` (``default`` or None: none)."""
    if not variant or variant == "default":
        return []
    return [f"--{flag}" for flag in variant.split("+")]


def variant_name(variant: str | None) -> str:
    """A variant's name in JSON keys: without its '=' (``load-layer-groups=4`` -> ``load-layer-groups4``)."""
    return (variant or "default").replace("=", "")


def variant_config(variant: str) -> str:
    """The serving benches' configuration of ``variant``: ``pegaflow`` or ``pegaflow+<variant>``."""
    return "pegaflow" if variant == "default" else PREFIX + variant


def variant_of(config: str) -> str | None:
    """The variant a configuration name carries (None: not a variant's)."""
    return config[len(PREFIX):] if config.startswith(PREFIX) else None


def with_variants(configs: list[str], variants: list[str] | None) -> list[str]:
    """``configs`` with ``pegaflow`` replaced, where it stands, by each variant's configuration
    (appended where ``configs`` has no ``pegaflow``); without variants, ``configs``."""
    if not variants:
        return list(configs)
    mine = [variant_config(v) for v in dict.fromkeys(variants)]
    if "pegaflow" not in configs:
        return [*configs, *mine]
    out: list[str] = []
    for config in configs:
        out += mine if config == "pegaflow" else [config]
    return out
