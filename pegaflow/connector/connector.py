"""``PegaKVConnector``: vLLM's v1 KV connector API routed to one side or the other.

vLLM builds one instance in the scheduler process (role SCHEDULER) and one per worker
(role WORKER).  This facade holds no step state: only the connector's settings (``pega_config``), whether
its cache is off, each KV cache group's layer names, and the side made for its role; each
method of vLLM's API forwards to that ``SchedulerSide`` or ``WorkerSide``, which owns every
request's and every step's state.

    --kv-transfer-config '{"kv_connector":"PegaKVConnector",
                           "kv_connector_module_path":"pegaflow.connector","kv_role":"kv_both"}'
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1 import base as vllm_base
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole

from pegaflow.connector import mamba_state
from pegaflow.connector.config import ConnectorConfig
from pegaflow.connector.drafter import drafter_layers
from pegaflow.connector.layout import TensorInfo
from pegaflow.connector.link import Voters
from pegaflow.connector.memory import CudaMemory, HostMemory
from pegaflow.connector.metadata import PegaConnectorMetadata
from pegaflow.connector.model_support import kv_cache_groups, platform_refusal
from pegaflow.connector.namespace import is_mla, kv_fields, rank_namespace
from pegaflow.connector.scheduler import SchedulerSide
from pegaflow.connector.stats import PegaKVConnectorStats, PegaPromMetrics
from pegaflow.connector.worker import WorkerSide
from pegaflow.platform.errors import ConfigError, LayoutError

logger = logging.getLogger(__name__)


def _rank(group: str, size: int) -> int:
    """This worker's rank in vLLM's ``group`` ("tp" or "pp") of ``size`` ranks.  Without
    distributed state only a group of one may assume rank 0: two ranks sharing a namespace
    would be served each other's KV."""
    try:
        from vllm.distributed import parallel_state
        if group == "tp":
            return parallel_state.get_tensor_model_parallel_rank()
        return parallel_state.get_pp_group().rank_in_group
    except (AssertionError, ImportError) as exc:
        if size == 1:
            return 0
        raise ConfigError(f"pegaflow: cannot read this worker's {group} rank "
                          f"({size} ranks): {exc!r}") from exc


def _flat(tensors) -> list:
    """vLLM's KV tensors, a Mamba layer's list of state views unpacked."""
    return [t for x in tensors for t in (x if isinstance(x, (list, tuple)) else (x,))]


def _tensor_info(name: str, tensor) -> TensorInfo:
    return TensorInfo(name, tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()),
                      tensor.element_size())


def runs_layer_hooks(forward_context) -> bool:
    """Whether vLLM calls ``wait_for_layer_load`` / ``save_kv_layer`` in this step's
    forward.  Not when it replays a full CUDA graph: the V1 model runner says so in the
    forward context; the V2 one starts loads without attention metadata before the
    replay (vLLM's hooks skip themselves without it, too).  None: a caller that drives
    the hooks itself (tests)."""
    if forward_context is None:
        return True
    if getattr(forward_context, "attn_metadata", None) is None:
        return False
    mode = getattr(forward_context, "cudagraph_runtime_mode", None)
    return getattr(mode, "name", None) != "FULL"


