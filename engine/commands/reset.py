"""RESET: every block of one namespace forgotten (vLLM's ``reset_prefix_cache`` with
``reset_external``, through the connector's ``reset_cache``).

Whose namespace: a client may empty the namespace it attached under, and those its vLLM
instance's other clients attached under (a scheduler attaches under its first rank's
namespace and looks up every rank's).  Any other namespace, 0 among them, is refused
BAD_ARGUMENT: one vLLM never empties another model's cache.

What goes:

- the pool's entries of the namespace (``BlockIndex.drop_namespace``): an unused one at once;
  one still in use (leased, being loaded, being saved, read from or written to disk) is never
  served again and freed when let go, so no copy ever runs on a freed page (answered as
  ``num_held``); a LOAD of a lease that held one answers MISSING_BLOCK (vLLM recomputes);
- a kept pool's entries not taken in yet;
- the disk tier's files of the namespace (else a LOOKUP would read them back);
- not the remote tier's store: the engines of other hosts share it and serve from it, and a
  RESET empties this engine's cache only.  A LOOKUP may still be served from it afterwards.

A LOOKUP parked for a save of the namespace (``lookup_waits.py``) is answered when that save
ends, with what is READY then: a miss.  Claims (compute once) stay: they say who is
computing a prefix, not what is stored.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from pegaflow.platform.errors import CommandError
from pegaflow.platform.protocol import Reset, ResetAnswer
from pegaflow.platform.wire import Status

from ..blocks.index import BlockIndex
from ..stats import StatsWriter
from .received import Received

logger = logging.getLogger(__name__)


class Resets:
    def __init__(self, index: BlockIndex, stats: StatsWriter, clients: Callable[[], tuple], disk=None):
        """``clients``: the attached clients now (whose namespaces an instance may name);
        ``disk``: the disk tier (``engine/disk/tier.py``), where the engine has one."""
        self.index, self.stats, self.clients, self.disk = index, stats, clients, disk

    def reset(self, received: Received, reset: Reset) -> ResetAnswer:
        client, namespace = received.client, reset.namespace
        if not self.may_reset(client, namespace):
            raise CommandError(Status.BAD_ARGUMENT, f"namespace {namespace:016x} is not this client's "
                                                    f"nor its vLLM instance's")
        num_dropped, num_held = self.index.drop_namespace(namespace)
        num_disk = self.disk.forget_namespace(namespace) if self.disk is not None else 0
        for name, amount in (("resets", 1), ("reset_blocks_dropped", num_dropped),
                             ("reset_blocks_held", num_held), ("reset_disk_blocks_dropped", num_disk)):
            self.stats.add(name, amount)
        logger.info("slot %d (pid %d): namespace %016x reset: %d pool blocks dropped (%d of them in use, "
                    "freed when let go), %d disk blocks", client.slot, client.pid, namespace, num_dropped,
                    num_held, num_disk)
        return ResetAnswer(num_dropped, num_held, num_disk)

    def may_reset(self, client, namespace: int) -> bool:
        """Whether ``client`` may empty ``namespace``: its own, or one its instance's clients use."""
        if namespace == 0:
            return False
        if namespace == client.namespace:
            return True
        return client.instance != 0 and any(other.instance == client.instance and other.namespace == namespace
                                            for other in self.clients())
