"""Which of the KV layers vLLM registers belong to a speculative-decoding drafter (EAGLE,
EAGLE3, MTP, a draft model) rather than to the target model.

vLLM hands the connector every attention layer, the drafter's included, under target-like
names (``model.layers.<N_target + i>...``; a draft model's under ``draft_model.``), in the
target's block tables.  The connector stores and serves the target's layers only: the
step's SAVE is submitted after the target's forward, before the drafter writes its layers
(vLLM 0.26's V1 runner and later), so a SAVE waiting for those would be dropped every
step.  The drafter's KV of a served prefix is then not what the drafter would have
computed: its proposals there may be accepted less often; the outputs stay the target's,
exactly (every proposed token is verified by the target).
"""

from __future__ import annotations

import re

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def drafter_layers(vllm_config, names) -> set[str]:
    """The names among ``names`` that are the drafter's (empty without speculative decoding)."""
    if getattr(vllm_config, "speculative_config", None) is None:
        return set()
    context = getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", None) or {}
    num_target = _num_target_layers(vllm_config)
    found = set()
    for name in names:
        layer = context.get(name)
        if getattr(layer, "is_draft_layer", False) or name.startswith("draft_model."):
            found.add(name)  # vLLM 0.33 marks its drafter's layers; a draft model has its prefix
            continue
        match = _LAYER_INDEX.search(name)
        if num_target is not None and match is not None and int(match.group(1)) >= num_target:
            found.add(name)  # EAGLE/MTP layers are numbered after the target's
    return found


def _num_target_layers(vllm_config) -> int | None:
    text_config = getattr(getattr(vllm_config, "model_config", None), "hf_text_config", None)
    value = getattr(text_config, "num_hidden_layers", None)
    return int(value) if isinstance(value, int) else None