def instance_key(vllm_config) -> int:
    """This vLLM instance as the engine knows it (its scheduler and every worker derive the
    same key from vLLM's ``instance_id``): the leases its lookups take serve only its own
    loads.  0 (no instance id): leases anyone may use."""
    instance_id = str(getattr(vllm_config, "instance_id", "") or "")
    if not instance_id:
        return 0
    digest = hashlib.blake2b(instance_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1 or 1


# vLLM's hybrid KV cache manager needs a connector that handles several KV cache groups, and
# vLLM turns the manager off for one that does not claim to, whatever the model: a hybrid SSM
# model (Jamba, Qwen3-Next) then fails to start.  pegaflow claims it on every vLLM, so no
# model fails to start for its sake.  It serves several groups where vLLM can take a failed
# load of such a model as a failed request (KVConnectorTransferResults.failed_recving); older
# vLLMs (up to 0.29) can take only failed block ids, which they cannot map back to several groups,
# so there its cache is off for a model vLLM gives several groups (kv_cache_groups), and a
# sliding-window model is served once vLLM runs without the manager (one group).
HAS_FAILED_RECVING = hasattr(vllm_base, "KVConnectorTransferResults")
_BASES = (KVConnectorBase_V1, vllm_base.SupportsHMA)
class PegaKVConnector(*_BASES):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        self.pega_config = self._servable_config(vllm_config, kv_cache_config)
        # Off (a model it cannot serve, or loads and saves both disabled): its KV memory is not
        # even registered, and neither side takes a slot of the engine.
        self._is_off = self.pega_config.is_off
        base = kv_fields(vllm_config, kv_cache_config)
        logger.debug("pegaflow namespace fields: %s", base)
        parallel = vllm_config.parallel_config
        tp_size, pp_size = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        # MLA's TP ranks hold the same latent: one namespace and one stored copy, voted on
        shares_tp = tp_size > 1 and is_mla(vllm_config, kv_cache_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            if getattr(transfer, "kv_load_failure_policy", "recompute") != "recompute":
                logger.info("pegaflow: a cache miss must never fail a request; "
                            "setting kv_load_failure_policy to 'recompute'")
                transfer.kv_load_failure_policy = "recompute"
            # One lookup (and lease) per worker: rank index = pp_rank * tp_size + tp_rank
            # (MLA's TP ranks look up the same namespace, each with a lease of its own).
            namespaces = [rank_namespace(base, tp, pp, shares_tp) for pp in range(pp_size) for tp in range(tp_size)]
            self._scheduler = SchedulerSide(self.pega_config, namespaces, vllm_config.cache_config.block_size,
                                            instance=instance_key(vllm_config),  # a worker per namespace
                                            num_groups=max(len(self._groups), 1),
                                            state_groups=self._state_groups)
        else:
            tp_rank, pp_rank = _rank("tp", tp_size), _rank("pp", pp_size)
            namespaces = [rank_namespace(base, tp_rank, pp_rank, shares_tp)]
            self._worker = WorkerSide(self.pega_config, namespaces[0],
                                      pp_rank * tp_size + tp_rank, kv_cache_config.num_blocks,
                                      num_ranks=tp_size * pp_size, pipeline_stages=pp_size,
                                      instance=instance_key(vllm_config),
                                      voters=Voters(tp_size, tp_rank) if shares_tp else None)
        # (the scheduler's and the workers' namespaces must agree: a block saved under one is
        # found only by lookups under the same)
        self._log_start(role, namespaces)

    def _servable_config(self, vllm_config, kv_cache_config) -> ConnectorConfig:
        """The settings from vLLM's config, with loads and saves off for a model pegaflow
        cannot serve; sets ``_groups``, each KV cache group's layer names, and ``_state_groups``, its Mamba groups."""
        transfer = vllm_config.kv_transfer_config
        config = ConnectorConfig.from_sources(transfer.kv_connector_extra_config,
                                              kv_role=transfer.kv_role or "kv_both")
        hash_unit = getattr(vllm_config.cache_config, "prefix_match_unit", None)
        self._groups, unservable = kv_cache_groups(kv_cache_config, vllm_config.cache_config.block_size,
                                                   HAS_FAILED_RECVING, hash_unit)
        self._state_groups = mamba_state.state_groups(kv_cache_config)
        if self._state_groups:  # a hybrid SSM model: its attention blocks and Mamba states
            unservable = mamba_state.refusal(vllm_config, kv_cache_config, HAS_FAILED_RECVING, hash_unit)
        unservable = unservable or platform_refusal(vllm_config, kv_cache_config)
        if unservable is None:
            return config
        logger.error("pegaflow: the cache is off for this model (vLLM computes every prompt): %s", unservable)
        return dataclasses.replace(config, enable_load=False, enable_save=False)

    def _log_start(self, role: KVConnectorRole, namespaces: list[int]) -> None:
        config = self.pega_config
        logger.info("pegaflow connector (%s, %s) for engine %r, loads %s, saves %s, namespace %s",
                    role.name.lower(), config.kv_role, config.engine_name,
                    config.load_mode if config.enable_load else "off",
                    "on" if config.enable_save else "off", " ".join(f"{n:016x}" for n in namespaces))

    # -- properties vLLM asks about -------------------------------------------------------

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # Full CUDA graphs (vLLM's decode batches) run no per-layer hook: the worker then
        # fences loads before the forward and saves after it (runs_layer_hooks).
        return False

    # -- scheduler side -------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids):
        return self._scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request, block_ids):
        """vLLM's hybrid KV cache manager: ``block_ids`` holds one table per KV cache group."""
        return self._scheduler.request_finished(request, block_ids)

    def update_connector_output(self, connector_output) -> None:
        self._scheduler.update_connector_output(connector_output)

    def reset_cache(self) -> bool | None:
        """vLLM's ``reset_prefix_cache`` with ``reset_external``: the engine's blocks of this
        model emptied (True), or not (False: unreachable, refused, no answer in time).  A
        worker's connector, or a connector whose cache is off, has nothing to reset (None)."""
        if self._scheduler is None or self._is_off:
            return None
        return self._scheduler.reset_cache()

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_work()

    # -- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict) -> None:
        if self._is_off:
            return  # a model pegaflow cannot serve: its layouts need not even parse
        drafter = drafter_layers(self._vllm_config, kv_caches)
        if drafter:
            logger.info("pegaflow: %d of %d KV layers are the speculative drafter's: not stored "
                        "(the target's are; outputs stay exact)", len(drafter), len(kv_caches))
            kv_caches = {name: t for name, t in kv_caches.items() if name not in drafter}
        groups = None
        if len(self._groups) > 1:  # a hybrid model: each layer's KV cache group
            groups = {name: g for g, names in enumerate(self._groups) for name in names if name in kv_caches}
        tensors = {name: mamba_state.page_view(name, t) if groups and groups.get(name) in self._state_groups
                   else _tensor_info(name, t) for name, t in kv_caches.items()}
        devices = {t.device.type for t in _flat(kv_caches.values())}
        if devices == {"cuda"}:
            memory = CudaMemory(_flat(kv_caches.values())[0].device.index or 0)
        elif devices == {"cpu"}:
            memory = HostMemory(self.pega_config.engine_name)
            memory.share(_flat(kv_caches.values()))  # vLLM's CPU build: private memory made shareable
        else:
            raise LayoutError(f"pegaflow: KV caches on {sorted(devices)}; expected all cuda or all cpu")
        self._worker.register_kv_caches(tensors, memory, groups)
        if self._state_groups:
            mamba_state.drop_hookless(self._worker.layers, groups, self._state_groups)

    def handle_preemptions(self, kv_connector_metadata) -> None:
        if isinstance(kv_connector_metadata, PegaConnectorMetadata):
            self._worker.handle_preemptions(kv_connector_metadata)

    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._worker.bind(connector_metadata)

    def has_connector_metadata(self) -> bool:
        """vLLM calls a layer's two hooks only where this is True: a step with no layer-wise
        load and no save (most decode steps) skips them for every layer."""
        return super().has_connector_metadata() and self._worker is not None and self._worker.needs_layer_hooks

    def start_load_kv(self, forward_context, **kwargs) -> None:
        self._worker.start_load_kv(runs_layer_hooks(forward_context))

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        self._worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]):
        return self._worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    def get_transfer_results(self, finished_req_ids: set[str]):
        """vLLM's get_finished, with a hybrid model's failed loads as failed requests."""
        results = super().get_transfer_results(finished_req_ids)
        results.failed_recving |= self._worker.take_failed_recving()
        return results

    def build_connector_worker_meta(self):
        """What the scheduler side frees held requests by; nothing to say with saving off
        (no request is ever held for its saves)."""
        if self._worker is None or not self.pega_config.enable_save:
            return None
        return self._worker.saves_done()

    # -- stats into vLLM's metrics --------------------------------------------------------

    def get_kv_connector_stats(self):
        if self._is_off:
            return None  # nothing looked up, loaded or saved; nor an engine to be up or down
        side = self._worker if self._worker is not None else self._scheduler
        return side.take_stats() if side is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict | None = None):
        return PegaKVConnectorStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return PegaPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()
