"""One vLLM process for the end-to-end tests: run prompt batches, record greedy tokens,
top-5 logprobs and the prompt tokens vLLM did not compute, and the connector's hit counter.

    python tests/e2e/run_vllm.py --model DIR --prompts prompts.json --out out.json \
        [--engine-name NAME] [--no-prefix-caching] [--extra '{"load_mode":"async"}'] [--graphs] \
        [--llm-kwargs '{"speculative_config": {...}}']

``prompts.json`` is {"batches": [[[tok, ...], ...], ...]}: each batch is one generate()
call (one prompt a batch runs them one at a time; several run together).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

# pegaflow's log lines at INFO beside vLLM's, in every vLLM process (the engine core too):
# what the connector decided (a model it cannot serve, a failed load) is in the test output.
LOGGING = {"version": 1, "disable_existing_loggers": False,
           "formatters": {"plain": {"format": "%(levelname)s %(asctime)s [%(name)s] %(message)s"}},
           "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "plain",
                                   "level": "INFO", "stream": "ext://sys.stderr"}},
           "loggers": {"vllm": {"handlers": ["stderr"], "level": "INFO", "propagate": False},
                       "pegaflow": {"handlers": ["stderr"], "level": "INFO", "propagate": False},
                       # the fields its namespace is made of (a process that finds nothing another
                       # saved: which field differs)
                       "pegaflow.connector.connector": {"level": "DEBUG"}}}


def _record(output) -> dict:
    completion = output.outputs[0]
    logprobs = [{str(tok): lp.logprob for tok, lp in step.items()} for step in (completion.logprobs or [])]
    # vLLM's per-request count of prompt tokens it did not compute (its own prefix cache and
    # the connector's hits): unlike the external-hit counter, never lost (vLLM 0.26's
    # offline engine drops the scheduler stats of steps that return no request output).
    return {"tokens": list(completion.token_ids), "logprobs": logprobs,
            "cached_tokens": int(output.num_cached_tokens or 0)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--engine-name", default="")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--extra", default="{}")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--graphs", action="store_true", help="vLLM's default compilation (CUDA graphs on)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.35)
    p.add_argument("--llm-kwargs", default="{}", help="more LLM(...) arguments, e.g. a speculative_config")
    args = p.parse_args()
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(LOGGING, f)
    os.environ.setdefault("VLLM_LOGGING_CONFIG_PATH", f.name)
    from vllm import LLM, SamplingParams, TokensPrompt

    from pegaflow.connector import kv_transfer_config
    kwargs = dict(model=args.model, load_format="dummy", skip_tokenizer_init=True, enforce_eager=not args.graphs,
                  seed=0, max_model_len=8192, gpu_memory_utilization=args.gpu_memory_utilization,
                  disable_log_stats=False,
                  enable_prefix_caching=not args.no_prefix_caching,
                  max_num_batched_tokens=args.max_num_batched_tokens, enable_chunked_prefill=True)
    kwargs.update(json.loads(args.llm_kwargs))
    if args.engine_name:
        kwargs["kv_transfer_config"] = kv_transfer_config(args.engine_name, **json.loads(args.extra))
    llm = LLM(**kwargs)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, logprobs=5, ignore_eos=True,
                            detokenize=False)
    batches = json.loads(open(args.prompts).read())["batches"]
    results = []
    for batch in batches:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)
        results.append([_record(o) for o in outs])
    metrics = llm.get_metrics()
    hits = sum(float(getattr(m, "value", 0)) for m in metrics if m.name == "vllm:external_prefix_cache_hits")
    # the connector's own counters (lookups, hits, loads, saves), where vLLM exports them
    connector = {m.name: float(m.value) for m in metrics
                 if "pegaflow" in m.name and isinstance(getattr(m, "value", None), (int, float))}
    scheduler_config = llm.llm_engine.vllm_config.scheduler_config
    with open(args.out, "w") as f:
        json.dump({"batches": results, "external_hit_tokens": hits, "connector_metrics": connector,
                   "hybrid_manager_on": not scheduler_config.disable_hybrid_kv_cache_manager,
                   "cached_tokens": sum(r["cached_tokens"] for batch in results for r in batch)}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
