"""The worker side: register KV memory, and own every worker step from its plan to its end.

``WorkerSide`` alone owns a step's state and calls into the parts that hold it: its loads
(``step_loads.py``, asynchronous ones in ``async_loads.py``), its SAVEs (``save_commands.py``)
and the ones still out (``save_ledger.py``), the saves a failed load taints (``taint.py``) and
this rank's recent saves (``recent_saves.py``).  One step, in the order vLLM calls it:

    handle_preemptions    wait for saves still reading blocks vLLM hands out again; then
                          bind the plan and send the step's LOADs (``send_loads``)
    bind                  the plan: acknowledge rewound blocks, hold finished requests
                          (once per plan: a no-op where handle_preemptions bound it)
    start_load_kv         the LOADs not sent yet; for a full CUDA graph, vLLM's stream
                          fenced on every layer of them before the forward
    wait_for_layer_load   per layer: vLLM's stream waits, on the GPU, for its copies
    save_kv_layer         per layer: an event once its KV is written
    wait_for_save         the step's one SAVE of every layer; collect answers
    get_finished          judge the step's loads; report saves and loads done

vLLM's V1 model runner calls ``handle_preemptions`` first thing in its step, before it
prepares the step's inputs, attention metadata and CUDA graph (``GPUModelRunner.execute_model``),
and ``bind_connector_metadata`` and ``start_load_kv`` with the same plan object just before the
forward: LOADs sent at ``handle_preemptions`` copy while vLLM prepares.  (Its V2 runner calls
the three one after another, just before the forward.)  A plan whose load
blocks vLLM writes while it prepares (``loads_after_input_prep``), and a vLLM that never
calls ``handle_preemptions``, send them at ``start_load_kv``.

A part whose command breaks the connection returns the error (``Lost``); the owner drops
the connection (``_drop``) and voids what was sent on it (``_void_if_dropped``): never an
exception into vLLM, and no callback from the link.  A failed load is a load error (vLLM
recomputes) or a failed request; a failed save is a dropped save.
"""

from __future__ import annotations

import logging
import time

from pegaflow.client.connection import EngineClient
from pegaflow.connector.config import ConnectorConfig
from pegaflow.connector.kv_layers import KVLayers
from pegaflow.connector.layout import TensorInfo
from pegaflow.connector.link import ClientIdentity, EngineLink, Voters
from pegaflow.connector.metadata import PegaConnectorMetadata, SavesDone
from pegaflow.connector.recent_saves import RecentSaves
from pegaflow.connector.save_commands import LayersWritten, SaveCommands, record_forward_done
from pegaflow.connector.save_ledger import SaveLedger
from pegaflow.connector.stats import PegaKVConnectorStats
from pegaflow.connector.step_loads import StepLoads
from pegaflow.connector.taint import Taint
from pegaflow.connector.trace import StepTrace
from pegaflow.platform.errors import PegaflowError
from pegaflow.platform.wire import ClientRole, attach_role

logger = logging.getLogger(__name__)

LIVENESS_CHECK_S = 0.1  # how often outstanding answers make us check the engine is alive


