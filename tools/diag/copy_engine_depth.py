"""Direct CudaBackend (no engine): 10k-token SAVE and LOAD at random block ids and random
pool entries, one op or cut like an engine SAVE, for copy-engine depths 1..32 and the kernel
at 2 and 4; prints GB/s, ratio to the pinned copy, and the CPU time of the submit.

Ran on the H200 at commit 85d79e1, where ``layers_in_flight`` was also the copy engine's
depth (now ``dma_layers_in_flight``, passed here too).  python tools/diag/copy_engine_depth.py
"""
import os, sys, time, json
import numpy as np
sys.path.insert(0, os.getcwd())
from tools import bench_transfer as bt
from engine.copy.base import CopyOp, Direction, LayerPlacement
from engine.transfers import chunk_bounds

def main():
    global runner, geo, entry_bytes, layers, rng, tok, NB, NBYTES
    conn, proc, exported = bt.start_client()
    ceil = bt.measure_ceiling(3)
    print("ceiling", {k: round(v, 2) for k, v in ceil.items()}, flush=True)
    runner = bt.DirectRunner(exported, 4608 << 20)
    geo = bt.kv_geometry(16)
    entry_bytes = 32 * geo["page_bytes"]
    layers = [LayerPlacement(i, 16, i * geo["layer_bytes"], geo["page_bytes"]) for i in range(32)]
    rng = np.random.default_rng(5)
    tok = iter(range(1, 1 << 40))
    NB = 625
    NBYTES = NB * geo["page_bytes"] * 32

    def one(direction, chunked):
        ids = rng.choice(geo["num_blocks"], NB, replace=False).astype(np.int64)
        ent = rng.choice(runner.pool.size // entry_bytes, NB, replace=False).astype(np.int64) * entry_bytes
        bounds = list(chunk_bounds(NB)) if chunked else [(0, NB)]
        b = runner.backend
        t0 = time.perf_counter()
        for s, e in bounds:
            b.submit(CopyOp(next(tok), direction, 0, layers, geo["page_bytes"], ids[s:e], ent[s:e]))
        t_issue = time.perf_counter() - t0
        n = 0
        while n < len(bounds):
            for d in b.poll():
                assert not d.error, d.error
                n += 1
        return time.perf_counter() - t0, t_issue

    res = []
    for path, depth in [("copy-engine", 1), ("copy-engine", 2), ("copy-engine", 3), ("copy-engine", 4),
                        ("copy-engine", 6), ("copy-engine", 8), ("copy-engine", 32), ("kernel", 2), ("kernel", 4)]:
        runner.open(path, [16], layers_in_flight=depth, dma_layers_in_flight=depth)
        for direction in (Direction.SAVE, Direction.LOAD):
            for chunked in (False, True):
                xs = [one(direction, chunked) for _ in range(7)][1:]
                wall = float(np.median([x[0] for x in xs])); iss = float(np.median([x[1] for x in xs]))
                lab = "d2h" if direction == Direction.SAVE else "h2d"
                r = dict(path=path, depth=depth, dir=lab, chunked=chunked, gbps=NBYTES / wall / 1e9,
                         ratio=NBYTES / wall / 1e9 / ceil[lab], issue_ms=iss * 1e3, wall_ms=wall * 1e3)
                res.append(r)
                print(f"{path:12} depth {depth:2} {lab} chunked={chunked!s:5} {r['gbps']:6.2f} GB/s "
                      f"x{r['ratio']:.3f} issue {r['issue_ms']:6.2f} ms wall {r['wall_ms']:6.2f} ms", flush=True)
        runner.close_backend()
    runner.close()
    conn.send(None); proc.join(30)
    json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "sv.json"), "w"))

if __name__ == '__main__':
    main()
