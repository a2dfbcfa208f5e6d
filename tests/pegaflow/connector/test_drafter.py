from types import SimpleNamespace

from pegaflow.connector.drafter import drafter_layers

TARGET = [f"model.layers.{i}.self_attn.attn" for i in range(4)]


def _config(speculative: bool = True, num_layers: int = 4, context: dict | None = None):
    return SimpleNamespace(
        speculative_config=SimpleNamespace(method="eagle") if speculative else None,
        model_config=SimpleNamespace(hf_text_config=SimpleNamespace(num_hidden_layers=num_layers)),
        compilation_config=SimpleNamespace(static_forward_context=context or {}))


def test_drafter_layers_numbered_after_the_target_are_the_drafters():
    # EAGLE / MTP: the drafter's layers follow the target's 4 (vLLM 0.26 marks nothing else).
    names = TARGET + ["model.layers.4.self_attn.attn", "model.layers.5.self_attn.attn"]
    assert drafter_layers(_config(), names) == set(names[4:])


def test_drafter_layers_marked_or_prefixed_are_the_drafters():
    # vLLM 0.33 marks its drafter's layers; a draft model's layers carry its prefix.
    marked = {"model.layers.1.self_attn.attn": SimpleNamespace(is_draft_layer=True)}
    names = TARGET + ["draft_model.model.layers.0.self_attn.attn"]
    assert drafter_layers(_config(context=marked), names) == {
        "model.layers.1.self_attn.attn", "draft_model.model.layers.0.self_attn.attn"}


def test_drafter_layers_none_without_speculative_decoding():
    names = TARGET + ["model.layers.7.self_attn.attn"]
    assert drafter_layers(_config(speculative=False), names) == set()