class WorkerSide:
    def __init__(self, config: ConnectorConfig, namespace: int, rank: int, num_blocks: int,
                 num_ranks: int = 1, pipeline_stages: int = 1, instance: int = 0,
                 voters: Voters | None = None):
        """``voters``: where TP ranks share ``namespace`` as they hold the same KV (MLA): one
        stored copy that every one of them vouches for (wire.py: voting)."""
        self.config = config
        self.namespace = namespace
        self.rank = rank
        self.num_blocks = num_blocks
        identity = ClientIdentity(attach_role(ClientRole.WORKER, config.wire_kv_role), rank, namespace, instance)
        self.link = EngineLink(config.engine_name, config.reconnect_interval_s, f"pegaflow worker rank {rank}",
                               self._register, identity=identity, voters=voters)
        self._num_dropped_seen = 0  # the link's drops whose commands are voided already
        self._meta: PegaConnectorMetadata | None = None
        self._loads_of: PegaConnectorMetadata | None = None  # the plan whose LOADs are out this step
        self.needs_layer_hooks = False  # this step has loads fenced layer by layer or saves
        self._written = LayersWritten()
        self._is_save_sent = True
        self._is_namespace_checked = False
        self._taint = Taint()  # saves that would store garbage of failed loads
        self.stats = PegaKVConnectorStats()  # what vLLM's metrics get (get_kv_connector_stats)
        self._next_liveness_check = 0.0
        self.trace = StepTrace()
        self.loads = StepLoads(config, namespace, rank, self.link, self.stats, self._taint, self.trace)
        self._save_commands = SaveCommands(namespace, is_voter=voters is not None)
        self.saves = SaveLedger(self.stats)
        # Dropped again if another rank's load fails; a single rank has no other rank.
        self._recent_saves = RecentSaves(pipeline_stages) if num_ranks > 1 else None

    # -- memory: the KV memory and layer map, kept on the step's loads --------------------

    memory = property(lambda self: self.loads.memory, lambda self, memory: setattr(self.loads, "memory", memory))
    layers = property(lambda self: self.loads.layers, lambda self, layers: setattr(self.loads, "layers", layers))

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
        self._client()

    def _register(self, client: EngineClient) -> None:
        for region_id, (region, layers) in enumerate(self.layers.regions):
            client.register_region(region_id, region, layers)
        if self.memory is not None and self.memory.has_events:
            client.register_events(self.memory.events.handles())

    # -- the step, in vLLM's order --------------------------------------------------------

    def handle_preemptions(self, meta: PegaConnectorMetadata) -> None:
        """The saves still reading blocks this step hands out again are over first (the
        step's loads may write those blocks); then the step's LOADs go out."""
        self._end_loads_of_another(meta)
        if meta.preempted_req_ids:
            self.wait_for_saves_of(meta.preempted_req_ids)
        if meta.wait_saves_through:
            self.wait_for_saves_through(meta.wait_saves_through)
        if meta.loads and not meta.loads_after_input_prep:
            self.bind(meta)
            self._send_loads("handle_preemptions")

    def bind(self, meta: PegaConnectorMetadata) -> None:
        if meta is self._meta:
            return  # bound at handle_preemptions (vLLM passes both hooks the same object)
        self._end_loads_of_another(meta)
        self._meta = meta
        if not self._is_namespace_checked and meta.namespaces:
            self._check_namespace(meta.namespaces)
        # The per-layer hooks have work only for loads fenced layer by layer and for saves.
        self.needs_layer_hooks = bool(meta.saves) or any(not spec.is_async for spec in meta.loads)
        self._written, self._is_save_sent = LayersWritten(), False
        self._taint.acknowledge(meta.rewound_block_ids)
        if self._recent_saves is not None:
            if meta.rewound_block_ids:  # a load failed on some rank lately
                self._drop(self._recent_saves.drop_stored(self.link.current(), self.namespace, self.rank))
            self._recent_saves.new_step()
        self.saves.held |= meta.held_req_ids
        self.saves.new_step(meta.step)

    def start_load_kv(self, runs_layer_hooks: bool = True) -> None:
        """Send this step's loads, unless ``handle_preemptions`` did.  ``runs_layer_hooks``
        False: vLLM will not call ``wait_for_layer_load`` in this forward (a full CUDA graph
        replay), so vLLM's stream waits for every layer of the loads here, before the forward."""
        if self._loads_of is None or self._loads_of is not self._meta:
            self._send_loads("start_load_kv")
        else:
            self.loads.mark_hook("start_load_kv")  # the timeline: how far ahead the loads went out
        if not runs_layer_hooks:
            self._drop(self.loads.wait())
            self.loads.fence(range(self.layers.num_virtual))

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self.loads.is_waited:
            self._drop(self.loads.wait())
        self.loads.fence(self.layers.virtual.get(layer_name, ()))

    def save_kv_layer(self, layer_name: str) -> None:
        """Mark the layer's KV written (cuda: an event on vLLM's stream, one per engine layer);
        the step's one SAVE goes out from ``wait_for_save``."""
        meta, layers = self._meta, self.loads.layers  # once per layer
        if meta is not None and meta.saves and layer_name in layers.save_layers:
            self._written.add(layer_name, layers, self.loads.memory)

    def wait_for_save(self) -> None:
        if self.trace.is_on and self.memory.has_events:
            self.trace.gpu_mark("forward_done", self.memory.current_stream())
        self.trace.mark("wait_for_save")
        self._submit_step_save()
        self._collect()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._drop(self.loads.end_step())
        self._loads_of = None
        self._submit_step_save()  # vLLM versions that skip wait_for_save on some steps
        self._collect()
        sending = self.saves.take_finished()
        recving = self.loads.take_finished_recving()
        self.trace.end()
        return sending or None, recving or None

    # -- what vLLM asks after the step ------------------------------------------------------

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.loads.take_errors()

    def take_failed_recving(self) -> set[str]:
        """A hybrid model's failed loads, as the requests vLLM must recompute whole."""
        return self.loads.take_failed_recving()

    def saves_done(self) -> SavesDone:
        """For the scheduler (vLLM's worker metadata, after get_finished): the steps whose
        SAVEs are all over, so a finished request saved by them needs no hold."""
        return SavesDone(self.saves.done_through())

    def take_stats(self) -> PegaKVConnectorStats | None:
        return self.stats.take(is_engine_up=self.link.current() is not None)

    # -- parts of the step ----------------------------------------------------------------

    def _send_loads(self, hook: str) -> None:
        """The bound plan's LOADs, once per plan, from ``hook`` (the timeline's start)."""
        self._loads_of = self._meta
        self._drop(self.loads.start(self._meta, self._client, hook))

    def _end_loads_of_another(self, meta: PegaConnectorMetadata) -> None:
        """LOADs sent for a plan whose step never reached ``get_finished`` (vLLM returned
        before its forward) are waited for and judged now, reported with this step's."""
        if self._loads_of is not None and self._loads_of is not meta:
            self._drop(self.loads.end_step())
            self._loads_of = None

    def _check_namespace(self, namespaces: tuple[int, ...]) -> None:
        """Once, said as an ERROR: the scheduler's namespace for this rank is not this
        worker's (the two sides read the config differently), so nothing it saves is found."""
        self._is_namespace_checked = True
        theirs = namespaces[self.rank] if self.rank < len(namespaces) else None
        if theirs != self.namespace:
            logger.error("pegaflow worker rank %d: its namespace %016x is not the scheduler's (%s): "
                         "nothing it saves can be served (vLLM recomputes); the two sides read the "
                         "KV cache config differently", self.rank, self.namespace,
                         "none" if theirs is None else f"{theirs:016x}")

    def _submit_step_save(self) -> None:
        """The step's one SAVE of every layer (one per KV cache group, a hybrid model's), of
        the saves no failed load tainted; once per step."""
        meta, loads = self._meta, self.loads
        if meta is None or not meta.saves or self._is_save_sent:
            return
        self._is_save_sent = True
        if not loads.is_waited:
            self._drop(loads.wait())  # a failed load leaves garbage that must not be saved
        if loads.step and self.memory.has_events and not loads.is_connection_live():
            self._drop(loads.check_fenced())  # their engine went away: taint them before saving
        if self._written.is_partial(self.layers) or (client := self._client()) is None:
            return
        one_event = not self._written.names  # a full CUDA graph replay: one event after it fences all
        saves = self._taint.clean(meta.saves)
        if not saves or (one_event and not record_forward_done(self.memory)):
            return
        sent = self._save_commands.send(client, saves, self.layers, self.memory, meta.step, one_event)
        for save in sent.saves:
            self.saves.sent(save.command_id, save.req_ids)
            if self._recent_saves is not None:
                self._recent_saves.sent(save.command_id, save.records)
        self._drop(sent.lost)

    def _collect(self) -> None:
        """Take every answer that has arrived; never blocks."""
        if not self.saves.commands and not self.loads.asyncs:
            return  # nothing awaits an answer: no liveness check, no ring read (idle decode steps)
        if (client := self._client()) is None:
            self._void_sent()
            return
        now = time.monotonic()
        try:
            if now >= self._next_liveness_check:
                # Answers that can never come must not hold vLLM's blocks: is the engine there?
                self._next_liveness_check = now + LIVENESS_CHECK_S
                client.check_engine()
            for command_id in list(self.saves.commands):
                if (done := client.try_take(command_id)) is not None:
                    self.saves.answered(command_id, done)
            if not self.loads.collect(client, now):
                # vLLM may reuse the blocks once told: the engine must never write them
                # now, so revoke (the link does, first) and drop the connection.
                self._drop(TimeoutError("async load deadline"))
        except PegaflowError as exc:
            self._drop(exc)

    # -- the connection -------------------------------------------------------------------

    def _client(self) -> EngineClient | None:
        """The live connection (None while the engine is down); what was sent on one the
        link dropped meanwhile is voided first, before anything new is sent."""
        client = self.link.client()
        self._void_if_dropped()
        return client

    def _drop(self, lost: Exception | None) -> None:
        """A command broke the connection (None: none did): the link revokes our copies and
        drops it, and what was sent on it is voided."""
        if lost is not None:
            self.link.fail(lost)
            self._void_if_dropped()

    def _void_if_dropped(self) -> None:
        if self.link.num_dropped != self._num_dropped_seen:
            self._num_dropped_seen = self.link.num_dropped
            self._void_sent()

    def _void_sent(self) -> None:
        """No SAVE or async LOAD out will be answered (the link revoked them); fenced loads
        are judged against their own connection (``StepLoads.check_fenced``)."""
        self.saves.forget()
        self.loads.fail_async()

    # -- waits for saves, and the end -----------------------------------------------------

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
        timeout_s = self.config.command_timeout_ms / 1e3
        if not self.saves.wait_while(is_waiting, self._collect, timeout_s):
            logger.error("pegaflow: %s still running after %.1fs; revoking them and dropping the "
                         "connection", what(), timeout_s)
            self._drop(TimeoutError("save deadline"))  # revokes the saves first
            self.saves.forget()  # (no connection to drop: none of them is answered now)

    def shutdown(self) -> None:
        self.trace.flush()
        self.wait_for_saves_of(set(self.saves.pending))
        self.link.close()
        if self.memory is not None:
            self.memory.close()
