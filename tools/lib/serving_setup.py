"""What one configuration of a serving bench runs beside its ``vllm serve`` processes, set up
one way for ``bench_serving``, ``bench_replicas`` and ``bench_pd``.

- ``pegaflow_transfer_args(engine_name, role, **options)``: the ``--kv-transfer-config`` that
  attaches a vLLM to pegaflow's engine ``engine_name`` through ``PegaKVConnector``;
- ``side_processes(...)``: a context manager that starts what the configuration needs: a fresh
  pegaflow engine (``PEGAFLOW_CONFIGS``, and the ``--engine-variants``' configurations of
  ``tools/lib/engine_variants.py``), or a peer's plan and its server (``tools/lib/peers.py``);
  it yields a ``Sides`` and stops them on exit, the engine last (a large pool takes its time
  to give its memory back: waited for, not killed); ``Sides.restart_engine`` empties pegaflow's
  cache between two runs in one set of vLLMs (``tools/lib/cache_reset.py``);
- ``vllm_settings(plan)``: a vLLM process's extra arguments, environment and working directory
  for a peer's plan (none of them without one).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tools.lib import engine_variants, peers, processes

# pegaflow's configurations: the connector's options beyond the engine's name
PEGAFLOW_CONFIGS = {"pegaflow": {}, "pegaflow-auto": {"load_mode": "auto"}, "pegaflow-async": {"load_mode": "async"},
                    "pegaflow-layerwise": {"load_mode": "layerwise"}, "pegaflow-hold": {}, "pegaflow-groups4": {},
                    "pegaflow-hold-groups4": {}, "pegaflow-no-compute-once": {"compute_once": False}}
# configurations that are the engine's flags (an A/B of a flag in one run of a bench)
ENGINE_FLAGS = {"pegaflow-hold": ["--hold-saves"], "pegaflow-groups4": ["--load-layer-groups=4"],
                "pegaflow-hold-groups4": ["--hold-saves", "--load-layer-groups=4"],
                "pegaflow-no-compute-once": ["--no-compute-once"]}


def connector_options(config: str) -> dict[str, str] | None:
    """pegaflow's connector options beyond the engine's name for ``config`` (None: not pegaflow)."""
    if engine_variants.variant_of(config) is not None:
        return {}  # a variant of the engine's flags, the connector's defaults
    return PEGAFLOW_CONFIGS.get(config)


def is_pegaflow(config: str) -> bool:
    return connector_options(config) is not None


def engine_flags_of(config: str) -> list[str]:
    """The engine's own flags of a pegaflow configuration (its variant's, or ``ENGINE_FLAGS``')."""
    variant = engine_variants.variant_of(config)
    return engine_variants.engine_flags(variant) if variant is not None else ENGINE_FLAGS.get(config, [])


ENGINE_STATS = ("blocks_saved", "blocks_loaded", "lookup_hit_blocks", "evictions",
                "latency")  # its LOOKUP / LOAD / SAVE latency histograms, receipt to answer


def pegaflow_transfer_args(engine_name: str, role: str = "kv_both", **options: str) -> list[str]:
    """``vllm serve``'s arguments for pegaflow's connector in ``role``, attached to ``engine_name``."""
    extra = {"engine_name": engine_name, **options}
    return ["--kv-transfer-config", json.dumps({
        "kv_connector": "PegaKVConnector", "kv_connector_module_path": "pegaflow.connector",
        "kv_role": role, "kv_connector_extra_config": extra})]


def vllm_settings(plan: peers.Plan | None) -> tuple[list[str] | None, dict[str, str], Path | None]:
    """A vLLM process's extra ``serve`` arguments, added environment and working directory."""
    if plan is None:
        return None, {}, None
    return plan.serve_args(), dict(plan.env), plan.cwd


def peer_leftovers(plan: peers.Plan | None):
    """For a vLLM process of a peer's plan: what its connector makes in /dev/shm that a killed
    vLLM cannot remove, removed after it (``tools/lib/processes.py``); None without a peer."""
    if plan is None:
        return None
    return processes.new_segments_since(processes.shm_snapshot())


@dataclass(frozen=True, slots=True)
class Sides:
    """What a configuration's vLLMs run against: pegaflow's engine ``engine_name`` (where
    ``has_engine``) or a peer's ``plan`` (None: no peer)."""

    engine_name: str
    has_engine: bool
    plan: peers.Plan | None
    # pegaflow's engine stopped and a fresh one started under its name, its pool pinned whole:
    # every block gone (the vLLMs attached reconnect by themselves); its seconds.  None: no engine.
    restart_engine: Callable[[], float] | None = None

    def engine_stats(self) -> dict | None:
        """The engine's block counters now (None without an engine)."""
        if not self.has_engine:
            return None
        from pegaflow.stats.engine_stats import read_stats
        stats = read_stats(self.engine_name)
        return {k: stats[k] for k in ENGINE_STATS}


@contextlib.contextmanager
def side_processes(config: str, engine_name: str, engine_args: list[str], host_gib: int, log_dir: Path,
                   tag: str, *, peer_pool_bytes: int, engine_start_timeout_s: float,
                   num_vllms: int = 1) -> Iterator[Sides]:
    """For ``config``: pegaflow's engine with a ``host_gib`` pool (its log ``<tag>.engine.log``),
    or the peer's plan for ``peer_pool_bytes`` and ``num_vllms`` vLLMs and its server
    (``<tag>.peer.log``), or nothing."""
    from tools import engine_process  # here, not at the top: it imports this repo's pegaflow
    engine, num_starts = None, 0

    def start_engine():
        nonlocal num_starts
        log = log_dir / (f"{tag}.engine.log" if not num_starts else f"{tag}.engine{num_starts}.log")
        num_starts += 1
        with processes.phase(None, f"{tag} engine start"):
            return engine_process.EngineProcess(
                engine_name, *engine_args, *engine_flags_of(config), backend="cuda",
                pool_size=f"{host_gib}GiB", start_timeout_s=engine_start_timeout_s, log_level="INFO",
                stderr_path=log)

    def restart_engine() -> float:
        nonlocal engine
        started = time.monotonic()
        engine.stop(timeout_s=engine_process.LARGE_POOL_STOP_S)
        engine = None
        engine = start_engine()
        engine.wait_pool_pinned()
        return time.monotonic() - started

    if is_pegaflow(config):
        engine = start_engine()
    try:
        plan = peers.plan(config, peer_pool_bytes, num_vllms) if config in peers.PEERS else None
        with contextlib.ExitStack() as server:
            if plan is not None:
                with processes.phase(None, f"{tag} peer server start"):
                    server.enter_context(peers.side_process(plan, log_dir / f"{tag}.peer.log"))
            yield Sides(engine_name, engine is not None, plan, restart_engine if engine is not None else None)
    finally:
        if engine is not None:
            engine.stop(timeout_s=engine_process.LARGE_POOL_STOP_S)
