"""One long-lived vLLM process for the end-to-end fleet tests, driven over stdin/stdout.

    python tests/e2e/vllm_session.py --model DIR [--engine-name NAME] [--eager] [--llm-kwargs JSON]

Reads one JSON command a line and answers each with one JSON line:

    {"op": "generate", "prompts": [[tok, ...], ...], "max_tokens": 8}
        -> {"results": [{"tokens": [...], "logprobs": [...], "cached_tokens": N}, ...],
            "external_hit_tokens": <vLLM's counter, cumulative>}
        (the prompts run one at a time, as a user sends them one after another)
    {"op": "reset_prefix_cache"} -> {"ok": true}
    {"op": "exit"}               -> {"ok": true}, then the process exits

"ready" is printed first, once vLLM is up.  vLLM's own logging goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _record(output) -> dict:
    completion = output.outputs[0]
    logprobs = [{str(tok): lp.logprob for tok, lp in step.items()} for step in (completion.logprobs or [])]
    # The prompt tokens vLLM did not compute (its prefix cache and the connector's hits): a
    # per-request count, where vLLM 0.26's offline external-hit counter loses the stats of
    # steps that return no request output.
    return {"tokens": list(completion.token_ids), "logprobs": logprobs,
            "cached_tokens": int(output.num_cached_tokens or 0)}


def _hits(llm) -> float:
    return sum(float(getattr(m, "value", 0)) for m in llm.get_metrics()
               if m.name == "vllm:external_prefix_cache_hits")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--engine-name", default="")
    p.add_argument("--eager", action="store_true", help="enforce_eager (default: CUDA graphs)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.25)
    p.add_argument("--log-file", help="pegaflow's own log, at DEBUG, goes here")
    p.add_argument("--llm-kwargs", default="{}", help="more LLM(...) arguments, e.g. a block_size")
    args = p.parse_args()
    if args.log_file:
        import logging
        handler = logging.FileHandler(args.log_file)
        handler.setFormatter(logging.Formatter("%(asctime)s %(process)d %(name)s %(levelname)s %(message)s"))
        logging.getLogger("pegaflow").addHandler(handler)
        logging.getLogger("pegaflow").setLevel(logging.DEBUG)
    # Only our answers on the real stdout: file descriptor 1 becomes stderr for everything
    # else, vLLM's child processes and its native code included.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    from vllm import LLM, SamplingParams, TokensPrompt

    from pegaflow.connector import kv_transfer_config
    kwargs = dict(model=args.model, load_format="dummy", skip_tokenizer_init=True,
                  enforce_eager=args.eager, seed=0, max_model_len=8192,
                  gpu_memory_utilization=args.gpu_memory_utilization, disable_log_stats=False)
    kwargs.update(json.loads(args.llm_kwargs))
    if args.engine_name:
        kwargs["kv_transfer_config"] = kv_transfer_config(args.engine_name)
    llm = LLM(**kwargs)
    mode = llm.llm_engine.vllm_config.compilation_config.cudagraph_mode
    print(json.dumps({"ready": True, "cudagraph_mode": getattr(mode, "name", str(mode))}),
          file=out, flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "generate":
            params = SamplingParams(max_tokens=command.get("max_tokens", 8), temperature=0.0,
                                    logprobs=5, ignore_eos=True, detokenize=False)
            results = [_record(llm.generate([TokensPrompt(prompt_token_ids=prompt)], params,
                                            use_tqdm=False)[0])
                       for prompt in command["prompts"]]
            answer = {"results": results, "external_hit_tokens": _hits(llm)}
        elif command["op"] == "reset_prefix_cache":
            answer = {"ok": bool(llm.reset_prefix_cache())}
        else:
            print(json.dumps({"ok": True}), file=out, flush=True)
            return 0
        print(json.dumps(answer), file=out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
