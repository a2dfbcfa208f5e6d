"""The CUDA copy backend: client GPU memory <-> the pinned pool, on the driver API only.

Protocol (every call from the dispatcher thread but ``pin_range``; ``submit`` and ``poll``
never wait for a copy; ``unregister_client`` waits for the slot's copies, and
``register_region`` under ``auto`` up to ``PROBE_DRAIN_S`` for a quiet moment to measure in)::

    open_pool(segment)         remember the /dev/shm pool; nothing of it is pinned yet
    pin_range(start, n)        the pinning thread (engine/memory/pinning.py), a faulted-in chunk at a
                               time: cuMemHostRegister it, write each page once by DMA
                               (contents unchanged; ``cuda_device.PinnedPool``)
    extend_pool(n)             the pool's first n bytes are pinned: checked to lie at
                               ``pool_base`` + offset on every device, then open to copies
    register_region(...)       open the client's IPC memory handle (once per allocation) on the
                               engine's device of its GPU UUID (``visible_gpus.py``)
    register_events(...)       open the client's pool of IPC events
    submit(op)                 with ``hold_saves``, a SAVE whose client's GPU is still writing
                               its data is held until it is written (``held_saves.py``);
                               staged: per sub-chunk a gather launch and a copy per run, on
                               the device's staging streams; otherwise one copy per layer
                               on that layer's low-priority stream
    poll()                     the ops whose completion event has fired (cuEventQuery)
    drop_held(slot)            its held SAVEs ended (its client is gone: the data may never come)
    unregister_client(slot)    close its handles and events; a gone client's off this thread,
                               not waited for (``releases.py``)

Ordering.  A SAVE reads only bytes the client finished writing (it waits for the client's
event first); a LOAD records the client's event of each layer once that layer is in, and the
client's compute stream waits on it.  Loads and saves have their own stream per layer, so a
load never queues behind a save (how deep each path runs: ``cuda_layers.py``); staged ops
keep the same rules on their own streams (``staged.py``).

Paths (which one an op takes: ``paths.py``): ``kernel``, an NVRTC launch per layer over the mapped
pool (``kernels.py``); ``copy-engine``, a ``cuMemcpyBatchAsync`` per layer, pages in pool address
order; ``staged`` (``staged.py``); ``auto`` measures the first two per page size (``probe.py``).

Errors.  ``submit`` refuses an op by raising: a CommandError for one that fails its checks
(nothing issued), a CudaError for one whose issue failed (its copies issued so far drained
first); the caller answers that command and ``poll`` never reports it.  A copy that fails after
it was issued comes back from ``poll`` as ``CopyDone(token, error)``.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from pegaflow.platform.cuda import driver
from pegaflow.platform.errors import ConfigError, CudaError
from pegaflow.platform.wire import gpu_uuid_text

from . import staged
from .base import AUTO, COPY_ENGINE, DEVICE_STAGING_BYTES, KERNEL, STAGED, CopyBackend, CopyDone, CopyOp
from .checks import Region, check_op
from .cuda_clients import ClientMappings, check_region
from .cuda_device import Device, PinnedPool
from .cuda_layers import Inflight, LayerCopier
from .held_saves import HeldSaves, last_wait_event
from .kernels import StagingRing
from .paths import op_path
from .probe import choose_path
from .releases import Releaser, release_logged
from .visible_gpus import VisibleGpus

logger = logging.getLogger(__name__)

CLOSE_WAIT_S = 2.0  # after the server's own drain


class CudaBackend(CopyBackend):
    name = "cuda"

    def __init__(self, copy_backend: str = AUTO, num_ctas: int = 16, layers_in_flight: int = 2,
                 dma_layers_in_flight: int = 4, staging_words: int = 1 << 20, device: int = 0,
                 device_staging_bytes: int = DEVICE_STAGING_BYTES, hold_saves: bool = False,
                 load_layer_groups: int = 1) -> None:
        if num_ctas < 1 or layers_in_flight < 1 or dma_layers_in_flight < 1:
            raise ConfigError("num_ctas, layers_in_flight and dma_layers_in_flight must be at "
                              "least 1")
        driver.init()
        self._gpus = VisibleGpus.of_driver()
        logger.info("GPUs this engine sees: %s", self._gpus.describe())
        self.copy_backend = copy_backend
        self.num_ctas = num_ctas
        self.device_staging_bytes = device_staging_bytes
        self.load_layer_groups = load_layer_groups
        self._devices: dict[int, Device] = {}
        self._default_device = device
        self._pool: tuple[int, int] | None = None  # (host address, size)
        self._pinned: PinnedPool | None = None
        self._usable_bytes = 0  # the pool's first bytes pinned and open to copies
        self._device(device)
        self._staging = StagingRing(staging_words)
        self._layers = LayerCopier(self._staging, layers_in_flight, dma_layers_in_flight)
        self._clients = ClientMappings()
        self._inflight: list[Inflight] = []
        self._ready: list[CopyDone] = []
        self.hold_saves = hold_saves
        self._held = HeldSaves()  # with hold_saves: SAVEs waiting for their client's data (held_saves.py)
        self._gone: set[int] = set()  # slots whose client is gone, their handles not yet let go
        self._releaser = Releaser()  # lets go of a gone client's handles (releases.py)
        self._num_waits_let_go = 0  # held SAVEs ended unissued: a gate's wait on a client event
        #                             stays on the GPU, and may never end if that client is gone
        self.probes: list[dict] = []  # what ``auto`` measured and chose, for tools and logs

    def _device(self, device: int) -> Device:
        dev = self._devices.get(device)
        if dev is None:
            dev = Device(device, self.num_ctas)
            if self.device_staging_bytes and self.copy_backend in (AUTO, STAGED):
                try:
                    dev.staging = staged.DeviceStaging(self.device_staging_bytes, self.load_layer_groups)
                except CudaError as exc:
                    logger.warning("device %d: no device staging (%s); copies take the other "
                                   "paths", device, exc)
            if self._usable_bytes:
                try:
                    self._locate_pool(dev, 0, self._usable_bytes)
                except CudaError:
                    dev.close()
                    raise
            self._devices[device] = dev
        driver.use_device(device)
        return dev

    def open_pool(self, pool_segment) -> None:
        if self._pool is not None:
            raise CudaError("a pool is already attached")
        self._pool = (pool_segment.address(), pool_segment.size)
        self._pinned = PinnedPool(*self._pool, self._default_device)

    def pin_range(self, start: int, num_bytes: int) -> None:
        started = time.perf_counter()
        self._pinned.pin(start, num_bytes)
        logger.debug("pool: %d MiB at %d MiB registered and written once by DMA in %.3f s",
                     num_bytes >> 20, start >> 20, time.perf_counter() - started)

    def extend_pool(self, num_bytes: int) -> None:
        for dev in self._devices.values():
            driver.use_device(dev.device)
            self._locate_pool(dev, self._usable_bytes, num_bytes)
        self._usable_bytes = num_bytes

    def _locate_pool(self, dev: Device, start: int, end: int) -> None:
        """``dev.pool_base`` (on the current device) and a check that the pool's chunks in
        ``[start, end)`` lie there at their offsets (CudaError if not)."""
        if start == 0:
            dev.pool_base = driver.host_device_pointer(self._pool[0])
        self._pinned.check(dev.pool_base, start, end)

    def register_region(self, slot: int, region_id: int, region: np.void) -> None:
        check_region(region)
        gpu_uuid, client_device = region["gpu_uuid"].tobytes(), int(region["client_device"])
        dev = self._device(self._gpus.ordinal_of(gpu_uuid, client_device))
        self._clients.map_region(slot, region_id, region, dev.device)
        logger.info("slot %d region %d: on %s, the client's device %d, this engine's device %d", slot,
                    region_id, gpu_uuid_text(gpu_uuid), client_device, dev.device)
        if self.copy_backend == AUTO:
            self._choose_path(dev, int(region["page_bytes"]))

    def register_events(self, slot: int, handles: np.ndarray) -> None:
        self._clients.set_events(slot, handles)

    def unregister_client(self, slot: int) -> None:
        """Its copies drained, its handles let go: a gone client's (``drop_held``) off this
        thread, not waited for; a release the driver refuses is logged, never raised."""
        self._end_held(slot, "the client left before its data to save was written")
        pending = [f for f in self._inflight if f.slot == slot]
        if pending:
            logger.warning("slot %d unregistered with %d copies in flight: draining", slot,
                           len(pending))
            for f in pending:
                driver.use_device(f.device)
                driver.synchronize_event(f.done)
        steps = self._clients.close_slot(slot)
        if slot in self._gone:
            self._gone.discard(slot)
            self._releaser.submit(steps, f"slot {slot}: letting go of a gone client's memory and events")
        else:
            release_logged(steps, f"slot {slot}: letting go of its memory and events")

    def drop_held(self, slot: int) -> None:
        """Its client is gone: its held SAVEs end now, its handles go off this thread."""
        self._gone.add(slot)
        self._end_held(slot, "the client left before its data to save was written")

    def _end_held(self, slot: int, why: str) -> None:
        ended = self._held.take_slot(slot)
        if ended:
            logger.warning("slot %d: %d held saves ended (%s); their waits on its events stay on "
                           "the GPU", slot, len(ended), why)
            self._num_waits_let_go += len(ended)
        self._ready += [CopyDone(held.op.token, why) for held in ended]

    def poll(self) -> list[CopyDone]:
        self._held.issue_ready(lambda held: self._start(self._device(held.regions[0].device), held.op,
                                                        held.regions), self._ready)
        ready, self._ready = self._ready, []
        pending, current = [], None
        for f in self._inflight:
            if f.device != current:
                driver.use_device(f.device)
                current = f.device
            try:
                if not driver.event_done(f.done):
                    pending.append(f)
                    continue
                ready.append(CopyDone(f.token))
            except CudaError as exc:
                ready.append(CopyDone(f.token, f"CudaError: {exc}"))
            self._release(f)
        self._inflight = pending
        return ready

    def num_inflight(self) -> int:
        return len(self._inflight) + len(self._ready) + len(self._held)

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Release every mapping once no copy runs.  Copies still running after ``wait_s``
        (they wait on client GPU work that never ends) keep everything mapped: unmapping
        memory under a running copy could fault the device, and the process exit tears
        the contexts down anyway.  Never longer than about twice ``wait_s``: client handles
        are let go off this thread, waited for up to ``wait_s``; after held SAVEs ended
        unissued (a wait on a client's event that may never end), nothing that could wait
        for the GPU is released (``releases.py``)."""
        for held in self._held.close():  # never issued: nothing to wait for
            self._ready.append(CopyDone(held.op.token, "engine closing"))
            self._num_waits_let_go += 1
        deadline = time.monotonic() + wait_s
        while self._inflight:
            for done in self.poll():
                if done.error:
                    logger.error("copy %d failed while closing: %s", done.token, done.error)
            if self._inflight and time.monotonic() >= deadline:
                logger.error("%d copies still running on the GPU after %.1f s (they wait on client "
                             "GPU work that never finished): leaving the pool and client memory "
                             "mapped", len(self._inflight), wait_s)
                return
            time.sleep(1e-3)
        self._ready = []
        self._gone |= self._clients.slots  # each let go off this thread, the wait for them bounded
        for slot in self._clients.slots:
            self.unregister_client(slot)
        if not self._releaser.close(wait_s):  # (it says what it left)
            logger.error("leaving the pool, staging and devices to the process exit")
            return
        if self._num_waits_let_go:
            logger.error("%d held saves ended unissued: their waits on client events may never end "
                         "on the GPU, and releasing the pool, staging and devices could wait for them: "
                         "left to the process exit", self._num_waits_let_go)
            return
        self._staging.close()
        if self._pinned is not None:  # the pinning thread is over: what it pinned is final
            self._pinned.close()
            self._pinned, self._pool, self._usable_bytes = None, None, 0
        for dev in self._devices.values():
            dev.close()
        self._devices.clear()

    def submit(self, op: CopyOp) -> None:
        """Issue ``op``'s copies; a CommandError (an op that fails its checks: nothing issued)
        or a CudaError (its copies issued so far drained) refuses it: the caller answers its
        command, ``poll`` never reports it."""
        regions = self._validate(op)
        if len(op.block_ids) == 0:
            self._ready.append(CopyDone(op.token))
            return
        dev = self._device(regions[0].device)
        if self.hold_saves and (event := last_wait_event(op)) is not None:
            events = self._clients.events(op.slot, dev.device)
            if not driver.event_done(events[event]):  # its client's GPU is still writing: held_saves.py
                self._held.hold(dev, op, regions, events)
                return
        self._start(dev, op, regions)

    def _start(self, dev: Device, op: CopyOp, regions: list[Region]) -> None:
        """Issue ``op`` now (a CudaError: its copies issued so far drained, then raised)."""
        op = op.in_pool_order()
        path = op_path(self.copy_backend, dev, op, regions)
        staging = None
        if path == KERNEL:
            staging = self._layers.stage_ids(op)
        elif path == STAGED:
            staging = self._layers.stage_ids(op, staged.local_offsets(op, dev.staging.buffer_bytes,
                                                                      dev.staging.groups_of(op)))
        if path in (KERNEL, STAGED) and staging is None:
            path = COPY_ENGINE  # staging ring full: DMA needs none
        inflight = Inflight(op.token, op.slot, dev.device, staging)
        try:
            self._issue(dev, op, regions, path, inflight)
        except CudaError:
            self._drain(inflight)
            raise
        self._inflight.append(inflight)

    def _issue(self, dev: Device, op: CopyOp, regions: list[Region], path: str,
               f: Inflight) -> None:
        events = self._clients.events(op.slot, dev.device)
        driver.use_device(dev.device)
        if path == STAGED:
            staged.issue(dev.staging, dev.kernel, op, regions, dev.pool_base,
                         self._staging.address(f.staging[0]), events, dev.event, f,
                         self._pinned.unit)
        else:
            self._layers.issue(dev, op, regions, path, f, events)

    def _drain(self, f: Inflight) -> None:
        """After a failed enqueue: let what was issued finish, then recycle."""
        f.drain()
        self._release(f)

    def _release(self, f: Inflight) -> None:
        self._layers.release(self._devices[f.device], f)

    def _validate(self, op: CopyOp) -> list[Region]:
        """Every region known, every page inside its allocation and the pool's open part."""
        return check_op(op, self._clients.regions, self._usable_bytes if self._pool else None,
                        self._clients.num_events(op.slot))

    def _choose_path(self, dev: Device, page_bytes: int) -> None:
        choose_path(dev, page_bytes, self._usable_bytes, self._inflight, self._layers.copy_layer,
                    self._layers.stage_ids, self._staging.free, self.probes)
