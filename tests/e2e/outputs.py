"""Comparing vLLM outputs: greedy tokens must match exactly, top-5 logprobs are compared."""

from __future__ import annotations


def max_logprob_diff(a: list, b: list) -> float:
    """The largest |logprob difference| between two runs' outputs (tokens must be equal)."""
    worst = 0.0
    assert len(a) == len(b), "a different number of outputs"
    for x, y in zip(a, b):
        assert x["tokens"] == y["tokens"], "greedy tokens differ"
        assert len(x["logprobs"]) == len(y["logprobs"]), "a different number of logprob steps"
        for sx, sy in zip(x["logprobs"], y["logprobs"]):
            assert sx.keys() == sy.keys(), "top-5 token sets differ"
            worst = max(worst, max(abs(sx[k] - sy[k]) for k in sx))
    return worst
