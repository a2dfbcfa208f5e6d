"""The namespaces of MLA's TP ranks (``namespace.py``): one shared, voted on by every rank."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pegaflow.connector.namespace import is_mla, rank_namespace

pytestmark = pytest.mark.vllm

FIELDS = {"model": "/m/deepseek", "tp_size": 4, "pp_size": 2, "groups": []}


def _kv_cache_config(*specs):
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=s, layer_names=["l0"])
                                            for s in specs])


def _specs():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    full = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    return mla, full


def test_rank_namespace_mla_tp_ranks_share_one_per_pipeline_stage():
    # 1. MLA: every TP rank of a stage holds the same latent, so they share a namespace...
    stage0 = {rank_namespace(FIELDS, tp, 0, shares_tp=True) for tp in range(4)}
    stage1 = {rank_namespace(FIELDS, tp, 1, shares_tp=True) for tp in range(4)}
    assert len(stage0) == 1 and len(stage1) == 1
    # 2. ...but not with another pipeline stage (other layers), nor with any per-rank one.
    assert stage0 != stage1
    per_rank = {rank_namespace(FIELDS, tp, pp) for tp in range(4) for pp in range(2)}
    assert len(per_rank) == 8 and not (stage0 | stage1) & per_rank


def test_is_mla_every_group_mla_only():
    mla, full = _specs()
    plain = SimpleNamespace(model_config=SimpleNamespace(use_mla=False))
    assert is_mla(plain, _kv_cache_config(mla, mla))
    # A group of per-rank heads beside it: sharing its copy would serve a rank another's bytes.
    assert not is_mla(plain, _kv_cache_config(mla, full))
    assert not is_mla(SimpleNamespace(model_config=SimpleNamespace(use_mla=True)), _kv_cache_config(full))
    # No groups known: vLLM's word.
    assert is_mla(SimpleNamespace(model_config=SimpleNamespace(use_mla=True)), _kv_cache_config())
    assert not is_mla(plain, _kv_cache_config())


def _vllm_config(model: str = "/m/gemma", pp_size: int = 1, num_layers: int = 12):
    return SimpleNamespace(
        model_config=SimpleNamespace(model=model, revision=None, quantization=None, hf_overrides=None,
                                     seed=0, dtype=torch.bfloat16, get_total_num_hidden_layers=lambda: num_layers),
        cache_config=SimpleNamespace(cache_dtype="auto", kv_cache_layout="NHD", prefix_caching_hash_algo="sha256"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=pp_size),
        load_config=SimpleNamespace(load_format="dummy"))


def _stages(per_layer: dict, whole_spec, pp_size: int):
    """Each pipeline stage's KV cache config as vLLM builds it (one group of the model's
    layers, projected onto the stage's own), and the scheduler's (the first stage's)."""
    from vllm.distributed.utils import get_pp_indices
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
    try:
        from vllm.v1.core.kv_cache_planning import _project_kv_cache_groups_to_worker as project
    except ImportError:  # (where vLLM kept it before)
        from vllm.v1.core.kv_cache_utils import _project_kv_cache_groups_to_worker as project
    names = list(per_layer)
    whole = [KVCacheGroupSpec(names, whole_spec)]
    workers = []
    for rank in range(pp_size):
        start, end = get_pp_indices(len(names), rank, pp_size)
        groups = project(whole, {name: per_layer[name] for name in names[start:end]})
        workers.append(KVCacheConfig(num_blocks=100, kv_cache_tensors=[], kv_cache_groups=groups))
    return workers, generate_scheduler_kv_cache_config(workers)


def _assert_each_stage_found_by_the_scheduler(config, workers, scheduler) -> None:
    from pegaflow.connector.namespace import kv_fields
    for rank, worker in enumerate(workers):
        assert rank_namespace(kv_fields(config, worker), 0, rank) == rank_namespace(
            kv_fields(config, scheduler), 0, rank), f"stage {rank}"


def test_rank_namespace_pipeline_stages_of_uneven_layer_counts_same_on_scheduler_and_worker(monkeypatch):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from pegaflow.connector.namespace import kv_fields
    # 1. 26 layers over PP=4: vLLM gives the stages 6, 7, 7 and 6 layers, and each stage's
    #    workers a group of their own layers; the scheduler's config is the first stage's.
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    workers, scheduler = _stages({f"model.layers.{i}.self_attn.attn": spec for i in range(26)}, spec, 4)
    assert [len(w.kv_cache_groups[0].layer_names) for w in workers] == [6, 7, 7, 6]
    # 2. Each stage's namespace is the one the scheduler looks up for that stage.
    config = _vllm_config("/m/llama", pp_size=4, num_layers=26)
    _assert_each_stage_found_by_the_scheduler(config, workers, scheduler)
    # 3. Another split of the same stages (VLLM_PP_LAYER_PARTITION) holds other layers per
    #    stage: another namespace.
    default = kv_fields(config, scheduler)
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "8,6,6,6")
    assert kv_fields(config, scheduler) != default


def test_rank_namespace_pipeline_stages_starting_on_layers_of_other_heads_same_on_scheduler_and_worker(
        monkeypatch):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, UniformTypeKVCacheSpecs
    # 1. One group of per-layer specs mixing head sizes (every sixth layer 512, the others
    #    256, as with the hybrid manager off for a model of such layers), split 5, 6, 6, 7:
    #    stages 1 to 3 begin on a 512 layer, the scheduler's copy (stage 0's) on a 256 one.
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "5,6,6,7")
    per_layer = {f"model.layers.{i}.self_attn.attn": FullAttentionSpec(
        block_size=16, num_kv_heads=2 if i % 6 == 5 else 4, head_size=512 if i % 6 == 5 else 256,
        dtype=torch.bfloat16) for i in range(24)}
    workers, scheduler = _stages(per_layer, UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs=per_layer), 4)
    # 2. Each stage's namespace is still the one the scheduler looks up for it.
    _assert_each_stage_found_by_the_scheduler(_vllm_config("/m/gemma", pp_size=4, num_layers=24), workers, scheduler)


def test_kv_fields_sliding_window_model_without_hybrid_manager_same_on_scheduler_and_worker():
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, UniformTypeKVCacheSpecs

    from pegaflow.connector.namespace import kv_fields
    # 1. A Gemma-3-like model with vLLM's hybrid manager off: its sliding-window layers become
    #    full attention with a window, so the workers' one group is a UniformTypeKVCacheSpecs...
    def layer(window):
        return FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=256, dtype=torch.bfloat16,
                                 sliding_window=window)
    per_layer = {f"model.layers.{i}.attn": layer(512 if i % 6 != 5 else None) for i in range(12)}
    group = KVCacheGroupSpec(list(per_layer), UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs=per_layer))
    worker = KVCacheConfig(num_blocks=100, kv_cache_tensors=[], kv_cache_groups=[group])
    # 2. ...while vLLM hands its scheduler the first layer's spec in its place.
    scheduler = generate_scheduler_kv_cache_config([worker])
    assert type(scheduler.kv_cache_groups[0].kv_cache_spec) is not type(group.kv_cache_spec)
    # 3. Both fingerprint the same fields: a worker's saves are found by the scheduler's lookups.
    config = _vllm_config()
    assert kv_fields(config, worker) == kv_fields(config, scheduler)
    assert kv_fields(config, worker)["groups"][0]["head_size"] == 256
    # 4. Another model still gets another namespace.
    assert kv_fields(_vllm_config("/m/other"), worker) != kv_fields(config, scheduler)
