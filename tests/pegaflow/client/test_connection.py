"""``EngineClient.connect`` against a real engine: what ATTACH says about the client."""

from __future__ import annotations

import pytest

from pegaflow.client.connection import EngineClient
from pegaflow.platform.errors import CommandError
from pegaflow.platform.wire import Status


def test_client_voters_of_one_namespace_must_agree_on_their_number(engine):
    # 1. Rank 0 of a two-voter namespace (MLA at TP=2) attaches.
    first = EngineClient.connect(engine.name, namespace=9, voters=(2, 0))
    try:
        # 2. A client saying the namespace has three voters is refused, and so is a voter
        #    index outside the two.
        for voters in ((3, 1), (2, 2)):
            with pytest.raises(CommandError) as refused:
                EngineClient.connect(engine.name, namespace=9, voters=voters)
            assert refused.value.status == Status.BAD_ARGUMENT
        # 3. Rank 1 agrees; another namespace has a number of its own.
        EngineClient.connect(engine.name, namespace=9, voters=(2, 1)).close()
        EngineClient.connect(engine.name, namespace=10, voters=(4, 3)).close()
    finally:
        first.close()
