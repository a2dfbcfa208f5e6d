"""Every cache of one configuration's replicas emptied, so that the next run of the same prompts
in the same ``vllm serve`` processes starts as a fresh fleet would (``bench_peers``'s repeats).

How each configuration's cache is emptied (``HOW``, kept in each run's record):

- every configuration: vLLM's GPU prefix cache, ``POST /reset_prefix_cache`` on each replica,
  retried while a connector's saves still hold blocks (``tools/lib/vllm_serve.py``);
- ``native``: the same call with ``?reset_external=true``: vLLM then calls its
  ``OffloadingConnector``'s ``reset_cache``, which drops every block of its CPU cache;
- ``pegaflow``: once the GPU prefix caches are reset (so no save of the last run is still out),
  ``?reset_external=true`` on each replica: its connector's ``reset_cache`` has the engine drop
  every block of the model's namespace, which every replica of the model shares (a RESET,
  ``engine/commands/reset.py``).  Only where a replica answers that it failed (the engine
  unreachable or refusing) is the engine stopped and a fresh one started under its name, its
  whole pool pinned (``Sides.restart_engine``); each replica's connector then finds the new
  engine at its next call and registers again (``pegaflow/connector/link.py``);
- ``lmcache-mp``: ``POST /cache/clear`` to the ``lmcache server`` (its L1, every object);
- ``pegaflow-rs``: ``POST /cache/memory/cleanup`` to ``pegaflow-server`` (every resident block
  evicted), asked again for a while if it says some stay referenced (the answer is kept, and a
  line says so).

``lmcache`` (in vLLM's process) has no such call: its cache goes only with the process, so only
the GPU prefix caches are reset, and a bench must not repeat a workload in one fleet for it
(``can_empty``).  Afterwards each replica is sent one short
request (a readiness check's; its prompt new each time), every configuration alike: after an
engine restart it makes pegaflow's connectors attach to the new engine before the next run's
first round.  Whether the
caches were empty shows in the next run itself: its round 0, whose prompts no replica computed
before, must be served nothing from any cache (``round0_hit_tokens``, tools/lib/replica_workloads.py).
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request

from tools.lib import processes
from tools.lib.fleet import Fleet
from tools.lib.replica_workloads import warm_up
from tools.lib.serving_setup import Sides, is_pegaflow
from tools.lib.vllm_serve import reset_connector_cache, reset_gpu_cache

HOW = {"none": "POST /reset_prefix_cache on each replica (vLLM's GPU prefix cache: no host cache)",
       "native": "POST /reset_prefix_cache?reset_external=true on each replica: its GPU prefix cache and "
                 "its OffloadingConnector's CPU cache",
       "pegaflow": "GPU prefix caches reset, then POST /reset_prefix_cache?reset_external=true on each "
                   "replica: the engine drops every block of the model's namespace (RESET)",
       "lmcache-mp": "GPU prefix caches reset, then POST /cache/clear to the lmcache server (its L1)",
       "pegaflow-rs": "GPU prefix caches reset, then POST /cache/memory/cleanup to pegaflow-server"}
RESTARTED = ("GPU prefix caches reset; a replica's reset_external failed, so the engine was stopped and a fresh "
             "one started under its name, its pool pinned whole; the replicas reconnect")
NOT_EMPTIED = "GPU prefix caches reset only: this cache lives in vLLM's process, with no call that empties it"
CLEAR_TIMEOUT_S = 60.0
CLEAR_RETRY_S, CLEAR_POLL_S = 10.0, 0.5


def can_empty(config: str) -> bool:
    return config in HOW or is_pegaflow(config)


def how(config: str) -> str:
    return HOW.get(config) or HOW["pegaflow"]  # pegaflow's variants: its engine under other flags


def empty_caches(config: str, fleet: Fleet, sides: Sides, seed: int, empty_engine: bool = True) -> dict:
    """Every cache of ``config``'s replicas emptied (only the GPU's where ``can_empty`` is False),
    then one short request to each; what was done, how long it took and what the server answered
    (``seed``: the short requests' prompts).  ``empty_engine`` False: pegaflow's engine keeps
    its blocks (the record says so)."""
    started = time.monotonic()
    replicas = range(fleet.args.replicas)
    out = {"how": how(config) if can_empty(config) else NOT_EMPTIED,
           "gpu_reset_wait_s": round(sum(reset_gpu_cache(fleet.port(r), external=config == "native")
                                         for r in replicas), 3)}
    if sides.restart_engine is not None and not empty_engine:
        out["how"] = "GPU prefix caches reset; the engine kept its blocks"
    elif sides.restart_engine is not None:
        out |= _empty_engine(config, fleet, sides)
    elif sides.plan is not None and sides.plan.clear_url:
        out["server_answer"] = _clear(sides.plan.clear_url)
    out["warmup_s"] = [warm_up(fleet.port(r), 1, seed + r)[0] for r in replicas]
    out["seconds"] = round(time.monotonic() - started, 2)
    return out


def _empty_engine(config: str, fleet: Fleet, sides: Sides) -> dict:
    """pegaflow's engine emptied through the replicas (``reset_external``), or restarted where a
    replica says that failed: what each replica answered, and the restart's seconds if it came."""
    started = time.monotonic()
    answers = [reset_connector_cache(fleet.port(r)) for r in range(fleet.args.replicas)]
    out = {"engine_reset": answers, "engine_reset_s": round(time.monotonic() - started, 3)}
    if not all(answers):
        print(f"cache_reset: {config}: reset_external failed on replicas "
              f"{[r for r, ok in enumerate(answers) if not ok]}: restarting the engine", file=sys.stderr, flush=True)
        with processes.phase(None, f"{config} engine restart (its reset failed)"):
            out["engine_restart_s"] = round(sides.restart_engine(), 2)
        out["how"] = RESTARTED
    return out


def _clear(url: str) -> dict:
    """The server's answer to its "drop every block" call, asked again (within ``CLEAR_RETRY_S``)
    while it says blocks stay referenced (leases of requests just finished); its last answer."""
    deadline, tries = time.monotonic() + CLEAR_RETRY_S, 0
    while True:
        tries += 1
        request = urllib.request.Request(url, data=b"{}", method="POST", headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=CLEAR_TIMEOUT_S) as response:
            answer = json.loads(response.read() or b"{}")
        if not answer.get("still_referenced_blocks") or time.monotonic() >= deadline:
            break
        time.sleep(CLEAR_POLL_S)
    if answer.get("still_referenced_blocks"):  # the next run's round 0 shows whether they were hit
        print(f"cache_reset: {url} still holds {answer['still_referenced_blocks']} referenced blocks "
              f"after {tries} tries", file=sys.stderr, flush=True)
    return answer | {"tries": tries}
