"""GPU: two vLLM sessions alive on one engine; A computes three prompts one at a time, B
asks for them; the engine's counters after each step, pegaflow's DEBUG log of each session
in $OUT/a.log and $OUT/b.log (SAVEs sent and answered, lookups), the engine's on stderr.

    OUT=/tmp/probe python tools/diag/fleet_probe.py 2> /tmp/probe/engine.log
"""
import os, random, sys, time
sys.path.insert(0, os.getcwd())
from tests.e2e.test_vllm_fleet import Session, _held_tokens
from tools.engine_process import EngineProcess
from pegaflow.engine_stats import read_stats

OUT = os.environ["OUT"]
rng = random.Random(11)
a_prompts = [[rng.randrange(10, 31000) for _ in range(n)] for n in (1200, 700, 2500)]
name = "probe1"
engine = EngineProcess(name, "--log-level", "DEBUG", backend="cuda", pool_size="2GiB", start_timeout_s=120)
keys = ("blocks_saved", "save_dedup_blocks", "save_dropped_blocks", "lookups", "lookup_blocks",
        "lookup_hit_blocks", "blocks_loaded", "clients_attached", "errors", "inflight_copies")
def stats(tag):
    s = read_stats(name)
    print(time.monotonic(), tag, {k: s.get(k) for k in keys}, flush=True)
try:
    a = Session(name, f"{OUT}/a.log"); b = Session(name, f"{OUT}/b.log")
    stats("start")
    for i, p in enumerate(a_prompts):
        out, hits = a.generate([p]); stats(f"A p{i} hits={hits}")
        time.sleep(0.5); stats("  +0.5s")
    for i, p in enumerate(a_prompts):
        out, hits = b.generate([p], reset=(i == 0)); stats(f"B p{i} hits={hits} held={_held_tokens(p)}")
    a.close(); b.close()
finally:
    engine.stop()
