"""A process's connection to the engine: claim a slot, submit commands, read completions.

``EngineClient.connect(name)`` attaches to the engine's control segment, checks magic,
wire version and the descriptor fingerprint, claims a free client slot under the
control lock and says ATTACH on the slot's ring.  Each command (a typed value of
``pegaflow.platform.protocol``) gets a command id, the client's count of its commands;
``submit`` never waits for the answer, ``wait`` does (with a deadline), and ``call``
is both.  Completions that arrive for other requests are kept until asked for.  The
commands by name (``ping``, ``lookup``, ``submit_save``, ``submit_load``, ...) close the
class: each builds its typed command and submits it.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np

from pegaflow.client.answers import Answers
from pegaflow.client.slots import claim_slot, give_back_slot, open_control, wait_slot_active
from pegaflow.platform import shm
from pegaflow.platform.arena import PayloadArena
from pegaflow.platform.errors import (
    CommandError,
    EngineGoneError,
    EngineNotRunningError,
    EngineTimeoutError,
    PegaflowError,
)
from pegaflow.platform.protocol import (
    Attach,
    Completion,
    Detach,
    Drop,
    Load,
    Lookup,
    LookupAnswer,
    Ping,
    Prefill,
    Register,
    RegisterEvents,
    Release,
    ReleaseClaim,
    Reset,
    ResetAnswer,
    Save,
    Voters,
    checked,
    completion_of,
    encode,
    event_or_none,
    hash_records,
    raw_submission,
    record_fields,
)
from pegaflow.platform.ring import RingConsumer, RingProducer, RingSegmentView
from pegaflow.platform.shm import is_pid_alive
from pegaflow.platform.waits import Doorbell, poll_until
from pegaflow.platform.wire import ALL_LAYERS, CONTROL_HEADER, NO_EVENT, ClientRole

logger = logging.getLogger(__name__)

_DETACH = Detach()
_PING = Ping()


class _HeaderWords:
    """The control header's stopping word, read without building a record (a liveness
    check runs on every use of a link)."""

    def __init__(self, control: shm.Segment):
        raw = control.array(np.uint8, CONTROL_HEADER.itemsize)
        self.is_stopping = memoryview(raw[CONTROL_HEADER.fields["is_stopping"][1]:][:4]).cast("I")


class EngineClient:
    """One attached client; not thread-safe (use one per thread that talks to the engine)."""

    def __init__(self, engine_name: str, default_timeout_s: float = 5.0):
        self.engine_name = engine_name
        self.default_timeout_s = default_timeout_s
        self._next_command_id = 1
        self.answers = Answers()  # read, not yet asked for
        self.slot = -1
        self.epoch = 0
        self.engine_pid = 0
        self._control: shm.Segment | None = None
        self._ring_segment: shm.Segment | None = None
        self._view: RingSegmentView | None = None
        self._num_slots = 0
        self._bells: list[Doorbell] = []  # opened during the attach, closed by whoever ends it
        self._words: _HeaderWords | None = None
        self.is_closed = True

    @classmethod
    def connect(cls, engine_name: str = "pegaflow", timeout_s: float = 5.0,
                role: ClientRole = ClientRole.OTHER, rank: int = 0,
                namespace: int = 0, wait_for_start: bool = True, instance: int = 0,
                voters: tuple[int, int] | None = None) -> "EngineClient":
        """Attach; ``role``, ``rank`` and ``namespace`` are shown in the engine's per-client
        stats (``pegaflow-stat``).  ``instance``: the vLLM instance this process serves
        (its scheduler and workers name the same): a lease its LOOKUPs take is used and
        released only by clients of that instance (0: by any).  ``voters``: (how many
        clients save ``namespace``'s blocks alike, this one's index among them), a voter's
        SAVEs then tag each block (wire.py: voting).  An engine still preparing its pool is
        waited for (within ``timeout_s``), or refused at once without ``wait_for_start``."""
        client = cls(engine_name, timeout_s)
        try:
            client._attach(timeout_s, (role, rank, namespace, instance, voters), wait_for_start)
        except BaseException:
            try:
                client._abandon_attach()
            except (PegaflowError, OSError) as exc:  # the attach's own error is the one to raise
                logger.info("giving back slot %d of engine %r: %s", client.slot, engine_name, exc)
            raise
        return client

    def _abandon_attach(self) -> None:
        """A failed attach gives its slot back: it would stay taken while we live."""
        if not self.is_closed:
            self.close(detach=False)  # ring mapped: client_closed tells the engine
            return
        if self.slot >= 0 and self._control is not None:
            give_back_slot(self._control, self.engine_name, self.slot, self._num_slots)
        for bell in self._bells:
            bell.sem.close()
        if self._control is not None:
            self._control.close()
            self._control = None

    def _attach(self, timeout_s: float, identity: tuple, wait_for_start: bool) -> None:
        deadline = time.monotonic() + timeout_s  # one for the whole attach
        self._control, header = open_control(self.engine_name, deadline if wait_for_start else None)
        self.epoch, self.engine_pid = int(header["epoch"]), int(header["engine_pid"])
        if int(header["is_stopping"]) or not is_pid_alive(self.engine_pid):
            raise EngineGoneError(f"engine {self.engine_name!r} (pid {self.engine_pid}) is not running")
        if not int(header["is_serving"]) and not (wait_for_start and self._wait_serving(deadline - time.monotonic())):
            raise EngineNotRunningError(f"engine {self.engine_name!r} (pid {self.engine_pid}) "
                                        f"is still starting")
        self._words = _HeaderWords(self._control)
        flag_at = CONTROL_HEADER.fields["engine_sleeping"][1]
        engine_sleeping = memoryview(self._control.array(np.uint8, 4, flag_at)).cast("I")
        engine_bell = Doorbell(shm.attach_semaphore(shm.ipc_name(self.engine_name, "doorbell")),
                               engine_sleeping)
        self._bells.append(engine_bell)
        self._num_slots = int(header["num_slots"])
        self.slot = claim_slot(self._control, self.engine_name, self._num_slots)
        engine_bell.ring()
        wait_slot_active(self._control, self.engine_name, self.slot, self._num_slots, timeout_s)
        ring_slots, arena_bytes = int(header["ring_slots"]), int(header["arena_bytes"])
        self._ring_segment = shm.attach_segment(shm.ipc_name(self.engine_name, f"ring.{self.slot}"))
        view = RingSegmentView(self._ring_segment, ring_slots, arena_bytes)
        own_bell = Doorbell(shm.attach_semaphore(shm.ipc_name(self.engine_name, f"cq.{self.slot}")),
                            view.client_sleeping)
        self._bells.append(own_bell)
        own_bell.drain()
        self._producer = RingProducer(view.submissions, engine_bell)
        self._consumer = RingConsumer(view.completions, own_bell)
        self._arena = PayloadArena(view.arena, self._producer)
        self._view = view
        self.is_closed = False
        role, rank, namespace, instance, voters = identity
        self.call(Attach(os.getpid(), role, rank=rank, namespace=namespace, instance=instance,
                         voters=None if voters is None else Voters(*voters)), timeout_s=timeout_s)
        logger.info("attached to engine %r (pid %d) as slot %d", self.engine_name, self.engine_pid, self.slot)

    def _wait_serving(self, timeout_s: float) -> bool:
        """Until the engine (still preparing its pool) serves: True, or False at the deadline;
        EngineGoneError at once if it dies or stops meanwhile."""
        at = CONTROL_HEADER.fields["is_serving"][1]
        flag = memoryview(self._control.array(np.uint8, 4, at)).cast("I")
        next_check = [0.0]

        def serving():
            if flag[0]:
                return True
            if time.monotonic() >= next_check[0]:  # a syscall: not on every poll
                next_check[0] = time.monotonic() + 0.1
                if not is_pid_alive(self.engine_pid):
                    raise EngineGoneError(f"engine {self.engine_name!r} (pid {self.engine_pid}) "
                                          f"exited while preparing its pool")
            return None
        return poll_until(serving, timeout_s, max_pause_s=10e-3) is not None

    def _new_command_id(self) -> int:
        command_id = self._next_command_id
        self._next_command_id += 1
        return command_id

    def submit(self, command, *, timeout_s: float | None = None, payload=(), **fields) -> int:
        """Publish one command; returns its command id without waiting for the answer.

        ``command``: a typed command of ``pegaflow.platform.protocol``, or an opcode whose
        record is spelled out in ``payload`` and wire ``fields`` (``raw_submission``: for
        tests of what the engine refuses)."""
        if self.is_closed:
            raise EngineGoneError("client is closed")
        timeout_s = self.default_timeout_s if timeout_s is None else timeout_s
        encoded = (raw_submission(command, payload, **fields) if isinstance(command, int)
                   else encode(command))
        parts = encoded.payload
        num_bytes = sum(p.nbytes for p in parts) if parts else 0
        offset = self._arena.alloc(num_bytes, timeout_s) if num_bytes else 0
        if num_bytes:
            self._arena.write(offset, list(parts))
        command_id = self._new_command_id()
        producer = self._producer
        position, record = producer.position, record_fields(command_id, encoded, offset, num_bytes)
        if not producer.try_put_fields(record):
            producer.put_fields(record, timeout_s)
        if num_bytes:  # a command without payload holds no arena bytes back
            self._arena.mark_sent(position)
        return command_id

    def poll(self) -> list[Completion]:
        """Every completion that has arrived; never blocks."""
        arrived = []
        while (record := self._consumer.try_get_values()) is not None:
            arrived.append(completion_of(record))
        return arrived

    def try_take(self, command_id: int) -> Completion | None:
        for completion in self.poll():
            self.answers.keep(completion)
        return self.answers.take(command_id)

    def abandon(self, command_id: int) -> None:
        """Stop waiting for ``command_id``; its answer, when it comes, goes to ``take_orphans``."""
        self.answers.abandon(command_id)

    def take_orphans(self) -> list[Completion]:
        """Answers that arrived for abandoned requests (a lookup's lease to release, say)."""
        for completion in self.poll():
            self.answers.keep(completion)
        return self.answers.take_orphans()

    def wait(self, command_id: int, timeout_s: float | None = None) -> Completion:
        """The completion of ``command_id``; EngineTimeoutError / EngineGoneError after the deadline.

        Completions are read in ring order up to the one asked for; those of other
        requests are kept (or dropped or orphaned) as ``try_take`` would.
        """
        done = self.answers.take(command_id)
        if done is not None:
            return done
        timeout_s = self.default_timeout_s if timeout_s is None else timeout_s
        consumer = self._consumer
        deadline = time.monotonic() + timeout_s
        while True:
            now = time.monotonic()
            record = consumer.get_values(min(deadline, now + 0.5))
            if record is not None:
                completion = completion_of(record)
                if completion.command_id == command_id and self.answers.is_awaited(command_id):
                    return completion
                self.answers.keep(completion)
                continue
            if time.monotonic() >= deadline:
                self.check_engine()
                raise EngineTimeoutError(f"no answer to command {command_id} within {timeout_s:.3f}s")
            self.check_engine()  # every half second without an answer

    def call(self, command, *, timeout_s: float | None = None, **fields) -> Completion:
        """Submit and wait; a non-OK status raises CommandError."""
        return checked(self.wait(self.submit(command, timeout_s=timeout_s, **fields), timeout_s))

    def is_engine_up(self) -> bool:
        """A fast check (a signal-0 syscall, two words of shared memory) that the engine we
        attached to still runs and was not replaced; ``check_engine`` is the thorough one."""
        if self.is_closed:
            return False
        try:
            os.kill(self.engine_pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        # Our mapping of its control segment: a clean stop sets is_stopping there (a new
        # engine writes a new segment, so its epoch is checked by check_engine, not here).
        return not self._words.is_stopping[0]

    def check_engine(self) -> None:
        """Raise EngineGoneError if the engine we attached to has exited or was replaced."""
        if not is_pid_alive(self.engine_pid):
            raise EngineGoneError(f"engine {self.engine_name!r} (pid {self.engine_pid}) has exited")
        header = self._control.array(CONTROL_HEADER, 1)[0]
        if int(header["epoch"]) != self.epoch or int(header["is_stopping"]):
            raise EngineGoneError(f"engine {self.engine_name!r} is stopping or was restarted")

    def revoke(self) -> None:
        """Give up on every copy of ours not yet answered, before letting vLLM reuse their
        blocks: the engine stores nothing it finishes copying from them after this, and
        starts no SAVE or LOAD of ours still queued (it would read or overwrite blocks
        that belong to someone else by then)."""
        self._view.revoked[0] = 1

    def close(self, detach: bool = True, timeout_s: float = 2.0) -> None:
        """DETACH (best effort within ``timeout_s``; skipped when ``detach`` is False) and unmap."""
        if self.is_closed:
            return
        is_answered = False
        try:
            if detach:
                self.call(_DETACH, timeout_s=min(self.default_timeout_s, timeout_s))
                is_answered = True
        except CommandError as exc:  # answered, with an error: read all the same
            is_answered = True
            logger.info("detach from engine %r: %s", self.engine_name, exc)
        except PegaflowError as exc:
            logger.info("detach from engine %r: %s", self.engine_name, exc)
        self.is_closed = True
        if not is_answered:
            # No DETACH answer will be read: say so, or the engine keeps the slot while we
            # live.  Not after a read answer: the slot may already be someone else's.
            self._view.client_closed[0] = 1
        self._view = None
        self._words = None
        for bell in self._bells:
            bell.sem.close()
        for segment in (self._ring_segment, self._control):
            if segment is not None:
                segment.close()

    # The commands by name: each builds its typed command and submits it, or waits for its answer.

    def ping(self, timeout_s: float | None = None) -> int:
        """A round trip; returns the engine's number of copies in flight."""
        return checked(self.wait(self.submit(_PING, timeout_s=timeout_s), timeout_s)).value

    def lookup(self, namespace: int, hashes, timeout_s: float | None = None,
               wait_ms: int | None = None, prefill: Prefill | None = None) -> LookupAnswer:
        """Length of the cached prefix of ``hashes``, pinned under a lease until released."""
        done = checked(self.wait(self.submit_lookup(namespace, hashes, timeout_s, wait_ms, prefill), timeout_s))
        return done.result

    def submit_lookup(self, namespace: int, hashes, timeout_s: float | None = None,
                      wait_ms: int | None = None, prefill: Prefill | None = None) -> int:
        """``wait_ms``: the most the engine waits for blocks of the prefix still being saved
        (None: the engine's --lookup-wait-ms; 0: no wait).  ``prefill``: this instance takes
        part in compute once (it claims what it misses, waits for what another claimed)."""
        return self.submit(Lookup(namespace, hash_records(hashes), wait_ms, prefill), timeout_s=timeout_s)

    def release_claim_nowait(self, hashes) -> None:
        """End this instance's claims on ``hashes`` (compute once), fire and forget."""
        self.answers.ignore(self.submit(ReleaseClaim(hash_records(hashes))))

    def release(self, lease_id: int) -> int:
        """End a lease; returns the command id to wait on."""
        return self.submit(Release(lease_id))

    def release_nowait(self, lease_id: int) -> None:
        """End a lease, fire and forget: its answer is dropped on arrival."""
        self.answers.ignore(self.release(lease_id))

    def submit_save(self, namespace: int, block_ids, hashes: list[bytes], *,
                    layer: int = ALL_LAYERS, event_index: int = NO_EVENT,
                    one_event: bool = False, group: int | None = None, tags=None) -> int:
        """``event_index``: the first event (``pegaflow.platform.protocol``: the k-th layer copied waits for
        ``layer_event(event_index, k)``; with ``one_event``, every layer for ``event_index``
        alone).  ``group``: only that KV cache group's layers, instead of ``layer``.
        ``tags``: a voter's (one u64 per block, wire.py: voting)."""
        return self.submit(Save(namespace, block_ids, hash_records(hashes), layer, group,
                                event_or_none(event_index), one_event, tags))

    def submit_drop(self, namespace: int, hashes, since_command: int = 0) -> int:
        """Ask the engine to forget those of these blocks that our SAVEs from command id
        ``since_command`` on stored (their data was found bad since); the answer's
        ``value`` is how many it held."""
        return self.submit(Drop(namespace, hash_records(hashes), since_command))

    def drop_nowait(self, namespace: int, hashes, since_command: int = 0) -> None:
        """``submit_drop``, fire and forget: its answer is dropped on arrival."""
        self.answers.ignore(self.submit_drop(namespace, hashes, since_command))

    def reset(self, namespace: int, timeout_s: float | None = None) -> ResetAnswer:
        """Empty the engine's cache of ``namespace`` (ours, or one our vLLM instance's clients
        attached under: ``engine/commands/reset.py``); CommandError if refused."""
        return checked(self.wait(self.submit(Reset(namespace), timeout_s=timeout_s), timeout_s)).result

    def submit_load(self, namespace: int, block_ids, hashes: list[bytes], *, lease_id: int = 0,
                    layer: int = ALL_LAYERS, event_index: int = NO_EVENT,
                    after_client: bool = False, group: int | None = None,
                    ends_lease: bool = True) -> int:
        """``after_client``: the copy waits for the last event of our pool, which the caller
        recorded on its stream before this call.  ``event_index``: the first event the
        layers' copies record (``pegaflow.platform.protocol``).  ``group``: only that KV cache group's layers,
        instead of ``layer``.  ``ends_lease`` False: ``lease_id`` pins these blocks and
        another LOAD (a later group's) ends it."""
        return self.submit(Load(namespace, block_ids, hash_records(hashes), lease_id, ends_lease,
                                layer, group, event_or_none(event_index), after_client))

    def register_region(self, region_id: int, region, layers) -> None:
        """REGISTER one region of KV memory (a wire.REGION record and its wire.LAYER records)."""
        self.call(Register(region_id, region, layers))

    def register_events(self, handles) -> None:
        self.call(RegisterEvents(handles))
