"""An engine (in a child process, timestamps on each SAVE/LOAD entry, chunk submit,
chunk completion and answer) and the bench's KV owner doing 10k-token SAVE and LOAD rounds;
arguments are copy paths, ``+cAxBx...`` sets the SAVE chunk sizes, ``+slack`` tightens the
engine's timer slack.

Ran on the H200 at commits 85d79e1 (copy-engine, auto), 382d6b7 (``+slack``, chunk
schemes) and ee0e623 (auto).
python tools/diag/engine_copy_timeline.py auto copy-engine+c64x561
"""
import json, multiprocessing as mp, os, signal, sys, time
sys.path.insert(0, os.getcwd())
import numpy as np

def engine_main(name, path0, q, outfile):
    path = path0.split("+")[0]
    from engine.config import EngineConfig
    from engine.server import EngineServer
    from engine.copy.cuda import CudaBackend
    from engine import transfers as tr, clients as cl
    rec = []
    for part in path0.split("+")[1:]:
        if part.startswith("c"):
            sizes = [int(x) for x in part[1:].split("x")]
            def cb(n, _s=sizes):
                out, st = [], 0
                for z in _s:
                    if st >= n: break
                    out.append((st, min(n, st + z))); st += z
                if st < n: out.append((st, n))
                return out
            tr.chunk_bounds = cb
    T = tr.Transfers
    for meth in ("save", "load", "on_copy_done", "_submit"):
        orig = getattr(T, meth)
        def wrap(*a, _o=orig, _m=meth, **k):
            t0 = time.perf_counter(); r = _o(*a, **k); rec.append((_m, t0, time.perf_counter())); return r
        setattr(T, meth, wrap)
    oa = cl.ClientState.answer
    def ans(self, rid, opcode, *a, **k):
        rec.append(("answer", time.perf_counter(), int(opcode))); return oa(self, rid, opcode, *a, **k)
    cl.ClientState.answer = ans
    cfg = EngineConfig(name=name, pool_bytes=9 << 30, slab_bytes=64 << 20, backend="cuda", copy_backend=path)
    srv = EngineServer(cfg, backend=CudaBackend(copy_backend=path))
    path = path0
    signal.signal(signal.SIGTERM, lambda *_: srv.request_stop())
    if path.endswith("+slack"):
        from engine.__main__ import tighten_timer_slack
        tighten_timer_slack()
    q.put("up")
    srv.serve_forever()
    json.dump(rec, open(outfile, "w"))

def main():
    from tools import bench_transfer as bt
    import tools.bench_transfer
    conn, proc, exported = bt.start_client()
    out = os.environ.get("OUT", "/tmp")
    for path in sys.argv[1:] or ["copy-engine"]:
        name = f"tl{os.getpid()}{abs(hash(path)) % 1000}"
        ctx = mp.get_context("spawn"); q = ctx.Queue()
        f = os.path.join(out, f"tl{abs(hash(path)) % 100000}.json")
        p = ctx.Process(target=engine_main, args=(name, path, q, f)); p.start(); q.get(timeout=120)
        t_start = time.perf_counter()
        conn.send((name, 10000, 16, 6, 7)); r = conn.recv()
        p.terminate(); p.join(60)
        rec = json.load(open(f))
        print(path, "client save ms", [round(x * 1e3, 2) for x in r["save_s"]], "load ms", [round(x * 1e3, 2) for x in r["load_s"]])
        # per command: from save/load entry to its answer
        cur = None
        for m, t0, t1 in rec:
            if m in ("save", "load"):
                cur = dict(kind=m, t0=t0, handle_ms=(t1 - t0) * 1e3, submits=[], dones=[])
            elif cur and m == "_submit":
                cur["submits"].append(round((t1 - cur["t0"]) * 1e3, 2))
            elif cur and m == "on_copy_done":
                cur["dones"].append(round((t0 - cur["t0"]) * 1e3, 2))
            elif cur and m == "answer" and t1 in (8, 9):
                print(f"  {cur['kind']:4} handle {cur['handle_ms']:.2f} ms, submits end at {cur['submits']}, dones at {cur['dones']}, answered at {(t0 - cur['t0']) * 1e3:.2f}")
                cur = None
    conn.send(None); proc.join(30)

if __name__ == "__main__":
    main()
