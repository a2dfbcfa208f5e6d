"""The namespace: a 64-bit fingerprint of everything that makes KV bytes incompatible.

Two vLLM instances share blocks only when model, dtypes, layer count, KV heads, head
size, block size, KV layout, TP/PP size and rank all agree.  The scheduler and each
worker compute it from the same config, so a lookup and a load always agree.
"""

from __future__ import annotations

import hashlib
import json

from pegaflow.wire import WIRE_VERSION


def namespace_of(fields: dict) -> int:
    """Fingerprint of a dict of JSON-serialisable fields (order-independent)."""
    text = json.dumps({"wire": WIRE_VERSION, **fields}, sort_keys=True, default=str)
    value = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
    return value or 1


def kv_fields(vllm_config, kv_cache_config) -> dict:
    """What every rank's KV bytes depend on, read from vLLM's configs."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    groups = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        groups.append({
            "type": type(spec).__name__, "layers": len(group.layer_names),
            "block_size": spec.block_size, "num_kv_heads": getattr(spec, "num_kv_heads", None),
            "head_size": getattr(spec, "head_size", None), "dtype": str(getattr(spec, "dtype", "")),
        })
    return {
        "model": str(model.model), "revision": str(getattr(model, "revision", None)),
        "dtype": str(model.dtype), "cache_dtype": str(cache.cache_dtype),
        "kv_layout": str(getattr(cache, "kv_cache_layout", None) or _legacy_layout()),
        "hash_algo": str(getattr(cache, "prefix_caching_hash_algo", "")),
        "tp_size": parallel.tensor_parallel_size, "pp_size": parallel.pipeline_parallel_size,
        "groups": groups,
    }


def _legacy_layout() -> str:
    """vLLM before the KVCacheLayout enum: the NHD/HND switch."""
    try:
        from vllm.v1.attention.backends.utils import get_kv_cache_layout
    except ImportError:
        return "default"
    return str(get_kv_cache_layout())


def rank_namespace(base_fields: dict, tp_rank: int, pp_rank: int = 0) -> int:
    return namespace_of({**base_fields, "tp_rank": tp_rank, "pp_rank": pp_rank})
