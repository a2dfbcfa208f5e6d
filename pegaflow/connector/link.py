"""A connection to the engine that survives the engine going away and coming back.

Every ``client()`` call first checks (a syscall and two words of shared memory) that the
engine it is attached to still runs: an engine that died or was replaced while this
process was idle is noticed before a command goes to its dead rings.  While the engine
is unreachable, ``client()`` answers None (callers then miss, drop the save, or report a
load error), one warning is logged, and a reconnect is tried every
``reconnect_interval_s`` -- at once, though, when a new engine is seen serving under the
name (the control segment is looked at every ``PROBE_INTERVAL_S``), so an instance that
outlives an engine restart saves and is served again right away.  ``on_connect``
re-registers what a fresh engine must know.

A dropped connection is a value, not a call back into its user: ``num_dropped`` counts the
connections dropped so far, and a user that keeps commands out compares it with the count
it last saw (its commands sent before a drop will never be answered).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import NamedTuple

from pegaflow.client.connection import EngineClient
from pegaflow.client.slots import serving_engine_epoch
from pegaflow.platform.errors import CommandError, EngineGoneError, PegaflowError
from pegaflow.platform.wire import ClientRole, Status

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 1.0
DETACH_TIMEOUT_S = 0.2
REFUSED_RETRY_S = 60.0  # the engine refused our setup: its config must change first
PROBE_INTERVAL_S = 0.05  # while down: how often to look for a new engine serving the name
# Answers that say our setup does not fit this engine (others, e.g. SHUTTING_DOWN, pass).
REFUSALS = frozenset({Status.BAD_ARGUMENT, Status.BAD_PAYLOAD, Status.UNKNOWN_REGION})


class ClientIdentity(NamedTuple):
    """Who this process is to the engine (``EngineClient.connect``)."""

    role: int  # a ClientRole, with the kv_role bits (attach_role)
    rank: int  # the worker's rank index (pp_rank * tp_size + tp_rank); 0 for the scheduler
    namespace: int
    instance: int  # the vLLM instance key (0: none)


class Voters(NamedTuple):
    """TP ranks that hold the same KV (MLA) and vouch for one stored copy together."""

    num_voters: int
    voter: int  # this rank's index among them


class EngineLink:
    def __init__(self, engine_name: str, reconnect_interval_s: float, who: str,
                 on_connect: Callable[[EngineClient], None] | None = None,
                 identity: ClientIdentity = ClientIdentity(ClientRole.OTHER, 0, 0, 0),
                 voters: Voters | None = None):
        self.engine_name = engine_name
        self.identity = identity
        self.voters = voters
        self.num_dropped = 0  # connections dropped so far: their commands are void
        self.reconnect_interval_s = reconnect_interval_s
        self.who = who
        self.on_connect = on_connect
        self.num_failures = 0
        self.is_down = False
        self._is_refused = False  # the outage is a refusal of our setup
        self._client: EngineClient | None = None
        self._next_try = 0.0
        self._next_probe = 0.0
        self._failed_epoch = 0  # the engine we lost: a probe finding it again is no news
        self.is_closed = False  # closed by its owner: never connects again

    def client(self) -> EngineClient | None:
        """The live client, connecting if it is time to try (or a new engine serves); None
        while the engine is down, and for good once closed."""
        if self.is_closed:
            return None
        client = self._client
        if client is not None:
            if client.is_engine_up():
                return client
            self.fail(EngineGoneError(f"engine {self.engine_name!r} (pid {client.engine_pid}) "
                                      f"exited or was replaced"))
        now = time.monotonic()
        if now < self._next_try and not self._is_new_engine_serving(now):
            return None
        self._next_try = now + self.reconnect_interval_s
        client = None
        try:
            who = self.identity
            client = EngineClient.connect(self.engine_name, timeout_s=CONNECT_TIMEOUT_S, role=who.role,
                                          rank=who.rank, namespace=who.namespace, instance=who.instance,
                                          voters=self.voters,
                                          wait_for_start=False)  # never stall vLLM for it
            if self.on_connect is not None:
                self.on_connect(client)
        except PegaflowError as exc:
            if client is not None:
                self._failed_epoch = client.epoch  # it refused us: only another engine is news
                client.close(timeout_s=DETACH_TIMEOUT_S)  # e.g. REGISTER refused: free the slot
            self._mark_down(exc, is_refused=isinstance(exc, CommandError) and exc.status in REFUSALS)
            return None
        if self.is_down or self.num_failures:
            logger.warning("%s: engine %r is reachable again; cache in use", self.who, self.engine_name)
        self.is_down = False
        self._client = client
        return client

    def _is_new_engine_serving(self, now: float) -> bool:
        """Whether an engine other than the last one we lost or tried serves the name
        (looked for at most every PROBE_INTERVAL_S)."""
        if now < self._next_probe:
            return False
        self._next_probe = now + PROBE_INTERVAL_S
        epoch = serving_engine_epoch(self.engine_name)
        if epoch == 0 or epoch == self._failed_epoch:
            return False
        self._failed_epoch = epoch  # tried once now; if that fails, the interval rules again
        return True

    def current(self) -> EngineClient | None:
        """The live client, without trying to connect."""
        return self._client

    def use(self, client) -> None:
        """Take ``client`` as the live connection, as if just connected (tools and tests
        drive the connector with a client of their own this way)."""
        self._client = client

    def fail(self, exc: Exception) -> None:
        """An operation failed: drop the connection and retry later."""
        self._mark_down(exc)
        if self._client is not None:
            self._failed_epoch = self._client.epoch
            # Whoever uses this link forgets its saves now and lets their blocks be reused:
            # the engine must store nothing it copies for us from here on.
            self._client.revoke()
            # A live engine frees our slot (and whatever we left queued) on DETACH.
            self._client.close(detach=not isinstance(exc, EngineGoneError), timeout_s=DETACH_TIMEOUT_S)
            self._client = None
            self.num_dropped += 1
        self._next_try = time.monotonic() + self.reconnect_interval_s

    def _mark_down(self, exc: Exception, is_refused: bool = False) -> None:
        """Logged once per kind of outage.  A refusal (the engine is there and answered, but
        refused what we registered) is an ERROR and is tried again rarely: an engine
        restarted with another config accepts."""
        self.num_failures += 1
        if not self.is_down or is_refused != self._is_refused:
            if is_refused:
                logger.error("%s: engine %r refused this process (%s); the engine's log says why "
                             "(e.g. a KV block larger than its --slab-size, GPU memory offered "
                             "to a --backend host engine, or a GPU the engine does not see); "
                             "serving without the cache, trying again "
                             "every %.0fs", self.who, self.engine_name, exc,
                             max(self.reconnect_interval_s, REFUSED_RETRY_S))
            else:
                logger.warning("%s: engine %r unreachable (%s: %s); serving without the cache "
                               "(lookups miss, saves are dropped, loads recompute) and retrying "
                               "every %.0fs", self.who, self.engine_name, type(exc).__name__, exc,
                               self.reconnect_interval_s)
        self.is_down, self._is_refused = True, is_refused
        if is_refused:
            self._next_try = time.monotonic() + max(self.reconnect_interval_s, REFUSED_RETRY_S)

    def close(self) -> None:
        """Detach for good: a later ``client()`` answers None instead of reconnecting (a
        closed connector whose buffers are gone must never register them again)."""
        self.is_closed = True
        if self._client is not None:
            self._client.close()
            self._client = None
