"""The engine's time around a copy, without a GPU: an engine whose backend finishes every
copy 25 ms after the command's first one starts, and a client timing 625-block SAVE and
LOAD rounds; prints the medians of submit -> engine, engine -> first copy, copy end ->
answer, answer -> client.  The argument is the engine's idle spin in seconds.

Ran on the 2-core CPU machine at commit ee0e623 and after.  python tools/diag/engine_overhead_cpu.py 0.002
"""
import multiprocessing as mp, os, sys, time, json
sys.path.insert(0, os.getcwd())
import numpy as np
NB, NL, PAGE = 625, 32, 4096
DELAY = 0.025

def engine_main(name, q, spin, shared):
    from engine.config import EngineConfig
    from engine.server import EngineServer
    from engine.copy.host import HostBackend
    from engine.copy.base import CopyDone
    from engine import clients as cl
    from engine.__main__ import tighten_timer_slack
    class Fixed(HostBackend):
        t_end = 0.0
        def register_region(self, slot, region_id, region): pass
        def submit(self, op):
            now = time.perf_counter()
            if not self._done:
                Fixed.t_end = now + DELAY; shared[0] = now; shared[1] = Fixed.t_end
            self._done.append(CopyDone(op.token))
        def poll(self):
            if self._done and time.perf_counter() >= Fixed.t_end:
                d, self._done = self._done, []; return d
            return []
    oa = cl.ClientState.answer
    def ans(self, rid, opcode, *a, **k):
        if int(opcode) in (8, 9): shared[2] = time.perf_counter()
        return oa(self, rid, opcode, *a, **k)
    cl.ClientState.answer = ans
    from engine import transfers as tr
    for m, slot in (("save", 3), ("load", 3)):
        o = getattr(tr.Transfers, m)
        def w(self, *a, _o=o, **k):
            shared[3] = time.perf_counter(); return _o(self, *a, **k)
        setattr(tr.Transfers, m, w)
    cfg = EngineConfig(name=name, pool_bytes=3 << 30, slab_bytes=64 << 20, backend="host", idle_spin_s=spin)
    srv = EngineServer(cfg, backend=Fixed())
    tighten_timer_slack()
    import signal; signal.signal(signal.SIGTERM, lambda *_: srv.request_stop())
    q.put("up"); srv.serve_forever()

def main():
    from pegaflow.client import EngineClient
    from pegaflow.host_memory import layer_records
    from pegaflow import wire
    spin = float(sys.argv[1]) if len(sys.argv) > 1 else 2e-3
    name = f"ovh{os.getpid()}"
    ctx = mp.get_context("spawn"); q = ctx.Queue(); shared = ctx.Array("d", 5, lock=False)
    p = ctx.Process(target=engine_main, args=(name, q, spin, shared)); p.start(); q.get(timeout=30)
    c = EngineClient.connect(name, timeout_s=30)
    region = np.zeros(1, dtype=wire.REGION)
    region["kind"] = wire.RegionKind.HOST_SHM; region["num_layers"] = NL; region["num_blocks"] = 40000
    region["page_bytes"] = PAGE; region["alloc_bytes"] = NL * 40000 * PAGE; region["shm_name"] = b"x"
    c.register_region(0, region, layer_records(list(range(NL)), [i * 40000 * PAGE for i in range(NL)], [PAGE] * NL))
    rng = np.random.default_rng(0)
    rows = {"save": [], "load": []}
    for r in range(25):
        ids = rng.choice(40000, NB, replace=False); hs = [rng.bytes(32) for _ in range(NB)]
        for kind in ("save", "load"):
            if kind == "load":
                f = c.lookup(1, hs)
                t0 = time.perf_counter(); d = c.wait(c.submit_load(1, ids, hs, lease_id=f.lease_id), 30); t1 = time.perf_counter()
            else:
                t0 = time.perf_counter(); d = c.wait(c.submit_save(1, ids, hs), 30); t1 = time.perf_counter()
            assert d.is_ok
            first, t_end, answered = shared[0], shared[1], shared[2]
            rows[kind].append(((shared[3] - t0) * 1e3, (first - shared[3]) * 1e3, (answered - t_end) * 1e3, (t1 - answered) * 1e3, (t1 - t0 - DELAY) * 1e3))
    for kind, xs in rows.items():
        a = np.median(np.array(xs[3:]), axis=0)
        print(f"spin {spin} {kind}: to engine {a[0]:.3f}, engine to first copy {a[1]:.3f} ms, tail {a[2]:.3f} ms, to client {a[3]:.3f} ms, total overhead {a[4]:.3f} ms")
    c.close(); p.terminate(); p.join(30)

if __name__ == "__main__":
    main()
