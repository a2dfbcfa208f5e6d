"""Real vLLM on the CPU, one model family at a time: pegaflow serves each family's prefixes
exactly, and as much of them as vLLM's own prefix cache keeps.

Per family (``config.json`` in tools/models/, random weights: random_weights.py): process R, no connector,
prefix caching on, runs the prompts twice (its second pass is the reference: the same
uncached tails after the same cached prefixes as B; its cached tokens are what vLLM's own
prefix cache serves); process A, with the connector, computes them cold and saves them;
process B, a fresh vLLM with the connector, runs them once: its cached tokens (its own
cache starts empty) are what the engine served.  B's greedy tokens and top-5 logprobs must
equal R's second pass bit for bit, and B must be served at least 95 % of what that pass hit.
Families: a sliding-window model (Gemma-3 shape, 3 windowed layers and 1 full) with vLLM's
hybrid KV cache manager on (two KV cache groups; vLLM's CPU build reports a failed load per
request); a hybrid SSM model (Qwen3-Next shape: 3 Gated-DeltaNet layers, 1 full attention)
under ``mamba_cache_mode`` align, served its attention blocks and the Mamba state at each
hit's last block (pegaflow/connector/mamba_state.py).
"""

from __future__ import annotations

import os
import random

import pytest

import tests.e2e_cpu.cpu_only  # noqa: F401  (skips this module without vLLM's CPU build)
from pegaflow.stats.engine_stats import read_stats
from tests.e2e.outputs import max_logprob_diff
from tests.e2e_cpu.cpu_runs import cached_tokens, flatten, run, start_engine
from tests.e2e_cpu.random_weights import write_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# family -> (model directory in tools/models, more LLM arguments: the reference run gets them too)
FAMILIES = {
    "sliding_window": ("gemma-3-tiny", {}),  # a 128-token window; the hybrid manager on (vLLM's default)
    # 3 Gated-DeltaNet (Mamba-state) layers and 1 full attention: Mamba states at block boundaries
    "hybrid_ssm": ("qwen3-next-tiny", {"mamba_cache_mode": "align"}),
}


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(10, 31000) for _ in range(n)] for n in (700, 1100, 450)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_cpu_models_family_is_served_exactly_and_as_fully_as_vllm_caches_it(family, tmp_path):
    name, more = FAMILIES[family]
    model = write_model(name, tmp_path / name)
    one_by_one = [[p] for p in _prompts()]
    # 1. R: no connector; the prompts twice (the second pass hits vLLM's own prefix cache).
    reference = run(tmp_path, "R", model, one_by_one + one_by_one, **more)
    second = reference["batches"][len(one_by_one):]
    own_cache = sum(r["cached_tokens"] for batch in second for r in batch)
    with start_engine(f"cpum{os.getpid()}_{family}") as engine:
        # 2. A computes them cold and saves them; B, a fresh vLLM, is served them.
        run(tmp_path, "A", model, one_by_one, engine.name, **more)
        served = run(tmp_path, "B", model, one_by_one, engine.name, **more)
        counts = read_stats(engine.name)
    figures = {"served_tokens": cached_tokens(served), "vllm_own_cache_tokens": own_cache,
               "hybrid_manager_on": served["hybrid_manager_on"],
               "engine": {k: counts[k] for k in ("blocks_saved", "lookup_hit_blocks", "blocks_loaded")}}
    print(family, figures)  # (shown by pytest -s)
    # 3. Exact against R's cached pass, with the hybrid manager on...
    assert max_logprob_diff(flatten(served), [r for batch in second for r in batch]) == 0.0, figures
    assert served["hybrid_manager_on"], figures
    # 4. ...and served at least 95 % of what vLLM's own prefix cache keeps.
    assert own_cache > 0 and cached_tokens(served) >= 0.95 * own_cache, figures
