import os

from pegaflow.stats.engine_stats import read_stats
from tools.engine_process import EngineProcess


def test_engine_process_wait_pool_pinned_returns_once_the_whole_pool_is_in_use():
    with EngineProcess(f"tep{os.getpid()}", "--slab-size", "16MiB", pool_size="512MiB") as engine:
        engine.wait_pool_pinned(60)
        stats = read_stats(engine.name)
        assert stats["pool_bytes_capacity"] >= 512 << 20
        assert stats["pool_bytes_ready"] == stats["pool_bytes_capacity"]
