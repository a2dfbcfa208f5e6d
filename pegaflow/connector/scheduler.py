"""The scheduler side: ask the engine what is cached, plan loads and saves.

It never touches KV memory.  ``get_num_new_matched_tokens`` asks the engine (over the
scheduler's own ring) for the blocks vLLM has not computed and caches the answer per
request, so repeated calls have no side effect; the answer's lease pins those blocks
until the workers' LOAD uses it (or it is released here, or it expires).  Each step,
``build_connector_meta`` hands the workers the loads planned at allocation and the
full blocks the step completes (prefill chunks and decode alike).

A hybrid model (several KV cache groups) has a block table per group (``plans.py``).  Its
loads always go between steps: vLLM can take a failed load of such a model only as a failed
request (``failed_recving``).  A sliding window gives blocks back inside ``schedule()``,
and vLLM may hand them out at once while a SAVE of an earlier step still reads them: such
a step's metadata makes the workers wait for those SAVEs before its forward.
"""

from __future__ import annotations

import logging
import time

from pegaflow.connector.config import ConnectorConfig
from pegaflow.connector.link import ClientIdentity, EngineLink
from pegaflow.connector.metadata import PegaConnectorMetadata, SavesDone, SaveSpec
from pegaflow.connector.plans import extend_tables, load_spec, next_save
from pegaflow.connector.prefix_lookups import LOOKUP_MAX_AGE_S, Lookups
from pegaflow.connector.request_state import RequestState
from pegaflow.connector.stats import PegaKVConnectorStats
from pegaflow.connector.trace import log_schedule
from pegaflow.platform.errors import CommandError, EngineTimeoutError, PegaflowError
from pegaflow.platform.protocol import Reset, checked
from pegaflow.platform.wire import ClientRole, attach_role

logger = logging.getLogger(__name__)


def writes_load_blocks(scheduler_output, loads) -> bool:
    """Whether vLLM writes a block of ``loads`` while the workers prepare the step, between
    ``handle_preemptions`` and ``start_load_kv`` (its model runner's ``_update_states``): a new
    block it zeroes (a Mamba or mixed-precision cache; it skips an async load's) or a partial
    prefix hit's block copied (read or written).  vLLMs before 0.26 do neither."""
    written = set(getattr(scheduler_output, "new_block_ids_to_zero", None) or ())
    for copy in getattr(scheduler_output, "kv_cache_block_copies", None) or ():
        written.update(copy)  # (src_block_id, dst_block_id)
    return bool(written) and any(not written.isdisjoint(spec.block_ids) for spec in loads)


