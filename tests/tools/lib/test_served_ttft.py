"""tools/lib/served_ttft.py: a served completion's first-token candidates, read as bench_ttft keeps them."""

from tools.lib.served_ttft import top5


def test_top5_token_id_placeholders_best_first_ties_by_id():
    # vLLM without a tokenizer names each candidate "token_id:N" (return_tokens_as_token_ids).
    logprobs = {"top_logprobs": [{"token_id:7": -2.0, "token_id:30": -0.5, "token_id:4": -2.0}, {"token_id:1": 0.0}]}
    assert top5(logprobs) == [[30, -0.5], [4, -2.0], [7, -2.0]]


def test_top5_without_logprobs_is_empty():
    assert top5(None) == [] and top5({"top_logprobs": []}) == []
