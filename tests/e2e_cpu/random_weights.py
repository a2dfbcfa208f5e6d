"""A tiny model with seeded random weights at the usual initialisation scale, written where
vLLM loads it (safetensors).  vLLM's dummy weights (uniform in +-1e-3) make a model whose
logits barely move: a byte of KV changed by a wrong load can leave every token and top-5
logprob as it was, so an exactness test could not fail.  These weights make it show."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.e2e_cpu.cpu_runs import MODELS


def write_model(name: str, out: Path, seed: int = 0) -> Path:
    """``tools/models/<name>`` (its config.json) with random weights, saved in ``out``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(MODELS / name)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    shutil.copy(MODELS / name / "config.json", out / "config.json")  # vLLM reads the shape as kept
    return out
