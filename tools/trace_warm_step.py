"""Where a warm step's time goes: one in-process vLLM with pegaflow, cold then warm, with
the worker's step timeline (``pegaflow.connector.trace``) and the engine's LOAD timing on.

    python -m tools.trace_warm_step [--load-mode layerwise|async] [--copy-backend auto|kernel|copy-engine|staged]
                                    [--no-async-scheduling] [--eager] [--gpu-hit] [--engine-arg=--FLAG ...]

Prints, per request, the wall time and vLLM's scheduled -> first token (with both
timestamps on time.monotonic, the clock of the timeline's stamp where the step's loads went
out: their difference is the part of the step before the load could start); the timeline
lines (one per loading step, logged when the next one ends) go to stderr with the rest of
the logs.  ``--gpu-hit``: the same prompts without pegaflow, vLLM's prefix cache on, so the
warm passes are GPU prefix-cache hits (the floor a warm load is measured against).  vLLM's
default compilation (CUDA graphs) unless ``--eager``.  Needs a GPU and vLLM.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the worker logs to our stderr


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "tools/models/llama-3.1-8b-shape"))
    p.add_argument("--load-mode", default="layerwise", choices=["layerwise", "async"])
    p.add_argument("--copy-backend", default="auto", choices=["auto", "kernel", "copy-engine", "staged"])
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=10000)
    p.add_argument("--no-async-scheduling", action="store_true")
    p.add_argument("--eager", action="store_true", help="enforce_eager (default: CUDA graphs)")
    p.add_argument("--gpu-hit", action="store_true", help="no pegaflow, vLLM's prefix cache on")
    p.add_argument("--engine-arg", action="append", default=[], metavar="FLAG",
                   help="a flag for pegaflow's engine, e.g. --engine-arg=--load-layer-groups=4 (repeatable)")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("pegaflow.connector.trace").setLevel(logging.DEBUG)

    from vllm import LLM, SamplingParams, TokensPrompt

    from pegaflow.connector import kv_transfer_config
    from tools.engine_process import EngineProcess
    engine = None if args.gpu_hit else EngineProcess(
        f"trace{os.getpid()}", "--copy-backend", args.copy_backend, "--log-level", "DEBUG", *args.engine_arg,
        backend="cuda", pool_size="8GiB", start_timeout_s=300)
    try:
        connector = {} if engine is None else {
            "enable_prefix_caching": False,
            "kv_transfer_config": kv_transfer_config(engine.name, load_mode=args.load_mode)}
        llm = LLM(model=args.model, load_format="dummy", skip_tokenizer_init=True,
                  enforce_eager=args.eager, seed=0, max_model_len=args.prompt_tokens + 400,
                  gpu_memory_utilization=0.8, disable_log_stats=False, **connector,
                  **({"async_scheduling": False} if args.no_async_scheduling else {}))
        rng = random.Random(1)
        prompts = [[rng.randrange(10, 100000) for _ in range(args.prompt_tokens)]
                   for _ in range(args.num_prompts)]
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        llm.generate([TokensPrompt(prompt_token_ids=prompts[0][:512])], params, use_tqdm=False)
        for label in ("cold", "warm", "warm again"):
            for prompt in prompts:
                t0 = time.perf_counter()
                out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
                wall, m = (time.perf_counter() - t0) * 1e3, out[0].metrics
                print(f"{label:<10} wall {wall:6.1f} ms   scheduled -> first token "
                      f"{(m.first_token_ts - m.scheduled_ts) * 1e3:6.1f} ms   (monotonic: "
                      f"scheduled {m.scheduled_ts:.6f}, first token {m.first_token_ts:.6f})",
                      flush=True)
            time.sleep(0.5)  # saves land before the next pass
    finally:
        if engine is not None:
            engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
