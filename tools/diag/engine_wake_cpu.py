"""Wake-up cost of a sleeping engine, without a GPU: an engine (copies that finish at once)
with idle spins of 2, 5 and 20 ms, pinged 4 ms after its last work (about vLLM's gap from a
lookup to its load); prints the ping's median and 90th percentile.

Ran on the 2-core CPU machine at commit eee3918.  python tools/diag/engine_wake_cpu.py
"""
import multiprocessing as mp, os, sys, time
sys.path.insert(0, os.getcwd())
import numpy as np

def engine_main(name, q, spin):
    from engine.config import EngineConfig
    from engine.server import EngineServer
    from engine.copy.host import HostBackend
    from engine.copy.base import CopyDone
    from engine.__main__ import tighten_timer_slack
    class Null(HostBackend):
        def register_region(self, *a): pass
        def submit(self, op): self._done.append(CopyDone(op.token))
    cfg = EngineConfig(name=name, pool_bytes=1 << 30, slab_bytes=64 << 20, backend="host", idle_spin_s=spin)
    srv = EngineServer(cfg, backend=Null()); tighten_timer_slack()
    import signal; signal.signal(signal.SIGTERM, lambda *_: srv.request_stop())
    q.put("up"); srv.serve_forever()

def main():
    from pegaflow.client import EngineClient
    for espin in (2e-3, 5e-3, 20e-3):
        for cspin in (50e-6,):
            name = f"wk{os.getpid()}{int(espin*1e4)}{int(cspin*1e5)}"
            ctx = mp.get_context("spawn"); q = ctx.Queue()
            p = ctx.Process(target=engine_main, args=(name, q, espin)); p.start(); q.get(timeout=30)
            c = EngineClient.connect(name, timeout_s=30)
            c._consumer.doorbell.spin_s = cspin
            lat = []
            for gap in [4e-3] * 40:
                time.sleep(gap)
                t0 = time.perf_counter(); c.ping(); lat.append(time.perf_counter() - t0)
            lat = np.array(lat[5:]) * 1e6
            print(f"engine spin {espin*1e3:4.0f} ms, client spin {cspin*1e6:5.0f} us: ping after 4 ms idle p50 {np.median(lat):6.0f} us p90 {np.percentile(lat, 90):6.0f} us")
            c.close(); p.terminate(); p.join(30)

if __name__ == "__main__":
    main()
