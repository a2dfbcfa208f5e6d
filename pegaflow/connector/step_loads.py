"""A worker step's loads, and the asynchronous ones still out.

``start`` submits one LOAD per planned request (all layers; with the cuda backend each
layer's copy records an IPC event, and a start fence makes the engine begin only once
vLLM's stream has passed the point where the loads were issued); ``wait_for_layer`` waits
for the engine to accept the step's loads and then makes vLLM's stream wait, on the GPU,
for that layer's events; ``check_fenced`` judges them against the connection they went out
on when the step ends.  A load that fails or cannot be fenced becomes a load error (vLLM
recomputes its blocks) and taints the saves that would store what it left behind.

A hybrid model's load is one LOAD per KV cache group, all under the lookup's one lease (the
last ends it), and always asynchronous: it is done once every group's LOAD is answered,
and a failed one fails the request (``failed_recving``: vLLM recomputes it whole; it
cannot take failed block ids of several groups).
"""

from __future__ import annotations

import logging
import time

from pegaflow.client.connection import EngineClient
from pegaflow.connector.config import ConnectorConfig
from pegaflow.connector.kv_layers import KVLayers
from pegaflow.connector.link import EngineLink
from pegaflow.connector.metadata import LoadSpec, PegaConnectorMetadata
from pegaflow.connector.stats import PegaKVConnectorStats
from pegaflow.connector.taint import Taint
from pegaflow.connector.trace import StepTrace
from pegaflow.platform.errors import PegaflowError
from pegaflow.platform.wire import NO_EVENT

logger = logging.getLogger(__name__)


