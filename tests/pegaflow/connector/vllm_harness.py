"""Drive vLLM's real Scheduler with PegaKVConnector on both sides, without a GPU.

One ``VllmInstance`` is one vLLM: a real ``Scheduler`` (whose connector is built by
vLLM's own factory from ``kv_connector_module_path``) and a worker-side connector whose
"GPU" KV caches are CPU tensors in a ``HostKVBuffer``, laid out as vLLM's
FlashAttention does (per layer ``[num_blocks, kv_heads, block_size, 2 * head]`` views
of one buffer, LBNHC), or as MLA's latent cache (``[num_blocks, block_size, head]``).
``step()`` plays the model runner: it binds the metadata, loads, "computes" every layer
(writing bytes that are a function of the block hash, as real KV is a function of the
prefix), saves, and feeds a ``ModelRunnerOutput`` back.  With ``tp_size`` > 1 it plays
every TP rank (a worker-side connector and a buffer each; a rank's bytes are its own,
except MLA's, which every rank computes alike) and merges their outputs as vLLM does.
With ``groups`` it is a hybrid model under vLLM's hybrid KV cache manager: KV cache
groups of full attention and sliding window, each with its own block tables, the i-th
layer of every group in the i-th tensor (groups overlay each other, as vLLM lays them out).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import numpy as np
import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from pegaflow.client.host_memory import HostKVBuffer
from pegaflow.connector import PegaKVConnector, kv_transfer_config
from pegaflow.connector.connector import HAS_FAILED_RECVING

TINY_MODEL = Path(__file__).resolve().parents[2] / "data" / "tiny-llama"
BLOCK = 16
NUM_LAYERS, KV_HEADS, HEAD = 3, 2, 64
PAGE_ELEMS = KV_HEADS * BLOCK * 2 * HEAD
MLA_HEAD = PAGE_ELEMS // BLOCK  # an MLA page of the same size: one head of latent and rope
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
OUTPUT_TOKEN = 7
WINDOW = 2 * BLOCK  # a sliding window's tokens (hybrid instances)
# Hybrid layouts: each KV cache group's kind and layers (indices into LAYER_NAMES).
TWO_GROUPS = (("full", (0, 2)), ("sliding", (1,)))
THREE_GROUPS = (("full", (0,)), ("sliding", (1,)), ("sliding", (2,)))  # as Gemma-3's 1:N

init_none_hash(sha256)
_HASHER = get_request_block_hasher(BLOCK, sha256)


def group_of(name: str, spec_type: str, block_size: int = BLOCK) -> SimpleNamespace:
    """A KV cache group of one layer, its spec a stand-in of vLLM's class of that name."""
    return SimpleNamespace(layer_names=[name], kv_cache_spec=type(spec_type, (), {"block_size": block_size})())


def block_pattern(block_hash: bytes, layer: int, rank: int = 0) -> np.ndarray:
    """The bytes a layer holds for a full block: a function of its hash (and of the TP
    rank whose heads they are, from rank 1 on)."""
    seed = hashlib.sha256(block_hash + bytes([layer]) + (bytes([rank]) if rank else b"")).digest()
    return np.resize(np.frombuffer(seed, dtype=np.uint8), PAGE_ELEMS * 2)


def make_request(req_id: str, prompt: list[int], max_tokens: int = 2) -> Request:
    params = SamplingParams(max_tokens=max_tokens)
    params.update_from_generation_config({}, 2)
    return Request(request_id=req_id, prompt_token_ids=prompt, sampling_params=params,
                   pooling_params=None, block_hasher=_HASHER)


@dataclass
class StepRecord:
    """One step: ``loads`` are the loads it planned; ``landed`` the loads whose copies are
    over by its end, where their bytes can be checked: its own fenced loads (the forward
    waited for them) and the async loads (of this step or earlier ones) its workers reported
    received.  An async load is in no one's blocks yet in the step that plans it: vLLM
    reads them only once told (``finished_recving``).  A failed load's blocks are in
    ``load_errors`` (or its request in ``failed_recving``)."""
    output: object
    loads: list = field(default_factory=list)
    saves: list = field(default_factory=list)
    load_errors: set = field(default_factory=set)
    landed: list = field(default_factory=list)
    finished_recving: set = field(default_factory=set)
    failed_recving: set = field(default_factory=set)


