"""An engine (in a child process) with every driver call of its copy path timed (copies,
launches, waits, records; "batches" counts the copy calls), and the
bench's KV owner doing 10k-token SAVE and LOAD rounds: per command, when its first copy
call started, how long the batch calls took (sum, longest), the Python time between them,
when the last one returned and when the command was answered.

Ran on the H200 at commit 7618c01 (auto, copy-engine; copies were batch calls only then)
and c9ce610 (staged).
python tools/diag/engine_issue_calls.py auto
"""
import json
import multiprocessing as mp
import os
import signal
import sys
import time

sys.path.insert(0, os.getcwd())


def engine_main(name: str, path: str, q, outfile: str) -> None:
    from engine import clients, transfers
    from engine.config import EngineConfig
    from engine.copy.cuda import CudaBackend
    from engine.server import EngineServer
    from pegaflow.cuda import driver
    rec = []

    def timed(fn, what):
        def call(*a, **k):
            t0 = time.perf_counter()
            if what in ("save", "load"):
                rec.append((what, t0, t0, 0))
            r = fn(*a, **k)
            rec.append((what, t0, time.perf_counter(), len(a[0]) if what == "batch" else 0))
            return r
        return call

    driver.memcpy_batch_async = timed(driver.memcpy_batch_async, "batch")
    driver.memcpy_async = timed(driver.memcpy_async, "copy")
    driver.launch = timed(driver.launch, "launch")
    driver.wait = timed(driver.wait, "wait")
    driver.record = timed(driver.record, "record")
    for meth in ("save", "load"):
        setattr(transfers.Transfers, meth, timed(getattr(transfers.Transfers, meth), meth))
    answer = clients.ClientState.answer

    def answered(self, rid, opcode, *a, **k):
        rec.append(("answer", time.perf_counter(), 0.0, int(opcode)))
        return answer(self, rid, opcode, *a, **k)
    clients.ClientState.answer = answered
    cfg = EngineConfig(name=name, pool_bytes=9 << 30, slab_bytes=64 << 20, backend="cuda",
                       copy_backend=path)
    srv = EngineServer(cfg, backend=CudaBackend(copy_backend=path))
    signal.signal(signal.SIGTERM, lambda *_: srv.request_stop())
    q.put("up")
    srv.serve_forever()
    with open(outfile, "w") as f:
        json.dump(rec, f)


def main() -> None:
    from pegaflow.wire import Opcode
    from tools import bench_transfer
    SAVE, LOAD = int(Opcode.SAVE), int(Opcode.LOAD)
    conn, proc, _ = bench_transfer.start_client()
    out = os.environ.get("OUT", "/tmp")
    for path in sys.argv[1:] or ["auto"]:
        name = f"ic{os.getpid()}{len(path)}"
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        f = os.path.join(out, f"issue_{path}.json")
        p = ctx.Process(target=engine_main, args=(name, path, q, f))
        p.start()
        q.get(timeout=120)
        conn.send((name, 10000, 16, 6, 7))
        r = conn.recv()
        p.terminate()
        p.join(60)
        if "error" in r:
            print(path, "client error:", r["error"])
            continue
        with open(f) as fh:
            rec = json.load(fh)
        print(path, "client save ms", [round(x * 1e3, 2) for x in r["save_s"]],
              "load ms", [round(x * 1e3, 2) for x in r["load_s"]])
        cur = None
        for what, t0, t1, n in rec:
            if what in ("save", "load") and t1 == t0:
                cur = dict(kind=what, t0=t0, ret=t0, calls=[])
            elif cur is not None and what == cur["kind"]:
                cur["ret"] = t1
            elif cur is not None and what in ("batch", "wait", "record", "copy", "launch"):
                cur["calls"].append((what, t0, t1, n))
            elif cur is not None and what == "answer" and n in (SAVE, LOAD) and "answer" not in cur:
                batches = [c for c in cur["calls"] if c[0] in ("batch", "copy")]
                if batches:
                    ms = lambda t: (t - cur["t0"]) * 1e3  # noqa: E731
                    busy = sum(c[2] - c[1] for c in cur["calls"]) * 1e3
                    span = (cur["calls"][-1][2] - cur["calls"][0][1]) * 1e3
                    print(f"  {cur['kind']:4}: first call at {ms(batches[0][1]):.2f} ms, "
                          f"{len(batches)} batches of {sum(c[3] for c in batches)} pages: "
                          f"{sum(c[2] - c[1] for c in batches) * 1e3:.2f} ms in them "
                          f"(longest {max(c[2] - c[1] for c in batches) * 1e3:.2f}), "
                          f"{span - busy:.2f} ms between driver calls, last returned at "
                          f"{ms(cur['calls'][-1][2]):.2f}, handler returned at "
                          f"{ms(cur['ret']):.2f}, answered at {ms(t0):.2f}")
                cur["answer"] = True
    conn.send(None)
    proc.join(30)


if __name__ == "__main__":
    main()
