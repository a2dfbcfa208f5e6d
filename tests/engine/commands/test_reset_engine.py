"""engine.commands.reset through a real engine process: ``EngineClient.reset`` empties the
namespace its client attached under and nothing else; a RESET of another is a typed error."""

from __future__ import annotations

import pytest

from pegaflow.client.connection import EngineClient
from pegaflow.platform.errors import CommandError
from pegaflow.platform.wire import Status

NAMESPACE = 0x5E5E7
OTHER_NAMESPACE = 0x5E5E8


def test_reset_engine_empties_its_namespace_and_leaves_the_other(engine, kv_client, rng):
    # 1. A vLLM-like client stores blocks under two namespaces; a client attached under the
    #    first (a scheduler's) will ask for the reset.
    kv = kv_client(engine)
    mine, _ = kv.store(rng, NAMESPACE, [0, 1, 2])
    theirs, saved = kv.store(rng, OTHER_NAMESPACE, [3, 4])
    asker = EngineClient.connect(engine.name, namespace=NAMESPACE)
    try:
        # 2. RESET: three pool blocks dropped, none in use, no disk tier.
        assert tuple(asker.reset(NAMESPACE)) == (3, 0, 0)
        # 3. Its blocks miss now; the other namespace's still load byte-exact.
        assert kv.num_hits(NAMESPACE, mine) == 0
        found, done, loaded = kv.look_up_and_load(OTHER_NAMESPACE, theirs)
        assert found.num_hit_blocks == 2 and done.is_ok and (loaded == saved).all()
        # 4. A RESET of the other namespace is not this client's: BAD_ARGUMENT, nothing dropped.
        with pytest.raises(CommandError) as info:
            asker.reset(OTHER_NAMESPACE)
        assert info.value.status == Status.BAD_ARGUMENT
        assert kv.num_hits(OTHER_NAMESPACE, theirs) == 2
        stats = engine.stats()
        assert (stats["resets"], stats["reset_blocks_dropped"], stats["pool_blocks_used"]) == (1, 3, 2)
    finally:
        asker.close()
