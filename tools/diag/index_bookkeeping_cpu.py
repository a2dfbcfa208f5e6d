"""Index bookkeeping per saved block on a full pool (reserve with eviction, mark done, touch),
without and with the pool table (--keep-pool), 1024-block chunks; prints us per block.

Ran on the 2-core CPU machine at commit ee313ce.  python tools/diag/index_bookkeeping_cpu.py
"""
import os, sys, time
import numpy as np
sys.path.insert(0, os.getcwd())
from engine.index import BlockIndex
from engine.pool import PagePool
from engine.pool_table import PoolTable
def run(table_on):
    pool_b, slab = 1 << 30, 64 << 20
    t = PoolTable.private(pool_b, slab) if table_on else None
    idx = BlockIndex(PagePool(pool_b, slab, t.records_per_slab if t else None), 60.0, t)
    rng = np.random.default_rng(0); n = 0; t0 = None
    for step in range(60):
        keys = [(1, rng.bytes(33)) for _ in range(1024)]
        if step == 10: t0 = time.perf_counter(); n = 0
        idx.reserve_many(keys, 128 << 10, 32, 0); idx.mark_layers_done(keys, (1 << 32) - 1); idx.touch_chain(keys)
        n += len(keys)
    return (time.perf_counter() - t0) / n * 1e6, idx.counters.evictions
for on in (False, True):
    print("table" if on else "no table", "%.2f us/block, evictions %d" % run(on))
