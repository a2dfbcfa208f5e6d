"""The worker side: register KV memory, submit loads and saves, fence them with events.

Per step: ``start_load_kv`` submits one LOAD per planned request (all layers; with the
cuda backend each layer's copy records an IPC event), ``wait_for_layer_load`` waits
for the engine to accept the step's loads and then makes vLLM's stream wait, on the
GPU, for that layer's events; ``save_kv_layer`` records an event after the layer's
KV is written and submits a SAVE that the engine's layer stream waits on.  Saves
complete asynchronously: requests vLLM keeps for us are reported finished once their
saves are done, and ``handle_preemptions`` waits for the saves of preempted requests
before their blocks can be reused.  Any engine failure becomes a load error (vLLM
recomputes) or a dropped save, never an exception into vLLM.

A step vLLM replays as a full CUDA graph (decode batches by default) runs no per-layer
hook: ``start_load_kv`` is told so and fences every layer of the step's loads before
the forward, and the step's SAVE waits for one event recorded after the forward.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from pegaflow.client import EngineClient
from pegaflow.connector.config import ConnectorConfig
from pegaflow.connector.kv_layers import SAVE_EVENT, KVLayers
from pegaflow.connector.layout import TensorInfo
from pegaflow.connector.link import EngineLink
from pegaflow.connector.metadata import LoadSpec, PegaConnectorMetadata
from pegaflow.connector.recent_saves import RecentSaves
from pegaflow.connector.save_ledger import SaveLedger
from pegaflow.connector.stats import PegaKVConnectorStats
from pegaflow.connector.taint import Taint
from pegaflow.connector.trace import StepTrace
from pegaflow.errors import PegaflowError
from pegaflow.wire import BLOCK_ID, NO_EVENT, ClientRole, encode_hashes

logger = logging.getLogger(__name__)

LIVENESS_CHECK_S = 0.1  # how often outstanding answers make us check the engine is alive


class WorkerSide:
    def __init__(self, config: ConnectorConfig, namespace: int, rank: int, num_blocks: int,
                 num_ranks: int = 1, pipeline_stages: int = 1, instance: int = 0):
        self.config = config
        self.namespace = namespace
        self.rank = rank
        self.num_blocks = num_blocks
        self.link = EngineLink(config.engine_name, config.reconnect_interval_s,
                               f"pegaflow worker rank {rank}", self._register,
                               identity=(ClientRole.WORKER, rank, namespace, instance),
                               on_lost=self._connection_lost)
        self.memory = None
        self.layers = KVLayers(config.num_load_slots)  # filled by register_kv_caches
        self._meta: PegaConnectorMetadata | None = None
        self._step_loads: list[tuple[int, LoadSpec, int | None]] = []
        self._loads_waited = True
        self._loads_client: EngineClient | None = None  # the connection this step's loads used
        self._async_loads: dict[int, tuple[LoadSpec, float]] = {}  # request id -> (spec, sent at)
        self._finished_recving: set[str] = set()
        self._load_errors: set[int] = set()
        self._saved_layers: set[str] = set()
        self._is_save_sent = True
        self._taint = Taint()  # saves that would store garbage of failed loads
        self._loads_sent_at = 0.0
        self.stats = PegaKVConnectorStats()  # what vLLM's metrics get (get_kv_connector_stats)
        self._next_liveness_check = 0.0
        self.saves = SaveLedger(self.stats)
        # Dropped again if another rank's load fails; a single rank has no other rank.
        self._recent_saves = RecentSaves(pipeline_stages) if num_ranks > 1 else None
        self.trace = StepTrace()

    # -- memory ---------------------------------------------------------------------------

    def register_kv_caches(self, tensors: dict[str, TensorInfo], memory) -> None:
        self.memory = memory
        self.layers = KVLayers.of(tensors, memory, self.num_blocks, self.config.num_load_slots)
        memory.create_events(self.layers.num_events)
        logger.info("pegaflow worker rank %d: %d layers (%d aliases) as %d engine layers of %d-byte "
                    "pages in %d allocation(s)", self.rank, len(self.layers.save_layers),
                    len(tensors) - len(self.layers.save_layers), self.layers.num_virtual,
                    self.layers.page_bytes, len(self.layers.regions))
        self.link.client()

    def _register(self, client: EngineClient) -> None:
        for region_id, (region, layers) in enumerate(self.layers.regions):
            client.register_region(region_id, region, layers)
        if self.memory is not None and self.memory.has_events:
            client.register_events(self.memory.events.handles())

    # -- loads ----------------------------------------------------------------------------

    def bind(self, meta: PegaConnectorMetadata) -> None:
        self._meta = meta
        self._saved_layers = set()
        self._is_save_sent = False
        self._taint.acknowledge(meta.rewound_block_ids)
        if self._recent_saves is not None:
            if meta.rewound_block_ids:
                self._drop_recent_saves()
            self._recent_saves.new_step()
        self.saves.held |= meta.held_req_ids

    def _drop_recent_saves(self) -> None:
        """A load failed on some rank in a recent step (``recent_saves``): the engine forgets
        what this rank's SAVEs of those steps stored, before this step's saves recompute
        the rewound blocks.  A lookup needs every rank's blocks, so such a block was served
        meanwhile only if the failing rank held it already."""
        num_steps = len(self._recent_saves)
        taken = self._recent_saves.take()
        client = self.link.current()  # never a new connection: the engine takes DROPs of the writer only
        if taken is None:
            return
        hashes, since_request = taken
        if client is None:
            logger.warning("pegaflow worker rank %d: a load failed on some rank, but the link "
                           "that stored this rank's last %d saves (%d blocks) is gone: they "
                           "cannot be dropped", self.rank, num_steps, len(hashes))
            return
        logger.warning("pegaflow worker rank %d: a load failed on some rank; dropping the "
                       "blocks this rank stored in the last %d steps (%d sent; computed from "
                       "its pages)", self.rank, num_steps, len(hashes))
        try:  # the engine drops only what these SAVEs stored, not what they deduplicated
            client.drop_nowait(self.namespace, hashes, since_request)
        except PegaflowError as exc:
            self.link.fail(exc)

    def start_load_kv(self, runs_layer_hooks: bool = True) -> None:
        """Submit this step's loads.  ``runs_layer_hooks`` False: vLLM will not call
        ``wait_for_layer_load`` in this forward (a full CUDA graph replay), so vLLM's
        stream waits for every layer of the loads here, before the forward."""
        self._step_loads, self._loads_waited, self._loads_client = [], False, None
        meta = self._meta
        if meta is None or not meta.loads:
            return
        trace = self.trace
        trace.begin(len(meta.loads), sum(len(s.block_ids) for s in meta.loads))
        client = self.link.client()
        if client is not None and self.memory.has_events and not self._record_start_fence():
            for spec in meta.loads:  # unfenced, a load could race kernels still writing its blocks
                self._release_lease(client, spec)  # never sent: nobody else gives it back
            client = None
        self._loads_client, self._loads_sent_at = client, time.monotonic()
        for index, spec in enumerate(meta.loads):
            self.stats.add("load_blocks", len(spec.block_ids))
            if client is None:
                self._fail_load(spec)
                continue
            slot = None
            if self.memory.has_events and not spec.is_async and index < self.config.num_load_slots:
                slot = index
            try:
                request_id = client.submit_load(
                    self.namespace, spec.block_ids, list(spec.hashes), lease_id=self._lease_of(spec),
                    event_index=NO_EVENT if slot is None else self.layers.load_event_base(slot),
                    after_client=self.memory.has_events)
            except PegaflowError as exc:
                self.link.fail(exc)
                client = None
                self._fail_load(spec)
                continue
            if spec.is_async:
                self._async_loads[request_id] = (spec, time.monotonic())
            else:
                self._step_loads.append((request_id, spec, slot))
        if trace.is_on and self.memory.has_events:
            trace.gpu_mark("loads_submitted", self.memory.current_stream())
        trace.mark("loads_submitted")
        if not runs_layer_hooks:
            self._wait_step_loads()
            self._fence_layers(range(self.layers.num_virtual))

    def _record_start_fence(self) -> bool:
        """Blocks vLLM gives to this step's loads may have belonged to requests whose last
        kernels are still queued on its stream (asynchronous scheduling): the loads' copies
        start after them."""
        try:
            self.memory.events.record([self.layers.start_fence_event], self.memory.current_stream())
        except PegaflowError as exc:
            logger.error("pegaflow: cannot fence this step's loads (%s); vLLM recomputes them", exc)
            return False
        return True

    def _lease_of(self, spec: LoadSpec) -> int:
        """This rank's lease of ``spec``'s blocks (0: none)."""
        return spec.lease_ids[self.rank] if self.rank < len(spec.lease_ids) else 0

    def _release_lease(self, client: EngineClient, spec: LoadSpec) -> None:
        """Give back this rank's lease of a load never sent (else it pins its blocks until
        it expires); the scheduler took it on its own link."""
        lease = self._lease_of(spec)
        if not lease:
            return
        try:
            client.release_nowait(lease)
        except PegaflowError as exc:
            self.link.fail(exc)

    def _fail_load(self, spec: LoadSpec) -> None:
        self.stats.add("load_failed_blocks", len(spec.block_ids))
        self._load_errors.update(spec.block_ids)
        self._taint.failed_load(spec.req_id, spec.block_ids)
        if spec.is_async:
            self._finished_recving.add(spec.req_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._loads_waited:
            self._wait_step_loads()
        self._fence_layers(self.layers.virtual.get(layer_name, ()))

    def _fence_layers(self, layers) -> None:
        """vLLM's stream waits, on the GPU, until these engine layers of the step's fenced
        loads have landed."""
        if not self._step_loads or not self.memory.has_events:
            return
        events = [self.layers.load_event_base(slot) + v for _, _, slot in self._step_loads
                  if slot is not None for v in layers]
        if not events:
            return
        try:
            stream = self.memory.current_stream()
            self.memory.events.wait(events, stream)
            self.trace.layer_ready(stream)
        except PegaflowError as exc:  # unfenced data must not be used: vLLM recomputes it
            logger.error("pegaflow: cannot fence this step's loads (%s); reporting them failed", exc)
            for _, spec, _ in self._step_loads:
                self._fail_load(spec)
            self._step_loads = []

    def _wait_step_loads(self) -> None:
        """The engine accepted (cuda) or finished (host) each of this step's loads."""
        self._loads_waited = True
        if not self._step_loads:
            return  # nothing to wait for: no reconnect attempt inside vLLM's forward
        # Only the connection the loads went out on can answer them (never a newer one).
        client, ok = self._loads_client, []
        if client is not None and (self.link.current() is not client or not client.is_engine_up()):
            client = None
        deadline = time.monotonic() + self.config.command_timeout_ms / 1e3
        for request_id, spec, slot in self._step_loads:
            if client is None:
                self._fail_load(spec)
                continue
            try:
                done = client.wait(request_id, max(deadline - time.monotonic(), 1e-3))
            except PegaflowError as exc:
                self.link.fail(exc)
                client = None
                self._fail_load(spec)
                continue
            self.stats.observe("load_s", time.monotonic() - self._loads_sent_at)
            if done.is_ok:
                ok.append((request_id, spec, slot))
            else:
                logger.warning("pegaflow: load of %d blocks for %s failed (%s); vLLM recomputes them",
                               len(spec.block_ids), spec.req_id, getattr(done.status, "name", done.status))
                self._fail_load(spec)
        self._step_loads = ok
        self.trace.mark("loads_accepted")

    def _check_fenced_loads(self) -> None:
        """Fenced loads were answered when issued, and vLLM's stream was told their pages
        are there by events the engine records: an engine that went away before the
        copies ended leaves blocks partly written.  Reported failed, vLLM drops this
        step's tokens of those requests and recomputes them.  Best effort: the check runs
        when the CPU ends the step, which may be before the GPU has run the copies."""
        client = self._loads_client  # the connection the loads went out on, not a newer one
        reason = None
        if client is None or self.link.current() is not client:
            reason = "the connection this step's loads went out on was dropped"
        else:
            try:
                client.check_engine()
            except PegaflowError as exc:
                self.link.fail(exc)
                reason = str(exc)
        if reason is not None:
            logger.error("pegaflow: the engine went away while this step's loads were copied "
                         "(%s); vLLM recomputes them", reason)
            for _, spec, _ in self._step_loads:
                self._fail_load(spec)
        self._step_loads = []

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- saves ----------------------------------------------------------------------------

    def save_kv_layer(self, layer_name: str) -> None:
        """Mark the layer's KV written (cuda: an event on vLLM's stream, one per engine layer);
        the step's one SAVE goes out from ``wait_for_save``."""
        meta = self._meta
        if meta is None or not meta.saves or layer_name not in self.layers.save_layers:
            return
        if self.memory.has_events:
            try:
                self.memory.events.record(self.layers.virtual[layer_name], self.memory.current_stream())
            except PegaflowError as exc:
                logger.error("pegaflow: cannot fence layer %s for saving (%s); this step's "
                             "saves are dropped", layer_name, exc)
                return
        self._saved_layers.add(layer_name)

    def _submit_step_save(self) -> None:
        """One SAVE of every layer: the engine's layer-L copy waits, on the GPU, for the
        event recorded after layer L was written, so it overlaps the layers still computing."""
        meta = self._meta
        if meta is None or not meta.saves or self._is_save_sent:
            return
        self._is_save_sent = True
        if not self._loads_waited:
            self._wait_step_loads()  # a failed load leaves garbage that must not be saved
        if self._step_loads and self.memory.has_events and (
                self.link.current() is not self._loads_client or not self._loads_client.is_engine_up()):
            self._check_fenced_loads()  # their engine went away: taint them before saving
        # No hook ran: a full CUDA graph replay wrote every layer; one event after it fences all.
        one_event = not self._saved_layers
        if not one_event and self._saved_layers != self.layers.save_layers:
            missing = len(self.layers.save_layers) - len(self._saved_layers)
            logger.warning("pegaflow: %d layers were not written this step; its saves are dropped", missing)
            return
        client = self.link.client()
        if client is None:
            return
        saves = self._taint.clean(meta.saves)
        if not saves or (one_event and not self._record_forward_done()):
            return
        ids = np.fromiter((b for s in saves for b in s.block_ids), dtype=BLOCK_ID)
        records = encode_hashes([h for s in saves for h in s.hashes])
        req_ids = tuple(s.req_id for s in saves)
        event = SAVE_EVENT if self.memory.has_events else NO_EVENT
        try:
            request_id = client.submit_save(self.namespace, ids, records, event_index=event,
                                            one_event=one_event and self.memory.has_events)
        except PegaflowError as exc:
            self.link.fail(exc)
            self._forget_saves()
            return
        logger.debug("pegaflow: SAVE %d of %d blocks for %s sent (%s)", request_id, len(ids),
                     req_ids, "one event after the forward" if one_event else "an event per layer")
        self.saves.sent(request_id, req_ids)
        if self._recent_saves is not None:
            self._recent_saves.sent(request_id, records)

    def _record_forward_done(self) -> bool:
        """Record the first save event where vLLM's stream stands after the forward (it is
        layer 0's in steps whose hooks run): every KV write of the step is before it."""
        if not self.memory.has_events:
            return True
        try:
            self.memory.events.record([SAVE_EVENT], self.memory.current_stream())
        except PegaflowError as exc:
            logger.error("pegaflow: cannot fence this step's saves (%s); they are dropped", exc)
            return False
        return True

    def _collect(self) -> None:
        """Take every completion that has arrived; never blocks."""
        client = self.link.client()
        if client is None:
            self._forget_saves()
            for spec, _ in self._async_loads.values():
                self._fail_load(spec)
            self._async_loads.clear()
            return
        now = time.monotonic()
        expired = now - self.config.command_timeout_ms / 1e3
        try:
            if (self.saves.commands or self._async_loads) and now >= self._next_liveness_check:
                # Answers that can never come must not hold vLLM's blocks: is the engine there?
                self._next_liveness_check = now + LIVENESS_CHECK_S
                client.check_engine()
            for request_id in list(self.saves.commands):
                if (done := client.try_take(request_id)) is not None:
                    self.saves.answered(request_id, done)
            for request_id, (spec, started) in list(self._async_loads.items()):
                done = client.try_take(request_id)
                if done is None and started > expired:
                    continue
                if done is None:
                    # vLLM may reuse the blocks once told: the engine must never write them
                    # now, so revoke (the link does, first) and drop the connection.
                    logger.warning("pegaflow: async load for %s missed its deadline; vLLM "
                                   "recomputes it", spec.req_id)
                    self.link.fail(TimeoutError("async load deadline"))
                    self._collect()  # no client now: every save is forgotten, every async load failed
                    return
                del self._async_loads[request_id]
                self.stats.observe("load_s", now - started)
                if not done.is_ok:
                    self.stats.add("load_failed_blocks", len(spec.block_ids))
                    self._load_errors.update(spec.block_ids)
                self._finished_recving.add(spec.req_id)
        except PegaflowError as exc:
            self.link.fail(exc)
            self._collect()

    def _connection_lost(self) -> None:
        """The link dropped its connection (and revoked our copies): every SAVE and async
        LOAD sent on it will never be answered.  Fenced loads of the step are judged by
        ``_check_fenced_loads``, against the connection they went out on."""
        self._forget_saves()
        for spec, _ in self._async_loads.values():
            self._fail_load(spec)
        self._async_loads.clear()

    def _forget_saves(self) -> None:
        """The link failed (and revoked our saves): nothing stores our blocks any more."""
        self.saves.forget()

    def wait_for_saves_of(self, req_ids: set[str]) -> None:
        """Block (to the command deadline) until no save of ``req_ids`` still reads GPU blocks."""
        deadline = time.monotonic() + self.config.command_timeout_ms / 1e3
        self._collect()
        while self.saves.is_saving(req_ids):
            if time.monotonic() >= deadline:
                logger.error("pegaflow: saves of %s still running after %.1fs; revoking them and "
                             "dropping the connection",
                             sorted(r for r in req_ids if r in self.saves.pending),
                             self.config.command_timeout_ms / 1e3)
                self.link.fail(TimeoutError("save deadline"))  # revokes the saves first
                self._forget_saves()
                return
            time.sleep(50e-6)
            self._collect()

    def handle_preemptions(self, meta: PegaConnectorMetadata) -> None:
        if meta.preempted_req_ids:
            self.wait_for_saves_of(meta.preempted_req_ids)

    def wait_for_save(self) -> None:
        if self.trace.is_on and self.memory.has_events:
            self.trace.gpu_mark("forward_done", self.memory.current_stream())
        self.trace.mark("wait_for_save")
        self._submit_step_save()
        self._collect()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if not self._loads_waited:
            self._wait_step_loads()  # a step that ran no attention layer still reports its loads
        if self._step_loads and self.memory.has_events:
            self._check_fenced_loads()
        self._submit_step_save()  # vLLM versions that skip wait_for_save on some steps
        self._collect()
        sending = self.saves.take_finished()
        recving, self._finished_recving = self._finished_recving, set()
        self.trace.end()
        return sending or None, recving or None

    def take_stats(self) -> PegaKVConnectorStats | None:
        """What happened since vLLM last asked (None: nothing), and whether the engine is
        reachable; the counts start again from zero."""
        is_up = self.link.current() is not None
        if self.stats.is_empty() and is_up:
            return None
        self.stats.engine_seen(is_up)
        return self.stats.clone_and_reset()

    def shutdown(self) -> None:
        self.trace.flush()
        self.wait_for_saves_of(set(self.saves.pending))
        self.link.close()
        if self.memory is not None:
            self.memory.close()
