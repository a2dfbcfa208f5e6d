"""A worker step's loads: submitted, fenced on vLLM's stream, judged.

``start`` submits one LOAD per planned request (all layers; with the cuda backend each
layer's copy records an IPC event, and a start fence makes the engine begin only once
vLLM's stream has passed the point where the loads were issued); ``wait`` waits for the
engine to accept the step's loads and ``fence`` then makes vLLM's stream wait, on the GPU,
for a layer's events; ``check_fenced`` judges them against the connection they went out
on when the step ends.  A load that fails or cannot be fenced becomes a load error (vLLM
recomputes its blocks) and taints the saves that would store what it left behind.  A
command that breaks the connection is returned (``Lost``) for the step's owner to drop it;
nothing here drops a connection.  Asynchronous loads wait in ``async_loads.py``.

A hybrid model's load is one LOAD per KV cache group (``load_commands.py``), always
asynchronous: it is done once every group's LOAD is answered, and a failed one fails the
request (``failed_recving``: vLLM recomputes it whole; it cannot take failed block ids of
several groups).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import NamedTuple

from pegaflow.client.connection import EngineClient
from pegaflow.connector.async_loads import AsyncLoads
from pegaflow.connector.config import ConnectorConfig
from pegaflow.connector.kv_layers import KVLayers
from pegaflow.connector.link import EngineLink
from pegaflow.connector.load_commands import release_lease, submit_loads
from pegaflow.connector.metadata import LoadSpec, PegaConnectorMetadata
from pegaflow.connector.stats import PegaKVConnectorStats
from pegaflow.connector.taint import Taint
from pegaflow.connector.trace import StepTrace
from pegaflow.platform.errors import PegaflowError

logger = logging.getLogger(__name__)

Lost = PegaflowError | None  # the error that broke the connection, for the caller to drop it


class SentLoad(NamedTuple):
    """A LOAD of this step that vLLM's stream is fenced on (or, host memory, waited for)."""

    command_id: int  # the engine's id of the LOAD (vLLM's request is spec.req_id)
    spec: LoadSpec
    event_slot: int | None  # the load slot whose events it records (None: no events)