class VllmInstance:
    def __init__(self, engine_name: str, num_blocks: int = 64, extra: dict | None = None,
                 model: Path = TINY_MODEL, max_batched_tokens: int = 256, dtype: str = "bfloat16",
                 tp_size: int = 1, mla: bool = False, groups=None):
        self.num_blocks, self.tp_size, self.mla = num_blocks, tp_size, mla
        self.config = self._vllm_config(engine_name, extra or {}, model, max_batched_tokens, dtype, tp_size)
        if groups is None:
            spec = (MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=MLA_HEAD, dtype=torch.bfloat16)
                    if mla else FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD,
                                                  dtype=torch.bfloat16))
            groups_specs = [KVCacheGroupSpec(LAYER_NAMES, spec)]
            self.group_of, self.tensor_of = [0] * NUM_LAYERS, list(range(NUM_LAYERS))
        else:
            groups_specs, self.group_of, self.tensor_of = [], [0] * NUM_LAYERS, [0] * NUM_LAYERS
            for g, (kind, layers) in enumerate(groups):
                common = dict(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch.bfloat16)
                spec = (FullAttentionSpec(**common) if kind == "full"
                        else SlidingWindowSpec(**common, sliding_window=WINDOW))
                groups_specs.append(KVCacheGroupSpec([LAYER_NAMES[i] for i in layers], spec))
                for position, layer in enumerate(layers):
                    self.group_of[layer], self.tensor_of[layer] = g, position
            self.config.scheduler_config.disable_hybrid_kv_cache_manager = False
        self.kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                             kv_cache_groups=groups_specs)
        self.config.cache_config.num_gpu_blocks = num_blocks
        self.scheduler = Scheduler(vllm_config=self.config, kv_cache_config=self.kv_cache_config,
                                   structured_output_manager=StructuredOutputManager(self.config),
                                   block_size=BLOCK, log_stats=True)
        self.workers, self.buffers, self.rank_kv_caches = [], [], []
        for rank in range(tp_size):
            with mock.patch("vllm.distributed.parallel_state.get_tensor_model_parallel_rank", return_value=rank):
                self.workers.append(PegaKVConnector(self.config, KVConnectorRole.WORKER, self.kv_cache_config))
            self.buffers.append(HostKVBuffer(NUM_LAYERS * num_blocks * PAGE_ELEMS * 2, f"test-kv{rank}"))
            self.rank_kv_caches.append(self._kv_views(self.buffers[-1]))
            self.workers[-1].register_kv_caches(self.rank_kv_caches[-1])
        self.worker, self.buffer, self.kv_caches = self.workers[0], self.buffers[0], self.rank_kv_caches[0]
        self._aggregator = KVOutputAggregator(tp_size)  # as vLLM merges its workers' outputs
        self.requests: dict[str, Request] = {}
        self.external_hit_tokens = 0
        self.served_tokens = 0  # tokens of loads that did not fail (vLLM counts failed ones too)
        self.async_loads: dict[str, object] = {}  # req id -> its async load, until reported over
        self.scheduler_stats: list = []  # vLLM's SchedulerStats of each step, as a frontend gets them

    @staticmethod
    def _vllm_config(engine_name, extra, model, max_batched_tokens, dtype, tp_size) -> VllmConfig:
        model_config = ModelConfig(model=str(model), skip_tokenizer_init=True, dtype=dtype,
                                   seed=0, max_model_len=2048)
        cache = CacheConfig(block_size=BLOCK, gpu_memory_utilization=0.9, cache_dtype="auto",
                            enable_prefix_caching=True)
        if "kv_cache_layout" in CacheConfig.__dataclass_fields__:
            cache.kv_cache_layout = "LBNHC"
        transfer = kv_transfer_config(engine_name, **{"lookup_timeout_ms": 20000, **extra})
        return VllmConfig(model_config=model_config, cache_config=cache, kv_transfer_config=transfer,
                          parallel_config=ParallelConfig(tensor_parallel_size=tp_size),
                          scheduler_config=SchedulerConfig(
                              max_num_seqs=16, max_num_batched_tokens=max_batched_tokens,
                              max_model_len=2048, enable_chunked_prefill=True,
                              is_encoder_decoder=False),
                          device_config=DeviceConfig("cpu"))

    def _kv_views(self, buffer: HostKVBuffer) -> dict[str, torch.Tensor]:
        flat = torch.frombuffer(buffer.data, dtype=torch.bfloat16)
        layer_elems = self.num_blocks * PAGE_ELEMS
        if self.mla:
            shape, strides = (self.num_blocks, BLOCK, MLA_HEAD), (PAGE_ELEMS, MLA_HEAD, 1)
        else:
            shape = (self.num_blocks, KV_HEADS, BLOCK, 2 * HEAD)
            strides = (PAGE_ELEMS, 2 * HEAD, KV_HEADS * 2 * HEAD, 1)  # LBNHC: tokens outside heads
        return {name: flat.as_strided(shape, strides, storage_offset=self.tensor_of[i] * layer_elems)
                for i, name in enumerate(LAYER_NAMES)}

    # -- the "GPU" ------------------------------------------------------------------------

    def page(self, layer: int, block_id: int, rank: int = 0) -> np.ndarray:
        start = (self.tensor_of[layer] * self.num_blocks + block_id) * PAGE_ELEMS * 2
        return self.buffers[rank].data[start:start + PAGE_ELEMS * 2]

    def pattern(self, block_hash: bytes, layer: int, rank: int = 0) -> np.ndarray:
        """What ``rank`` holds for a full block (MLA: what every rank holds)."""
        return block_pattern(block_hash, layer, 0 if self.mla else rank)

    def poison(self, value: int = 0xEE) -> None:
        for buffer in self.buffers:
            buffer.data[:] = value

    def _compute(self, layer: int, scheduler_output, rank: int = 0) -> None:
        """Write this step's KV: full blocks get their hash's pattern, partial ones noise."""
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.requests[req_id]
            start = request.num_computed_tokens - num_tokens  # already advanced by schedule()
            block_ids = self.scheduler.kv_cache_manager.get_block_ids(req_id)[self.group_of[layer]]
            for j in range(start // BLOCK, -(-(start + num_tokens) // BLOCK)):
                if block_ids[j] == 0:  # the null block: a position the sliding window let go
                    continue
                full = (j + 1) * BLOCK <= start + num_tokens and j < len(request.block_hashes)
                self.page(layer, block_ids[j], rank)[:] = (self.pattern(request.block_hashes[j], layer, rank)
                                                           if full else 0x11)

    # -- one step of the model runner -----------------------------------------------------

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.scheduler.add_request(request)

    def step(self, before_forward=None) -> StepRecord:
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        record = StepRecord(out, list(meta.loads), list(meta.saves))
        req_ids = list(out.num_scheduled_tokens)
        rank_outputs = []
        for rank, worker in enumerate(self.workers):  # one rank after another: a valid interleaving
            kv_caches = self.rank_kv_caches[rank]
            worker.handle_preemptions(meta)
            worker.bind_connector_metadata(meta)
            worker.start_load_kv(None)
            if before_forward is not None and rank == 0:
                before_forward(meta)
            if out.num_scheduled_tokens:
                for layer, name in enumerate(LAYER_NAMES):
                    worker.wait_for_layer_load(name)
                    self._compute(layer, out, rank)
                    worker.save_kv_layer(name, kv_caches[name], None)
            worker.wait_for_save()
            failed = set()
            if HAS_FAILED_RECVING:  # (vLLM 0.30 on) failed loads as failed requests
                results = worker.get_transfer_results(out.finished_req_ids)
                sending, recving, failed = results.finished_sending, results.finished_recving, results.failed_recving
            else:
                sending, recving = worker.get_finished(out.finished_req_ids)
            load_errors = worker.get_block_ids_with_load_errors()
            record.load_errors |= load_errors
            worker.clear_connector_metadata()
            kv_out = KVConnectorOutput(finished_sending=sending, finished_recving=recving,
                                       invalid_block_ids=load_errors, **({"failed_recving": failed} if failed else {}),
                                       kv_connector_stats=worker.get_kv_connector_stats(),
                                       kv_connector_worker_meta=worker.build_connector_worker_meta())
            rank_outputs.append(ModelRunnerOutput(
                req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                sampled_token_ids=[self._sampled(r) for r in req_ids], kv_connector_output=kv_out))
        self.served_tokens += BLOCK * sum(b not in record.load_errors
                                          for load in record.loads for b in load.block_ids)
        merged = rank_outputs[0] if self.tp_size == 1 else self._aggregator.aggregate(rank_outputs)
        self._note_landed(record, meta, merged.kv_connector_output)
        outputs = self.scheduler.update_from_output(out, merged)
        for engine_outputs in outputs.values():
            stats = getattr(engine_outputs.scheduler_stats, "connector_prefix_cache_stats", None)
            self.external_hit_tokens += stats.hits if stats is not None else 0
            if engine_outputs.scheduler_stats is not None:
                self.scheduler_stats.append(engine_outputs.scheduler_stats)
        return record

    def _note_landed(self, record: StepRecord, meta, kv_out) -> None:
        """The loads over by this step's end (every rank's, as vLLM merges them)."""
        self.async_loads.update((load.req_id, load) for load in meta.loads if load.is_async)
        record.finished_recving = set(kv_out.finished_recving or ())
        record.failed_recving = set(getattr(kv_out, "failed_recving", None) or ())
        record.landed = [load for load in meta.loads if not load.is_async]
        record.landed += [self.async_loads.pop(req_id) for req_id in sorted(record.finished_recving)
                          if req_id in self.async_loads]

    def _sampled(self, req_id: str) -> list[int]:
        """A token for a request whose prompt is all computed; none for a prefill chunk."""
        request = self.requests[req_id]
        return [OUTPUT_TOKEN] if request.num_computed_tokens >= request.num_tokens else []

    def step_until_admitted(self, req_id: str, max_steps: int = 200, **kwargs) -> StepRecord:
        """Step until ``req_id`` leaves the waiting queue (a lookup may take a few steps:
        the connector answers "ask again" until the engine's answer is in)."""
        for _ in range(max_steps):
            record = self.step(**kwargs)
            if record.loads or any(r.req_id == req_id for r in record.output.scheduled_new_reqs):
                return record
        raise AssertionError(f"{req_id} not admitted after {max_steps} steps")

    def run_until_done(self, max_steps: int = 200, idle_timeout_s: float = 30.0, after_step=None,
                       **kwargs) -> list[StepRecord]:
        """Step until every request is gone: ``max_steps`` steps that schedule tokens, and
        steps that schedule none (finished requests held until the engine answers their
        saves, which may wait for disk writes) for up to ``idle_timeout_s``; ``after_step``
        is called with each step's record (e.g. to check the loads that landed in it)."""
        records, busy, deadline = [], 0, time.monotonic() + idle_timeout_s
        while busy < max_steps and time.monotonic() < deadline:
            records.append(self.step(**kwargs))
            if after_step is not None:
                after_step(records[-1])
            if not self.scheduler.requests:
                return records
            if records[-1].output.total_num_scheduled_tokens:
                busy += 1
            else:
                time.sleep(1e-3)
        raise AssertionError(f"requests still running after {len(records)} steps ({busy} scheduling "
                             f"tokens): {list(self.scheduler.requests)}")

    def external_hits(self) -> int:
        """Tokens vLLM counted as external prefix-cache hits (vllm:external_prefix_cache_hits)."""
        return self.external_hit_tokens

    def close(self) -> None:
        for worker in self.workers:
            worker.shutdown()
        self.scheduler.connector.shutdown()
        self.kv_caches = self.rank_kv_caches = None
        for buffer in self.buffers:
            buffer.close()
