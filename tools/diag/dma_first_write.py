"""Direct CudaBackend, copy engine: 10k-token SAVE / LOAD into pool entries used before
("reuse") against entries never written by DMA ("fresh"), twice.

Ran on the H200 at commit 382d6b7, before the pool was written once at attach (from
0c973c1 on, every page has been written before the first op, so both rows match).
python tools/diag/dma_first_write.py
"""
import os, sys, time
import numpy as np
sys.path.insert(0, os.getcwd())
from tools import bench_transfer as bt
from engine.copy.base import CopyOp, Direction, LayerPlacement

SCHEMES = {"one": [625], "eng64-256-241-64": [64, 256, 241, 64], "64-561": [64, 561],
           "128-433-64": [128, 433, 64], "32-128-401-64": [32, 128, 401, 64], "64-128-256-113-64": [64, 128, 256, 113, 64]}

def main():
    conn, proc, exported = bt.start_client()
    ceil = bt.measure_ceiling(3)
    print("ceiling", {k: round(v, 2) for k, v in ceil.items()}, flush=True)
    runner = bt.DirectRunner(exported, 30 << 30)
    geo = bt.kv_geometry(16)
    eb = 32 * geo["page_bytes"]
    layers = [LayerPlacement(i, 16, i * geo["layer_bytes"], geo["page_bytes"]) for i in range(32)]
    rng = np.random.default_rng(5)
    tok = iter(range(1, 1 << 40))
    NB = 625; NBYTES = NB * geo["page_bytes"] * 32
    def one(direction, sizes, start):
        ids = rng.choice(geo["num_blocks"], NB, replace=False).astype(np.int64)
        ent = (start + np.arange(NB, dtype=np.int64)) * eb
        b = runner.backend; t0 = time.perf_counter(); s = 0
        for n in sizes:
            b.submit(CopyOp(next(tok), direction, 0, layers, geo["page_bytes"], ids[s:s + n], ent[s:s + n])); s += n
        k = 0
        while k < len(sizes):
            for d in b.poll():
                assert not d.error, d.error; k += 1
        return time.perf_counter() - t0
    runner.open("copy-engine", [16])
    fresh = iter(range(1, 100))
    for trial in range(2):
        for mode in ("reuse", "fresh", "reuse-after"):
            for direction in (Direction.SAVE, Direction.LOAD):
                if mode == "fresh":
                    xs = [one(direction, [625], next(fresh) * NB) for r in range(5)]
                else:
                    xs = [one(direction, [625], 0) for r in range(6)][1:]
                lab = "d2h" if direction == Direction.SAVE else "h2d"
                print(f"trial {trial} {mode:11} {lab}: " + " ".join(f"{NBYTES / x / 1e9:5.1f}" for x in xs), flush=True)
    runner.close_backend()
    runner.close(); conn.send(None); proc.join(30)

if __name__ == "__main__":
    main()