class StepLoads:
    def __init__(self, config: ConnectorConfig, namespace: int, rank: int, link: EngineLink,
                 stats: PegaKVConnectorStats, taint: Taint, trace: StepTrace):
        self.config, self.namespace, self.rank = config, namespace, rank
        self.link, self.stats, self.taint, self.trace = link, stats, taint, trace
        self.memory = None
        self.layers = KVLayers(config.num_load_slots)
        self.step: list[SentLoad] = []
        self.is_waited = True
        self.client: EngineClient | None = None  # the connection this step's loads used
        self.sent_at = 0.0
        self.pending = AsyncLoads()
        self.finished_recving: set[str] = set()
        self.failed_recving: set[str] = set()  # hybrid models' failed loads (whole requests)
        self.errors: set[int] = set()
        self._group_of: dict[int, int] = {}  # command id of a group's LOAD -> its group

    @property
    def asyncs(self) -> dict:
        """The asynchronous loads out: engine command id -> ``AsyncLoad``."""
        return self.pending.by_command

    def start(self, meta: PegaConnectorMetadata | None, connect: Callable[[], EngineClient | None],
              hook: str = "start_load_kv") -> Lost:
        """Submit this step's loads on the connection ``connect()`` gives (asked only when
        there are loads; None: each fails); ``hook``: vLLM's call they go out from."""
        self.step, self.is_waited, self.client = [], False, None
        self._group_of = {}
        if meta is None or not meta.loads:
            return None
        self.trace.begin(len(meta.loads), sum(len(s.block_ids) for s in meta.loads), hook)
        client, lost = connect(), None
        if client is not None and self.memory.has_events and not self._record_start_fence():
            for spec in meta.loads:  # unfenced, a load could race kernels still writing its blocks
                lost = lost or release_lease(client, spec, self.rank)  # never sent: nobody else gives it back
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
                submitted = submit_loads(client, self.namespace, self.rank, spec, self.layers, slot,
                                         self.memory.has_events)
            except PegaflowError as exc:
                lost, client = exc, None
                self.fail(spec)
                continue
            if not submitted:  # no group of it has layers here (a bug upstream): vLLM recomputes it
                if (lost := release_lease(client, spec, self.rank)) is not None:
                    client = None
                self.fail(spec)
                continue
            self._group_of.update((load.command_id, load.group) for load in submitted if load.group is not None)
            if spec.is_async:
                self.pending.sent([load.command_id for load in submitted], spec, time.monotonic())
            else:
                self.step += [SentLoad(load.command_id, spec, slot) for load in submitted]
        self._mark_submitted()
        return lost

    def _mark_submitted(self) -> None:
        self.mark_hook("loads_submitted")

    def mark_hook(self, name: str) -> None:
        """The timeline's mark ``name`` now, on the CPU and (cuda) on vLLM's stream."""
        if self.trace.is_on and self.memory.has_events:
            self.trace.gpu_mark(name, self.memory.current_stream())
        self.trace.mark(name)

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

    def fail(self, spec: LoadSpec) -> None:
        self.stats.add("load_failed_blocks", len(spec.block_ids))
        if spec.groups:
            self.failed_recving.add(spec.req_id)  # (the scheduler plans these async only)
        else:
            self.errors.update(spec.block_ids)
        self.taint.failed_load(spec.req_id, spec.block_ids)
        if spec.is_async:
            self.finished_recving.add(spec.req_id)

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
            events = [base(slot) + v for command_id, _, slot in self.step if slot is not None
                      for v in layers if command_id not in group_of or v in layers_of(group_of[command_id])]
        if not events:
            return
        try:
            stream = self.memory.current_stream()
            self.memory.events.wait(events, stream)
            self.trace.layer_ready(stream)
        except PegaflowError as exc:  # unfenced data must not be used: vLLM recomputes it
            logger.error("pegaflow: cannot fence this step's loads (%s); reporting them failed", exc)
            self._fail_step()

    def wait(self) -> Lost:
        """The engine accepted (cuda) or finished (host) each of this step's loads."""
        self.is_waited = True
        if not self.step:
            return None  # nothing to wait for: no reconnect attempt inside vLLM's forward
        # Only the connection the loads went out on can answer them (never a newer one).
        client, ok, lost = self.client, [], None
        if client is not None and not self.is_connection_live():
            client = None
        deadline = time.monotonic() + self.config.command_timeout_ms / 1e3
        failed: dict[str, LoadSpec] = {}  # (a hybrid load fails whole, once)
        for sent in self.step:
            if client is None:
                failed[sent.spec.req_id] = sent.spec
                continue
            try:
                done = client.wait(sent.command_id, max(deadline - time.monotonic(), 1e-3))
            except PegaflowError as exc:
                lost, client = exc, None
                failed[sent.spec.req_id] = sent.spec
                continue
            self.stats.observe("load_s", time.monotonic() - self.sent_at)
            if done.is_ok:
                ok.append(sent)
            else:
                logger.warning("pegaflow: load of %d blocks for %s failed (%s); vLLM recomputes them",
                               len(sent.spec.block_ids), sent.spec.req_id, getattr(done.status, "name", done.status))
                failed[sent.spec.req_id] = sent.spec
        for spec in failed.values():
            self.fail(spec)
        self.step = [sent for sent in ok if sent.spec.req_id not in failed]
        self.trace.mark("loads_accepted")
        return lost

    def is_connection_live(self) -> bool:
        """Whether the connection this step's loads went out on is still the link's, and its
        engine still runs."""
        return self.link.current() is self.client and self.client is not None and self.client.is_engine_up()

    def check_fenced(self) -> Lost:
        """Fenced loads were answered when issued, and vLLM's stream was told their pages
        are there by events the engine records: an engine that went away before the
        copies ended leaves blocks partly written.  Reported failed, vLLM drops this
        step's tokens of those requests and recomputes them.  Best effort: the check runs
        when the CPU ends the step, which may be before the GPU has run the copies."""
        client = self.client  # the connection the loads went out on, not a newer one
        reason, lost = None, None
        if client is None or self.link.current() is not client:
            reason = "the connection this step's loads went out on was dropped"
        else:
            try:
                client.check_engine()
            except PegaflowError as exc:
                reason, lost = str(exc), exc
        if reason is not None:
            logger.error("pegaflow: the engine went away while this step's loads were copied "
                         "(%s); vLLM recomputes them", reason)
            self._fail_step()
        else:
            self._count_loaded()
        self.step = []
        return lost

    def end_step(self) -> Lost:
        """The step is over on the CPU: its loads are waited for and judged (fenced ones
        against their connection; host ones finished when answered)."""
        lost = None
        if not self.is_waited:
            lost = self.wait()  # a step that ran no attention layer still reports its loads
        if self.step and self.memory.has_events:
            lost = self.check_fenced() or lost
        elif self.step:
            self._count_loaded()
            self.step = []
        return lost

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
        collected = self.pending.collect(client, now, self.config.command_timeout_ms / 1e3)
        for spec, sent_at, is_ok in collected.answered:
            if spec.groups and not is_ok:  # a hybrid load fails whole once its last LOAD is in
                self.fail(spec)
                continue
            self.stats.observe("load_s", now - sent_at)
            if is_ok:
                self.stats.add("loaded_blocks", len(spec.block_ids))
                self.finished_recving.add(spec.req_id)
            else:
                self.fail(spec)  # a load error, and its blocks' saves held back (the taint)
        return collected.expired is None

    def fail_async(self) -> None:
        """The connection they went out on is gone: every async load failed."""
        for spec in self.pending.take_all():
            self.fail(spec)

    def take_finished_recving(self) -> set[str]:
        done, self.finished_recving = self.finished_recving, set()
        return done

    def take_failed_recving(self) -> set[str]:
        failed, self.failed_recving = self.failed_recving, set()
        return failed
