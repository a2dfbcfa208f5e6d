"""What the decode benches share (``bench_decode``, ``profile_decode``): the three kinds of vLLM
they compare (no connector, pegaflow idle: no save, no load, pegaflow saving), that vLLM for a
phase, and seeded random prompts."""

from __future__ import annotations

import random

KINDS = ("none", "idle", "saving")


def random_prompts(seed: int, count: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(length)] for _ in range(count)]


def decode_llm(args):
    from vllm import LLM

    from pegaflow.connector import kv_transfer_config
    longest = max(args.contexts)
    common = dict(model=args.model, load_format="dummy", skip_tokenizer_init=True, seed=0,
                  enforce_eager=args.mode == "eager", max_model_len=longest + args.decode_tokens + 64,
                  gpu_memory_utilization=args.gpu_memory_utilization, disable_log_stats=False)
    if args.phase == "idle":
        common["kv_transfer_config"] = kv_transfer_config(args.engine_name, enable_save=False,
                                                          enable_load=False)
    elif args.phase == "saving":
        common["kv_transfer_config"] = kv_transfer_config(args.engine_name)
    return LLM(**common)
