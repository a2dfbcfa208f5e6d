"""The namespace: a 64-bit fingerprint of everything that makes KV bytes incompatible.

Two vLLM instances share blocks only when model, its weights' files, quantization,
config overrides, load format, dtypes, layer count, KV heads, head size, block size, KV
layout, TP/PP size and rank all agree (MLA: the TP rank aside, every TP rank holding the
same latent).  The scheduler and each worker compute it from the
same config, so a lookup and a load always agree.  Weights replaced in place under the
same local path change it (their files' sizes and times are part of it); a hub model
is identified by name and revision only.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import secrets
import types

from pegaflow.platform.wire import WIRE_VERSION

logger = logging.getLogger(__name__)


def namespace_of(fields: dict) -> int:
    """Fingerprint of a dict of JSON-serialisable fields (order-independent)."""
    text = json.dumps({"wire": WIRE_VERSION, **fields}, sort_keys=True, default=str)
    value = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
    return value or 1


def state_fields(spec) -> dict:
    """A Mamba group's state shapes and dtypes (vLLM may keep the SSM state in float32)."""
    if not hasattr(spec, "shapes"):
        return {}
    return {"state": str((getattr(spec, "shapes", None), getattr(spec, "dtypes", None)))}


def kv_fields(vllm_config, kv_cache_config) -> dict:
    """What every rank's KV bytes depend on, read from vLLM's configs."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    pp_size = parallel.pipeline_parallel_size
    groups = []
    for group in kv_cache_config.kv_cache_groups:
        spec = scheduler_view(group.kv_cache_spec)
        if pp_size == 1:
            groups.append({
                "type": type(spec).__name__, "layers": len(group.layer_names),
                "block_size": spec.block_size, "num_kv_heads": getattr(spec, "num_kv_heads", None),
                "head_size": getattr(spec, "head_size", None), "dtype": str(getattr(spec, "dtype", "")),
                **state_fields(spec),
            })
        else:
            # Under PP a worker's groups hold its stage's layers only, and the scheduler's copy
            # is the first stage's: a group's layer count, and the heads of its first layer
            # (a group of per-layer specs may mix head sizes), differ by stage.  The stages'
            # split is fingerprinted instead (below); the heads follow from the model.
            groups.append({"type": type(spec).__name__, "block_size": spec.block_size})
    load_format = str(getattr(getattr(vllm_config, "load_config", None), "load_format", None))
    return {
        "model": str(model.model), "revision": str(getattr(model, "revision", None)),
        "weights": weights_identity(str(model.model)),
        "quantization": str(getattr(model, "quantization", None)),
        "hf_overrides": _stable_text(getattr(model, "hf_overrides", None)),
        # dummy weights are drawn from the seed
        "load_format": load_format,
        "seed": getattr(model, "seed", None) if load_format == "dummy" else None,
        "dtype": str(model.dtype), "cache_dtype": str(cache.cache_dtype),
        "kv_layout": str(getattr(cache, "kv_cache_layout", None) or _legacy_layout()),
        "hash_algo": str(getattr(cache, "prefix_caching_hash_algo", "")),
        "tp_size": parallel.tensor_parallel_size, "pp_size": pp_size,
        "groups": groups,
        **({"pp_layers": pipeline_split(model, pp_size)} if pp_size > 1 else {}),
    }


def pipeline_split(model_config, pp_size: int) -> list[tuple[int, int]]:
    """Each pipeline stage's decoder layers, [start, end), as vLLM splits them (it honours
    VLLM_PP_LAYER_PARTITION): the same on the scheduler and on every stage's workers, where
    the KV cache groups each side sees are not (a stage's hold its own layers only)."""
    from vllm.distributed.utils import get_pp_indices
    total = model_config.get_total_num_hidden_layers()
    return [tuple(get_pp_indices(total, rank, pp_size)) for rank in range(pp_size)]


def scheduler_view(spec):
    """A KV cache group's spec as vLLM's scheduler sees it.  The workers' group may be a
    ``UniformTypeKVCacheSpecs`` (one spec per layer: a sliding-window model with the hybrid
    manager off has full-attention layers of several windows); the scheduler's copy of the
    config holds its first layer's spec instead.  Both sides fingerprint that one, or a
    worker would save under a namespace the scheduler never looks up."""
    per_layer = getattr(spec, "kv_cache_specs", None)
    if isinstance(per_layer, dict) and per_layer:
        return next(iter(per_layer.values()))
    return spec


_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")


def _stable_text(value) -> str:
    """The same text in every process for the same value: sets sorted (their order follows
    the hash seed), functions by name, no memory address.  A value that has no such text
    gives a text of this process only (a warning says so): instances then share nothing,
    which is slower but never wrong."""
    return json.dumps(_canonical(value), sort_keys=True)


def _qualified(obj) -> str:
    return f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def _canonical(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((_canonical(v) for v in value), key=repr)
    if isinstance(value, functools.partial):
        return {"partial": _canonical(value.func), "args": _canonical(value.args),
                "keywords": _canonical(value.keywords)}
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, type)):
        return _qualified(value)  # by name: its code is the model's to keep
    text = str(value)  # torch.bfloat16, an Enum member, a Path, a numpy number...
    if not _ADDRESS.search(text):
        return f"{_qualified(type(value))}:{text}"
    logger.warning("pegaflow: hf_overrides holds a %s without a stable text (%s); this process "
                   "shares no KV blocks with any other", type(value).__name__, text)
    return f"unshareable:{secrets.token_hex(8)}"


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".json")


def weights_identity(model_path: str) -> str | None:
    """Name, size and modification time of each weight and config file of a local model
    directory, hashed (None for a hub name): weights replaced in place change it."""
    if not os.path.isdir(model_path):
        return None
    parts = []
    for entry in sorted(os.scandir(model_path), key=lambda e: e.name):
        if entry.is_file() and entry.name.endswith(_WEIGHT_SUFFIXES):
            stat = entry.stat()
            parts.append(f"{entry.name}:{stat.st_size}:{stat.st_mtime_ns}")
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=16).hexdigest()


def _legacy_layout() -> str:
    """vLLM before the KVCacheLayout enum: the NHD/HND switch."""
    try:
        from vllm.v1.attention.backends.utils import get_kv_cache_layout
    except ImportError:
        return "default"
    return str(get_kv_cache_layout())


def is_mla(vllm_config, kv_cache_config) -> bool:
    """Whether every KV cache group holds MLA's latent (the same bytes on every TP rank);
    without the groups, whether vLLM says the model uses MLA.  A group of another kind
    (per-rank heads) rules it out: sharing its copy would serve a rank another's bytes."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if groups:
        return all(type(scheduler_view(g.kv_cache_spec)).__name__ == "MLAAttentionSpec" for g in groups)
    return bool(getattr(vllm_config.model_config, "use_mla", False))


def rank_namespace(base_fields: dict, tp_rank: int, pp_rank: int = 0, shares_tp: bool = False) -> int:
    """A rank's namespace.  ``shares_tp`` (MLA): every TP rank of a pipeline stage holds the
    same KV, so they share one namespace, and one stored copy, voting on it (``votes.py``
    in the engine)."""
    if shares_tp:
        return namespace_of({**base_fields, "tp_shared": True, "pp_rank": pp_rank})
    return namespace_of({**base_fields, "tp_rank": tp_rank, "pp_rank": pp_rank})
