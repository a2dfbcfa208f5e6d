"""pegaflow/connector/step_loads.py: a step's loads return what broke the connection."""

from types import SimpleNamespace

from pegaflow.connector.config import ConnectorConfig
from pegaflow.connector.link import EngineLink
from pegaflow.connector.metadata import LoadSpec, PegaConnectorMetadata
from pegaflow.connector.stats import PegaKVConnectorStats
from pegaflow.connector.step_loads import StepLoads
from pegaflow.connector.taint import Taint
from pegaflow.connector.trace import StepTrace
from pegaflow.platform.errors import RingFullError


class FullRingClient:
    """Accepts the first LOAD, then finds the ring full."""

    epoch, engine_pid = 1, 1

    def __init__(self):
        self.num_sent = 0

    def submit_load(self, namespace, block_ids, hashes, **kwargs):
        self.num_sent += 1
        if self.num_sent > 1:
            raise RingFullError("submission ring full")
        return 40

    def is_engine_up(self):
        return True


def test_step_loads_submit_that_breaks_the_connection_is_returned_not_dropped():
    # 1. A step with two loads on host memory; the second LOAD finds the ring full.
    link = EngineLink("nosuchengine", 5.0, "test worker")
    client = FullRingClient()
    link.use(client)
    loads = StepLoads(ConnectorConfig(), 1, 0, link, PegaKVConnectorStats(), Taint(), StepTrace())
    loads.memory = SimpleNamespace(has_events=False)
    meta = PegaConnectorMetadata(loads=[LoadSpec("a", (1,), (b"a" * 32,), (0,), False),
                                        LoadSpec("b", (2,), (b"b" * 32,), (0,), False)])
    lost = loads.start(meta, link.client)
    # 2. The error comes back to the step's owner; the link is left alone (no drop, no
    #    callback), and the load that could not go out is already a load error.
    assert isinstance(lost, RingFullError)
    assert link.current() is client and link.num_dropped == 0
    assert loads.take_errors() == {2} and [sent.spec.req_id for sent in loads.step] == ["a"]