class SchedulerSide:
    def __init__(self, config: ConnectorConfig, namespaces: list[int], block_size: int, instance: int = 0,
                 num_groups: int = 1, state_groups: frozenset[int] = frozenset()):
        self.config = config
        # KV cache groups (more than one: a hybrid model), and of them the Mamba groups (mamba_state.py)
        self.num_groups, self.state_groups = num_groups, state_groups
        self.namespaces = namespaces  # one per worker rank: pp x tp of them, rank = pp_rank * tp_size + tp_rank
        self.block_size = block_size
        identity = ClientIdentity(attach_role(ClientRole.SCHEDULER, config.wire_kv_role), 0,
                                  namespaces[0] if namespaces else 0, instance)
        self.link = EngineLink(config.engine_name, config.reconnect_interval_s, "pegaflow scheduler",
                               identity=identity)
        self.requests: dict[str, RequestState] = {}
        self._held: set[str] = set()  # finished and held, not yet told to the workers
        self._awaiting_report: set[str] = set()  # held until the workers report their saves done
        self._rewound: set[int] = set()  # failed blocks seen since the last step's metadata
        self._finish_saves: list[SaveSpec] = []  # planned at a request's finish, for the next step
        self._step = 0  # metadata built so far (PegaConnectorMetadata.step)
        self._running: set[str] = set()  # scheduled by the last step and not finished since
        self._saves_done_through = 0  # every worker's SAVEs of the steps up to this are over
        self._saved_by_step: dict[int, set[int]] = {}  # hybrid: step -> the blocks its SAVEs read, until over
        self._loading: dict[str, tuple[int, ...]] = {}  # hybrid: async loads' blocks, until finished
        self.stats = PegaKVConnectorStats()  # what vLLM's metrics get (get_kv_connector_stats)
        self.lookups = Lookups(config, namespaces, block_size, self.link, self.stats, bool(state_groups))
        if config.is_off:
            self.link.close()  # no engine slot held for nothing

    # -- lookup ---------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Cached tokens beyond ``num_computed_tokens``; None while the engine's answer is on
        its way (vLLM asks again next step), a miss once ``lookup_timeout_ms`` has passed."""
        state = self.requests.get(request.request_id)
        if state is None:
            state = self.requests[request.request_id] = RequestState(request)
        if state.has_failed_load:  # (else a load failing for good would be retried forever)
            return 0, False
        is_stale = (state.lookup is None and
                    time.monotonic() - state.looked_up_at > LOOKUP_MAX_AGE_S)
        if state.lookup_at_tokens != num_computed_tokens or is_stale:
            self.lookups.release_leases(state)
            state.lookup_at_tokens, state.looked_up_at = num_computed_tokens, time.monotonic()
            state.num_hit_tokens, state.lease_ids, state.is_from_disk = 0, (), False
            self.lookups.start(state, request, num_computed_tokens)
        if state.lookup is not None and not self.lookups.finish(state):
            self.stats.add("lookup_deferrals")
            return None, False
        state.is_async_hit = self._is_async(state)  # what the allocation's load plan follows
        return state.num_hit_tokens, state.is_async_hit

    def _is_async(self, state) -> bool:
        """Load between steps (vLLM waits for it outside the forward): under load_mode async;
        for a hit read from disk first, as disk_load_mode says (async by default: the step
        that loads it layer-wise waits, on the CPU, for the engine's reads); under auto,
        whenever other requests are running, so that their steps never wait for this load."""
        config = self.config
        if state.num_hit_tokens <= 0:
            return False
        if self.num_groups > 1:
            return True  # a failed load must be reportable as a failed request (see above)
        mode = config.load_mode
        if mode != "async" and state.is_from_disk:
            mode = config.disk_load_mode
        return mode == "async" or (mode == "auto" and bool(self._running))

    # -- plans ----------------------------------------------------------------------------

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        state = self.requests.get(request.request_id)
        if state is None:
            return
        if num_external_tokens <= 0:
            if state.lookup_at_tokens >= 0:  # offered but not taken
                self.lookups.release_leases(state)
                state.lookup_at_tokens = -1
            return
        tables = blocks.get_block_ids()
        state.block_ids = [list(t) for t in tables]  # an async load's request is not scheduled yet
        first, count = state.lookup_at_tokens // self.block_size, num_external_tokens // self.block_size
        hashes = tuple(request.block_hashes[first:first + count])
        state.pending_load = load_spec(request.request_id, tables, first, count, hashes, state.lease_ids,
                                       state.is_async_hit, self.state_groups)
        state.lease_ids, state.lookup_at_tokens = (), -1  # the load owns the leases now
        # The loaded blocks are stored already: never save them back (if their load fails,
        # the GPU holds garbage under their hashes until vLLM recomputes them).
        state.num_saved_blocks = max(state.num_saved_blocks, first + count)

    def build_connector_meta(self, scheduler_output) -> PegaConnectorMetadata:
        """The step's plan for the workers: the loads planned at allocation, the saves of the
        full blocks this step completes, and which held or preempted requests they must
        finish or wait for."""
        if (client := self.link.client()) is not None:
            self.lookups.release_orphans(client)
        self._step += 1
        meta = self._new_meta(scheduler_output)
        handed_out = self._plan_saves(meta, scheduler_output)
        if self.num_groups > 1:
            self._plan_reuse_wait(meta, handed_out)
        for state in self.requests.values():
            if state.pending_load is not None:
                meta.loads.append(state.pending_load)
                state.is_async_loading = state.pending_load.is_async
                state.pending_load = None
        meta.loads_after_input_prep = bool(meta.loads) and writes_load_blocks(scheduler_output, meta.loads)
        log_schedule(self._step, scheduler_output, meta)
        return meta

    def _new_meta(self, scheduler_output) -> PegaConnectorMetadata:
        """The step's metadata with what happened since the last: requests held or preempted,
        failed loads seen, saves planned at a request's finish."""
        meta = PegaConnectorMetadata(step=self._step, held_req_ids=self._held, preempted_req_ids=set(
            scheduler_output.preempted_req_ids or ()), rewound_block_ids=self._rewound,
            namespaces=tuple(self.namespaces))
        self._held, self._rewound = set(), set()
        meta.saves.extend(self._finish_saves)
        self._finish_saves = []
        cached = scheduler_output.scheduled_cached_reqs
        self._running = {new.req_id for new in scheduler_output.scheduled_new_reqs} | set(cached.req_ids)
        for req_id in meta.preempted_req_ids:
            if (state := self.requests.get(req_id)) is not None:
                state.block_ids = [[]]
                state.has_saves = False  # the workers wait for them before the blocks are reused
                self.lookups.release_claims(state, state.num_saved_blocks)  # compute once: none past those
        return meta

    def _plan_saves(self, meta: PegaConnectorMetadata, scheduler_output) -> set[int]:
        """Follow each scheduled request's block tables and plan the saves of the full blocks
        the step completes; the blocks the step hands out anew (a hybrid model's, else none)."""
        num_scheduled = scheduler_output.num_scheduled_tokens
        is_hybrid = self.num_groups > 1
        handed_out: set[int] = set()  # hybrid: blocks this step allocates (the reuse check)
        for new in scheduler_output.scheduled_new_reqs:
            if is_hybrid:  # past its computed (hit) blocks, which are only read
                first = new.num_computed_tokens // self.block_size
                handed_out.update(b for ids in new.block_ids for b in ids[first:])
            if (state := self.requests.get(new.req_id)) is not None:
                state.block_ids = [list(ids) for ids in new.block_ids]
                self._plan_save(meta, state, new.num_computed_tokens + num_scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if new_ids and is_hybrid:
                handed_out.update(b for ids in new_ids for b in ids)
            if (state := self.requests.get(req_id)) is None:
                continue
            if req_id in cached.resumed_req_ids:
                state.block_ids = [list(ids) for ids in new_ids] if new_ids else [[]]
            elif new_ids:
                extend_tables(state.block_ids, new_ids)
            self._plan_save(meta, state, cached.num_computed_tokens[i] + num_scheduled.get(req_id, 0))
        return handed_out

    def _plan_reuse_wait(self, meta: PegaConnectorMetadata, handed_out: set[int]) -> None:
        """A hybrid model: the step's loads write blocks too; the workers wait, before the
        forward, for SAVEs that still read a block handed out again (``_reuse_wait``)."""
        for state in self.requests.values():
            if state.pending_load is not None:
                handed_out.update(state.pending_load.block_ids)
                self._loading[state.request.request_id] = state.pending_load.block_ids
        meta.wait_saves_through = self._reuse_wait(handed_out)
        if saved := {b for spec in meta.saves for b in spec.block_ids}:
            self._saved_by_step[self._step] = saved

    def _reuse_wait(self, handed_out: set[int]) -> int:
        """The last step whose SAVEs, possibly still running, read a block handed out again
        in this one (0: none).  Only a block vLLM let go without asking us can be: a
        sliding window's (a finished request's are held, a preempted one's waited for).  The
        wait is in the workers' ``handle_preemptions``, before the step's loads and forward.
        vLLM 0.33's V2 model runner queues two other writes of new blocks before that hook,
        not covered: zeroing them (mixed-precision caches), and a partial hit's last block copied."""
        if not handed_out or not self._saved_by_step:
            return 0
        return max((step for step, blocks in self._saved_by_step.items()
                    if step > self._saves_done_through and not blocks.isdisjoint(handed_out)), default=0)

    def _plan_save(self, meta: PegaConnectorMetadata, state: RequestState, num_tokens: int) -> None:
        if not self.config.enable_save:
            return
        planned = next_save(state.request, state.block_ids, state.num_saved_blocks, num_tokens // self.block_size,
                            self.state_groups)
        if planned is None:
            return
        if planned.spec is not None:
            meta.saves.append(planned.spec)
        state.num_saved_blocks = planned.num_full
        state.has_saves, state.last_save_step = True, self._step

    # -- finish ---------------------------------------------------------------------------

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        """Keep the blocks (True) while saves of this request may still read them."""
        self._running.discard(request.request_id)
        state = self.requests.get(request.request_id)
        if state is None:
            return False, None
        self.lookups.release_request(state, request)  # its leases, and its claims (compute once)
        if (client := self.link.client()) is not None:
            self.lookups.release_orphans(client)
        has_finish_save = not state.is_async_loading and self._plan_finish_save(state, request, block_ids)
        if state.has_saves and not has_finish_save and state.last_save_step <= self._saves_done_through:
            del self.requests[request.request_id]  # every copy of its blocks is over: free them now
            return False, None
        if state.has_saves and not state.is_async_loading:
            # (an aborted request still loading is held by vLLM itself until finished_recving)
            self._held.add(request.request_id)
            self._awaiting_report.add(request.request_id)
            return True, None
        del self.requests[request.request_id]
        return False, None

    def _plan_finish_save(self, state: RequestState, request, block_ids) -> bool:
        """Blocks whose KV is computed but whose hashes came too late for any step's plan
        (asynchronous scheduling hands over a step's tokens after the next step is planned):
        saved by the next step, the request's blocks held until then.  Whether it planned one."""
        if not self.config.enable_save or not block_ids:
            return False
        tables = block_ids if isinstance(block_ids[0], (list, tuple)) else (block_ids,)
        planned = next_save(request, tables, state.num_saved_blocks, request.num_computed_tokens // self.block_size,
                            self.state_groups)
        if planned is None or planned.spec is None:
            return False
        self._finish_saves.append(planned.spec)
        state.num_saved_blocks, state.has_saves = planned.num_full, True
        return True

    def update_connector_output(self, connector_output) -> None:
        done = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(done, SavesDone) and done.num_ranks == len(self.namespaces):  # every worker's word
            self._saves_done_through = max(self._saves_done_through, done.through_step)
            for step in [s for s in self._saved_by_step if s <= self._saves_done_through]:
                del self._saved_by_step[step]
        for req_id in connector_output.finished_sending or ():
            self.requests.pop(req_id, None)
            self._awaiting_report.discard(req_id)
        for req_id in getattr(connector_output, "failed_recving", None) or ():
            # vLLM recomputes the whole request (its blocks freed first) or fails it: the workers may save
            # what lands in those blocks once told (rewound); the request is saved anew, never loaded again.
            self._rewound |= set(self._loading.get(req_id, ()))
            if (state := self.requests.get(req_id)) is not None:
                state.num_saved_blocks, state.block_ids, state.has_failed_load = 0, [[]], True
        for req_id in connector_output.finished_recving or ():
            self._loading.pop(req_id, None)
            if (state := self.requests.get(req_id)) is not None:
                state.is_async_loading = False
        if connector_output.invalid_block_ids:
            self._rewind_saves(connector_output.invalid_block_ids)
            self._rewound |= set(connector_output.invalid_block_ids)

    def _rewind_saves(self, invalid_block_ids: set[int]) -> None:
        """Blocks that failed to load are recomputed by vLLM: save them (and what follows)
        again once they are; the workers dropped this step's saves of those requests."""
        for state in self.requests.values():
            bad = [j for table in state.block_ids for j, block_id in enumerate(table)
                   if block_id in invalid_block_ids]
            if bad:
                state.num_saved_blocks = min(state.num_saved_blocks, min(bad))

    def reset_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache`` with ``reset_external``: every rank's namespace emptied in
        the engine (a RESET each, ``engine/commands/reset.py``).  False where the engine is
        unreachable, refuses, or has not answered within ``command_timeout_ms`` (vLLM then
        reports that the reset failed); never raises into vLLM, never waits longer."""
        client = self.link.client()
        if client is None:
            logger.warning("pegaflow scheduler: cache not reset: engine %r unreachable", self.config.engine_name)
            return False
        timeout_s = self.config.command_timeout_ms / 1e3
        deadline, ids, answers = time.monotonic() + timeout_s, [], []
        try:
            for namespace in dict.fromkeys(self.namespaces):  # (MLA's ranks share one)
                ids.append(client.submit(Reset(namespace), timeout_s=timeout_s))
            for command_id in ids:
                answers.append(client.wait(command_id, max(deadline - time.monotonic(), 0.0)))
        except EngineTimeoutError as exc:
            for command_id in ids[len(answers):]:  # answered later: dropped then
                client.abandon(command_id)
            logger.warning("pegaflow scheduler: cache not reset: %s", exc)
            return False
        except PegaflowError as exc:
            self.link.fail(exc)
            logger.warning("pegaflow scheduler: cache not reset: %s: %s", type(exc).__name__, exc)
            return False
        try:
            results = [checked(answer).result for answer in answers]
        except CommandError as exc:  # refused: e.g. a rank's namespace no worker of ours attached under
            logger.warning("pegaflow scheduler: cache not reset, the engine refused: %s", exc)
            return False
        logger.info("pegaflow scheduler: cache reset: %d blocks dropped (%d in use, freed when let go), "
                    "%d disk blocks", sum(r.num_dropped for r in results), sum(r.num_held for r in results),
                    sum(r.num_disk_dropped for r in results))
        return True

    def take_stats(self) -> PegaKVConnectorStats | None:
        return self.stats.take(is_engine_up=not self.link.is_down)

    def has_pending_work(self) -> bool:
        """Held blocks are freed only by a later step's worker report: keep stepping."""
        return bool(self._awaiting_report)

    def shutdown(self) -> None:
        for state in self.requests.values():
            self.lookups.release_leases(state)
        self.link.close()
