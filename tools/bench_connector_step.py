"""CPU cost of the connector's own hooks in one decode step, against hooks that do nothing.

    python -m tools.bench_connector_step [--layers 32] [--steps 20000] [--json]

A decode step calls, on the worker, ``bind``, ``start_load_kv``, per layer
``wait_for_layer_load`` and ``save_kv_layer``, then ``wait_for_save`` and ``get_finished``;
on the scheduler, ``build_connector_meta`` and ``update_connector_output``.  Here they
run in a loop with one decoding request and nothing to load or save (15 of every 16
decode steps), the engine and the GPU replaced by stand-ins that answer at once, next
to the same calls on methods that do nothing (the call overhead itself).  What vLLM does
around the hooks is not in it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent

from pegaflow.connector.config import ConnectorConfig  # noqa: E402
from pegaflow.connector.metadata import PegaConnectorMetadata  # noqa: E402
from pegaflow.connector.scheduler import RequestState, SchedulerSide  # noqa: E402
from pegaflow.connector.worker import WorkerSide  # noqa: E402


class _Events:
    """CUDA memory with an event pool, whose calls return at once."""

    has_events = True

    def __init__(self):
        self.events = self

    def current_stream(self):
        return 0

    def record(self, indices, stream):
        pass

    def wait(self, indices, stream):
        pass


class _Client:
    """An engine that has nothing outstanding for us."""

    def try_take(self, request_id):
        return None

    def take_orphans(self):
        return []

    def check_engine(self):
        pass

    def is_engine_up(self):
        return True


class _Noop:
    """The same hooks, doing nothing."""

    def bind(self, meta): pass
    def start_load_kv(self): pass
    def wait_for_layer_load(self, name): pass
    def save_kv_layer(self, name): pass
    def wait_for_save(self): pass
    def get_finished(self, finished): return None, None
    def build_connector_meta(self, out): return None
    def update_connector_output(self, out): pass


def _pegaflow(num_layers: int):
    worker = WorkerSide(ConnectorConfig(), namespace=1, rank=0, num_blocks=4096)
    worker.memory = _Events()
    worker.link.use(_Client())
    names = [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]
    for i, name in enumerate(names):
        worker.layers.virtual[name] = (i,)
        worker.layers.save_layers.add(name)
    worker.layers.num_virtual = num_layers
    scheduler = SchedulerSide(ConnectorConfig(), namespaces=[1], block_size=16)
    scheduler.link.use(_Client())
    request = SimpleNamespace(request_id="r", num_tokens=1256, block_hashes=[b"h" * 32] * 78)
    state = scheduler.requests["r"] = RequestState(request)
    state.block_ids, state.num_saved_blocks = [list(range(79))], 78  # one KV cache group
    return worker, scheduler, names


def _step_us(worker, scheduler, names, steps: int) -> float:
    cached = SimpleNamespace(req_ids=["r"], new_block_ids=[None], resumed_req_ids=set(),
                             num_computed_tokens=[1250])
    out = SimpleNamespace(preempted_req_ids=set(), num_scheduled_tokens={"r": 1},
                          scheduled_new_reqs=[], scheduled_cached_reqs=cached)
    connector_output = SimpleNamespace(finished_sending=None, finished_recving=None,
                                       invalid_block_ids=set())
    started = time.perf_counter()
    for _ in range(steps):
        meta = scheduler.build_connector_meta(out)
        worker.bind(meta if meta is not None else PegaConnectorMetadata())
        worker.start_load_kv()
        for name in names:
            worker.wait_for_layer_load(name)
            worker.save_kv_layer(name)
        worker.wait_for_save()
        worker.get_finished(set())
        scheduler.update_connector_output(connector_output)
    return (time.perf_counter() - started) / steps * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--steps", type=int, default=20000)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    worker, scheduler, names = _pegaflow(args.layers)
    noop = _Noop()
    _step_us(worker, scheduler, names, 1000)  # warm-up
    pegaflow_us = _step_us(worker, scheduler, names, args.steps)
    noop_us = _step_us(noop, noop, names, args.steps)
    result = {"layers": args.layers, "steps": args.steps, "pegaflow_step_us": pegaflow_us,
              "noop_step_us": noop_us}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{'hooks of one decode step':<28}{'us':>8}")
    print(f"{'pegaflow':<28}{pegaflow_us:>8.1f}")
    print(f"{'doing nothing':<28}{noop_us:>8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
