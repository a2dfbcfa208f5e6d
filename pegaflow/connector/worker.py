"""The worker side: register KV memory, and per step its loads and its one SAVE.

Per step: the step's loads (``step_loads.py``) go out from ``start_load_kv`` and are fenced
layer by layer on vLLM's stream; ``save_kv_layer`` records an event after each layer's KV
is written, and ``wait_for_save`` sends one SAVE of every layer that the engine's layer
streams wait on.  Saves complete asynchronously (``save_ledger.py``): requests vLLM keeps
for us are reported finished once their saves are done, and ``handle_preemptions`` waits
for the saves of preempted requests before their blocks can be reused.  Any engine failure
becomes a load error (vLLM recomputes) or a dropped save, never an exception into vLLM.

A step vLLM replays as a full CUDA graph (decode batches by default) runs no per-layer
hook: its loads are fenced before the forward and its SAVE waits for one event recorded
after it.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from pegaflow.client.connection import EngineClient
from pegaflow.connector.config import ConnectorConfig
from pegaflow.connector.kv_layers import SAVE_EVENT, KVLayers
from pegaflow.connector.layout import TensorInfo
from pegaflow.connector.link import EngineLink
from pegaflow.connector.metadata import PegaConnectorMetadata, SavesDone, save_tag
from pegaflow.connector.recent_saves import RecentSaves
from pegaflow.connector.save_ledger import SaveLedger
from pegaflow.connector.stats import PegaKVConnectorStats
from pegaflow.connector.step_loads import StepLoads
from pegaflow.connector.taint import Taint
from pegaflow.connector.trace import StepTrace
from pegaflow.platform.errors import PegaflowError
from pegaflow.platform.wire import BLOCK_ID, NO_EVENT, ClientRole, attach_role, encode_hashes

logger = logging.getLogger(__name__)

LIVENESS_CHECK_S = 0.1  # how often outstanding answers make us check the engine is alive


class WorkerSide:
    def __init__(self, config: ConnectorConfig, namespace: int, rank: int, num_blocks: int,
                 num_ranks: int = 1, pipeline_stages: int = 1, instance: int = 0,
                 voters: tuple[int, int] | None = None):
        """``voters``: (TP ranks sharing ``namespace``, this one's index) where they hold the
        same KV (MLA): one stored copy that every one of them vouches for (wire.py: voting)."""
        self.config = config
        self.namespace = namespace
        self.rank = rank
        self.num_blocks = num_blocks
        self.link = EngineLink(config.engine_name, config.reconnect_interval_s,
                               f"pegaflow worker rank {rank}", self._register,
                               identity=(attach_role(ClientRole.WORKER, config.wire_kv_role), rank,
                                         namespace, instance),
                               on_lost=self._connection_lost, voters=voters)
        self.is_voter = voters is not None
        self._meta: PegaConnectorMetadata | None = None
        self.needs_layer_hooks = False  # this step has loads fenced layer by layer or saves
        self._saved_layers: set[str] = set()
        self._is_save_sent = True
        self._is_namespace_checked = False
        self._taint = Taint()  # saves that would store garbage of failed loads
        self.stats = PegaKVConnectorStats()  # what vLLM's metrics get (get_kv_connector_stats)
        self._next_liveness_check = 0.0
        self.trace = StepTrace()
        self.loads = StepLoads(config, namespace, rank, self.link, self.stats, self._taint, self.trace)
        self.saves = SaveLedger(self.stats)
        # Dropped again if another rank's load fails; a single rank has no other rank.
        self._recent_saves = RecentSaves(pipeline_stages) if num_ranks > 1 else None

    # The KV memory and layer map, shared with the step's loads (set at registration).
    @property
    def memory(self):
        return self.loads.memory

    @memory.setter
    def memory(self, memory) -> None:
        self.loads.memory = memory

    @property
    def layers(self) -> KVLayers:
        return self.loads.layers

    @layers.setter
    def layers(self, layers: KVLayers) -> None:
        self.loads.layers = layers

    # -- memory ---------------------------------------------------------------------------

    def register_kv_caches(self, tensors: dict[str, TensorInfo], memory,
                           groups: dict[str, int] | None = None) -> None:
        """``groups``: each layer's KV cache group (a hybrid model's); None: one group."""
        self.memory = memory
        self.layers = KVLayers.of(tensors, memory, self.num_blocks, self.config.num_load_slots, groups)
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
        if not self._is_namespace_checked and meta.namespaces:
            self._check_namespace(meta.namespaces)
        # The per-layer hooks have work only for loads fenced layer by layer and for saves.
        self.needs_layer_hooks = bool(meta.saves) or any(not spec.is_async for spec in meta.loads)
        self._saved_layers = set()
        self._is_save_sent = False
        self._taint.acknowledge(meta.rewound_block_ids)
        if self._recent_saves is not None:
            if meta.rewound_block_ids:  # a load failed on some rank lately
                self._recent_saves.drop_stored(self.link, self.namespace, self.rank)
            self._recent_saves.new_step()
        self.saves.held |= meta.held_req_ids
        self.saves.new_step(meta.step)

    def _check_namespace(self, namespaces: tuple[int, ...]) -> None:
        """Once: the scheduler's namespace for this rank must be this worker's, else every
        block it saves is one no lookup finds (and the engine refuses its loads of the
        scheduler's): a config the two sides read differently, said as an ERROR."""
        self._is_namespace_checked = True
        theirs = namespaces[self.rank] if self.rank < len(namespaces) else None
        if theirs != self.namespace:
            logger.error("pegaflow worker rank %d: its namespace %016x is not the scheduler's (%s): "
                         "nothing it saves can be served (vLLM recomputes); the two sides read the "
                         "KV cache config differently", self.rank, self.namespace,
                         "none" if theirs is None else f"{theirs:016x}")

    def start_load_kv(self, runs_layer_hooks: bool = True) -> None:
        """Submit this step's loads.  ``runs_layer_hooks`` False: vLLM will not call
        ``wait_for_layer_load`` in this forward (a full CUDA graph replay), so vLLM's
        stream waits for every layer of the loads here, before the forward."""
        self.loads.start(self._meta, runs_layer_hooks)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.loads.wait_for_layer(layer_name)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.loads.take_errors()

    def take_failed_recving(self) -> set[str]:
        """A hybrid model's failed loads, as the requests vLLM must recompute whole."""
        return self.loads.take_failed_recving()

    # -- saves ----------------------------------------------------------------------------

    def save_kv_layer(self, layer_name: str) -> None:
        """Mark the layer's KV written (cuda: an event on vLLM's stream, one per engine layer);
        the step's one SAVE goes out from ``wait_for_save``."""
        meta, layers, memory = self._meta, self.loads.layers, self.loads.memory  # once per layer
        if meta is None or not meta.saves or layer_name not in layers.save_layers:
            return
        if memory.has_events:
            try:
                memory.events.record(layers.virtual[layer_name], memory.current_stream())
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
        loads = self.loads
        if not loads.is_waited:
            loads.wait()  # a failed load leaves garbage that must not be saved
        if loads.step and self.memory.has_events and (
                self.link.current() is not loads.client or not loads.client.is_engine_up()):
            loads.check_fenced()  # their engine went away: taint them before saving
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
        req_ids = tuple(s.req_id for s in saves)
        if not any(s.groups for s in saves):
            self._send_save(client, None, [b for s in saves for b in s.block_ids],
                            [h for s in saves for h in s.hashes], req_ids, one_event,
                            self._tags(meta.step, [(s.req_id, len(s.block_ids)) for s in saves]))
            return
        for group in range(self.layers.num_groups):  # a hybrid model: one SAVE per KV cache group
            parts = [(s.req_id, p) for s in saves for p in s.groups if p.group == group]
            if not parts or not self.layers.layers_of(group):  # (the drafter's group: not stored)
                continue
            ids, hashes = [b for _, p in parts for b in p.block_ids], [h for _, p in parts for h in p.hashes]
            tags = self._tags(meta.step, [(r, len(p.block_ids)) for r, p in parts])
            if not self._send_save(client, group, ids, hashes, req_ids, one_event, tags):
                return

    def _tags(self, step: int, runs: list[tuple[str, int]]) -> list[int] | None:
        """A voter's tag per block: ``runs`` of (request id, its number of blocks)."""
        if not self.is_voter:
            return None
        return [tag for req_id, count in runs for tag in [save_tag(step, req_id)] * count]

    def _send_save(self, client, group: int | None, block_ids, hashes, req_ids, one_event: bool,
                   tags: list[int] | None = None) -> bool:
        """One SAVE (of every layer, or of KV cache group ``group``'s); False: the link failed."""
        ids = np.fromiter(block_ids, dtype=BLOCK_ID, count=len(block_ids))
        records = encode_hashes(hashes)
        event = NO_EVENT
        if self.memory.has_events:  # a group's k-th layer waits for event + k (or all for one)
            event = SAVE_EVENT + (0 if one_event or group is None else self.layers.first_layer_of(group))
        try:
            extra = {} if group is None else {"group": group}
            if tags is not None:
                extra["tags"] = tags
            request_id = client.submit_save(self.namespace, ids, records, event_index=event,
                                            one_event=one_event and self.memory.has_events, **extra)
        except PegaflowError as exc:
            self.link.fail(exc)
            self._forget_saves()
            return False
        logger.debug("pegaflow: SAVE %d of %d blocks for %s sent (%s%s)", request_id, len(ids),
                     req_ids, "one event after the forward" if one_event else "an event per layer",
                     "" if group is None else f", KV cache group {group}")
        self.saves.sent(request_id, req_ids)
        if self._recent_saves is not None:
            self._recent_saves.sent(request_id, records)
        return True

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
        if not self.saves.commands and not self.loads.asyncs:
            return  # nothing awaits an answer: no liveness check, no ring read (idle decode steps)
        client = self.link.client()
        if client is None:
            self._forget_saves()
            self.loads.fail_async()
            return
        now = time.monotonic()
        try:
            if now >= self._next_liveness_check:
                # Answers that can never come must not hold vLLM's blocks: is the engine there?
                self._next_liveness_check = now + LIVENESS_CHECK_S
                client.check_engine()
            for request_id in list(self.saves.commands):
                if (done := client.try_take(request_id)) is not None:
                    self.saves.answered(request_id, done)
            if not self.loads.collect(client, now):
                # vLLM may reuse the blocks once told: the engine must never write them
                # now, so revoke (the link does, first) and drop the connection.
                self.link.fail(TimeoutError("async load deadline"))
                self._collect()  # no client now: every save is forgotten, every async load failed
                return
        except PegaflowError as exc:
            self.link.fail(exc)
            self._collect()

    def _connection_lost(self) -> None:
        """The link dropped its connection (and revoked our copies): every SAVE and async
        LOAD sent on it will never be answered.  Fenced loads of the step are judged by
        ``StepLoads.check_fenced``, against the connection they went out on."""
        self._forget_saves()
        self.loads.fail_async()

    def _forget_saves(self) -> None:
        """The link failed (and revoked our saves): nothing stores our blocks any more."""
        self.saves.forget()

    def wait_for_saves_of(self, req_ids: set[str]) -> None:
        """Block (to the command deadline) until no save of ``req_ids`` still reads GPU blocks."""
        self._wait_saves(lambda: self.saves.is_saving(req_ids),
                         lambda: f"saves of {sorted(r for r in req_ids if r in self.saves.pending)}")

    def wait_for_saves_through(self, step: int) -> None:
        """Block (to the command deadline) until every SAVE of the steps up to ``step`` is
        over: this step writes blocks they read (a sliding window let them go)."""
        self._wait_saves(lambda: self.saves.done_through() < step and bool(self.saves.commands),
                         lambda: f"SAVEs of step {step}")

    def _wait_saves(self, is_waiting, what) -> None:
        """Collect answers while ``is_waiting()``; past the command deadline the saves are
        revoked and the connection dropped (vLLM may then reuse their blocks)."""
        deadline = time.monotonic() + self.config.command_timeout_ms / 1e3
        self._collect()
        while is_waiting():
            if time.monotonic() >= deadline:
                logger.error("pegaflow: %s still running after %.1fs; revoking them and dropping the "
                             "connection", what(), self.config.command_timeout_ms / 1e3)
                self.link.fail(TimeoutError("save deadline"))  # revokes the saves first
                self._forget_saves()
                return
            time.sleep(50e-6)
            self._collect()

    def handle_preemptions(self, meta: PegaConnectorMetadata) -> None:
        if meta.preempted_req_ids:
            self.wait_for_saves_of(meta.preempted_req_ids)
        if meta.wait_saves_through:
            self.wait_for_saves_through(meta.wait_saves_through)

    def wait_for_save(self) -> None:
        if self.trace.is_on and self.memory.has_events:
            self.trace.gpu_mark("forward_done", self.memory.current_stream())
        self.trace.mark("wait_for_save")
        self._submit_step_save()
        self._collect()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self.loads.end_step()
        self._submit_step_save()  # vLLM versions that skip wait_for_save on some steps
        self._collect()
        sending = self.saves.take_finished()
        recving = self.loads.take_finished_recving()
        self.trace.end()
        return sending or None, recving or None

    def saves_done(self) -> SavesDone:
        """For the scheduler (vLLM's worker metadata, after get_finished): the steps whose
        SAVEs are all over, so a finished request saved by them needs no hold."""
        return SavesDone(self.saves.done_through())

    def take_stats(self) -> PegaKVConnectorStats | None:
        return self.stats.take(is_engine_up=self.link.current() is not None)

    def shutdown(self) -> None:
        self.trace.flush()
        self.wait_for_saves_of(set(self.saves.pending))
        self.link.close()
        if self.memory is not None:
            self.memory.close()