class StepLoads:
    def __init__(self, config: ConnectorConfig, namespace: int, rank: int, link: EngineLink,
                 stats: PegaKVConnectorStats, taint: Taint, trace: StepTrace):
        self.config, self.namespace, self.rank = config, namespace, rank
        self.link, self.stats, self.taint, self.trace = link, stats, taint, trace
        self.memory = None
        self.layers = KVLayers(config.num_load_slots)
        self.step: list[tuple[int, LoadSpec, int | None]] = []  # (request id, spec, event slot)
        self.is_waited = True
        self.client: EngineClient | None = None  # the connection this step's loads used
        self.sent_at = 0.0
        self.asyncs: dict[int, tuple[LoadSpec, float]] = {}  # request id -> (spec, sent at)
        self.finished_recving: set[str] = set()
        self.failed_recving: set[str] = set()  # hybrid models' failed loads (whole requests)
        self.errors: set[int] = set()
        self._group_of: dict[int, int] = {}  # request id of a group's LOAD -> its group
        self._parts_left: dict[str, int] = {}  # a hybrid load's vLLM request -> LOADs unanswered
        self._parts_failed: set[str] = set()

    def start(self, meta: PegaConnectorMetadata | None, runs_layer_hooks: bool = True) -> None:
        """Submit this step's loads.  ``runs_layer_hooks`` False: vLLM will not call
        ``wait_for_layer_load`` in this forward (a full CUDA graph replay), so vLLM's
        stream waits for every layer of the loads here, before the forward."""
        self.step, self.is_waited, self.client = [], False, None
        self._group_of = {}
        if meta is None or not meta.loads:
            return
        trace = self.trace
        trace.begin(len(meta.loads), sum(len(s.block_ids) for s in meta.loads))
        client = self.link.client()
        if client is not None and self.memory.has_events and not self._record_start_fence():
            for spec in meta.loads:  # unfenced, a load could race kernels still writing its blocks
                self._release_lease(client, spec)  # never sent: nobody else gives it back
            client = None
        self.client, self.sent_at = client, time.monotonic()
        for index, spec in enumerate(meta.loads):
            self.stats.add("load_blocks", len(spec.block_ids))
            if client is None:
                self.fail(spec)
                continue
            slot = None
            if self.memory.has_events and not spec.is_async and index < self.config.num_load_slots:
                slot = index
            try:
                sent = self._submit(client, spec, slot)
            except PegaflowError as exc:
                self.link.fail(exc)
                client = None
                self.fail(spec)
                continue
            if not sent:  # no group of it has layers here (a bug upstream): vLLM recomputes it
                self._release_lease(client, spec)
                self.fail(spec)
                continue
            if spec.groups:
                self._parts_left[spec.req_id] = len(sent)
            for request_id in sent:
                if spec.is_async:
                    self.asyncs[request_id] = (spec, time.monotonic())
                else:
                    self.step.append((request_id, spec, slot))
        if trace.is_on and self.memory.has_events:
            trace.gpu_mark("loads_submitted", self.memory.current_stream())
        trace.mark("loads_submitted")
        if not runs_layer_hooks:
            self.wait()
            self.fence(range(self.layers.num_virtual))

    def _submit(self, client: EngineClient, spec: LoadSpec, slot: int | None) -> list[int]:
        """The LOAD(s) of ``spec``: one of every layer, or one per KV cache group, the group
        with the most blocks last (it ends the lease: a run of the lease's keys)."""
        base = NO_EVENT if slot is None else self.layers.load_event_base(slot)
        lease = self._lease_of(spec)
        if not spec.groups:
            return [client.submit_load(self.namespace, spec.block_ids, list(spec.hashes), lease_id=lease,
                                       event_index=base, after_client=self.memory.has_events)]
        # (a group without registered layers, the drafter's, is not stored: nothing to load)
        # (a Mamba group's state, under its own key, goes without the lease: first)
        parts = sorted((p for p in spec.groups if self.layers.layers_of(p.group)),
                       key=lambda p: (not p.is_state, len(p.hashes)))
        if not parts:
            return []
        sent = []
        for i, part in enumerate(parts):
            event = base if slot is None else base + self.layers.first_layer_of(part.group)
            request_id = client.submit_load(self.namespace, part.block_ids, list(part.hashes),
                                            lease_id=0 if part.is_state else lease, event_index=event,
                                            after_client=self.memory.has_events, group=part.group,
                                            ends_lease=i == len(parts) - 1)
            self._group_of[request_id] = part.group
            sent.append(request_id)
        return sent

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

    def fail(self, spec: LoadSpec) -> None:
        self.stats.add("load_failed_blocks", len(spec.block_ids))
        if spec.groups:
            self.failed_recving.add(spec.req_id)  # (the scheduler plans these async only)
        else:
            self.errors.update(spec.block_ids)
        self.taint.failed_load(spec.req_id, spec.block_ids)
        if spec.is_async:
            self.finished_recving.add(spec.req_id)

    def wait_for_layer(self, layer_name: str) -> None:
        if not self.is_waited:
            self.wait()
        self.fence(self.layers.virtual.get(layer_name, ()))

    def fence(self, layers) -> None:
        """vLLM's stream waits, on the GPU, until these engine layers of the step's fenced
        loads have landed."""
        if not self.step or not self.memory.has_events:
            return
        base = self.layers.load_event_base
        if not self._group_of:  # (per layer: the usual model's path stays one comprehension)
            events = [base(slot) + v for _, _, slot in self.step if slot is not None for v in layers]
        else:  # a group's LOAD records events for its own layers only
            group_of, layers_of = self._group_of, self.layers.layers_of
            events = [base(slot) + v for request_id, _, slot in self.step if slot is not None
                      for v in layers if request_id not in group_of or v in layers_of(group_of[request_id])]
        if not events:
            return
        try:
            stream = self.memory.current_stream()
            self.memory.events.wait(events, stream)
            self.trace.layer_ready(stream)
        except PegaflowError as exc:  # unfenced data must not be used: vLLM recomputes it
            logger.error("pegaflow: cannot fence this step's loads (%s); reporting them failed", exc)
            self._fail_step()

    def wait(self) -> None:
        """The engine accepted (cuda) or finished (host) each of this step's loads."""
        self.is_waited = True
        if not self.step:
            return  # nothing to wait for: no reconnect attempt inside vLLM's forward
        # Only the connection the loads went out on can answer them (never a newer one).
        client, ok = self.client, []
        if client is not None and (self.link.current() is not client or not client.is_engine_up()):
            client = None
        deadline = time.monotonic() + self.config.command_timeout_ms / 1e3
        failed: dict[str, LoadSpec] = {}  # (a hybrid load fails whole, once)
        for request_id, spec, slot in self.step:
            if client is None:
                failed[spec.req_id] = spec
                continue
            try:
                done = client.wait(request_id, max(deadline - time.monotonic(), 1e-3))
            except PegaflowError as exc:
                self.link.fail(exc)
                client = None
                failed[spec.req_id] = spec
                continue
            self.stats.observe("load_s", time.monotonic() - self.sent_at)
            if done.is_ok:
                ok.append((request_id, spec, slot))
            else:
                logger.warning("pegaflow: load of %d blocks for %s failed (%s); vLLM recomputes them",
                               len(spec.block_ids), spec.req_id, getattr(done.status, "name", done.status))
                failed[spec.req_id] = spec
        for spec in failed.values():
            self.fail(spec)
        self.step = [entry for entry in ok if entry[1].req_id not in failed]
        self.trace.mark("loads_accepted")

    def check_fenced(self) -> None:
        """Fenced loads were answered when issued, and vLLM's stream was told their pages
        are there by events the engine records: an engine that went away before the
        copies ended leaves blocks partly written.  Reported failed, vLLM drops this
        step's tokens of those requests and recomputes them.  Best effort: the check runs
        when the CPU ends the step, which may be before the GPU has run the copies."""
        client = self.client  # the connection the loads went out on, not a newer one
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
            self._fail_step()
        else:
            self._count_loaded()
        self.step = []

    def end_step(self) -> None:
        """The step is over on the CPU: its loads are waited for and judged (fenced ones
        against their connection; host ones finished when answered)."""
        if not self.is_waited:
            self.wait()  # a step that ran no attention layer still reports its loads
        if self.step and self.memory.has_events:
            self.check_fenced()
        elif self.step:
            self._count_loaded()
            self.step = []

    def _count_loaded(self) -> None:
        self.stats.add("loaded_blocks", sum(len(spec.block_ids) for spec in self._step_specs()))

    def take_errors(self) -> set[int]:
        errors, self.errors = self.errors, set()
        return errors

    def _fail_step(self) -> None:
        """Every load of this step failed (each vLLM request's once)."""
        for spec in self._step_specs():
            self.fail(spec)
        self.step = []

    def _step_specs(self):
        """This step's loads, one per vLLM request (a hybrid load sent a LOAD per group)."""
        return {spec.req_id: spec for _, spec, _ in self.step}.values()

    def collect(self, client, now: float) -> bool:
        """Take the async loads' answers that have arrived; False if one missed its deadline
        (the caller drops the connection: vLLM may reuse the blocks once told)."""
        expired = now - self.config.command_timeout_ms / 1e3
        for request_id, (spec, started) in list(self.asyncs.items()):
            done = client.try_take(request_id)
            if done is None and started > expired:
                continue
            if done is None:
                logger.warning("pegaflow: async load for %s missed its deadline; vLLM "
                               "recomputes it", spec.req_id)
                return False
            del self.asyncs[request_id]
            if spec.groups:  # one of a hybrid load's LOADs: the load is done with its last
                if not done.is_ok:
                    self._parts_failed.add(spec.req_id)
                self._parts_left[spec.req_id] -= 1
                if self._parts_left[spec.req_id] > 0:
                    continue
                del self._parts_left[spec.req_id]
                if spec.req_id in self._parts_failed:
                    self._parts_failed.discard(spec.req_id)
                    self.fail(spec)
                    continue
            self.stats.observe("load_s", now - started)
            if done.is_ok:
                self.stats.add("loaded_blocks", len(spec.block_ids))
                self.finished_recving.add(spec.req_id)
            else:
                self.fail(spec)  # a load error, and its blocks' saves held back (the taint)
        return True

    def fail_async(self) -> None:
        """The connection they went out on is gone: every async load failed."""
        for spec in {spec.req_id: spec for spec, _ in self.asyncs.values()}.values():
            self.fail(spec)
        self.asyncs.clear()
        self._parts_left.clear()
        self._parts_failed.clear()

    def take_finished_recving(self) -> set[str]:
        done, self.finished_recving = self.finished_recving, set()
        return done

    def take_failed_recving(self) -> set[str]:
        failed, self.failed_recving = self.failed_recving, set()
        return failed
