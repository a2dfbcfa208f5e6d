"""WorkerSide paths that need no vLLM: giving up on saves that never finish."""

from pegaflow.connector.config import ConnectorConfig
from pegaflow.connector.worker import WorkerSide


class StuckClient:
    """A client of an engine that is alive but never answers; records what is done to it."""

    def __init__(self):
        self.calls = []

    def try_take(self, request_id):
        return None

    def check_engine(self):
        pass

    def revoke(self):
        self.calls.append("revoke")

    def close(self, detach=True, timeout_s=2.0):
        self.calls.append("close")


def test_worker_save_deadline_revokes_the_saves_before_the_blocks_are_reused():
    # 1. A preempted request's save is outstanding on an engine that never answers.
    worker = WorkerSide(ConnectorConfig(command_timeout_ms=50), namespace=1, rank=0, num_blocks=8)
    client = StuckClient()
    worker.link._client = client
    worker._save_cmds[11] = ("req-a",)
    worker._pending_saves["req-a"] = 1
    # 2. Past the deadline the worker lets vLLM reuse the blocks: the link revokes the
    #    saves (the engine must store nothing it copies later), then drops the connection.
    worker.wait_for_saves_of({"req-a"})
    assert client.calls == ["revoke", "close"]
    assert "req-a" not in worker._pending_saves and worker.link.is_down
