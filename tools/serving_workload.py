"""The workloads of ``tools/bench_serving.py`` and the summary of their results (no GPU, no
server: unit-tested in CI).

- ``Conversation``: one user of a multi-round chat.  Round 0's prompt is a long context and a
  question; every later round's prompt is the whole history (each earlier prompt and the
  answer the server gave) plus a new question, so all but the question and the last answer
  is a prefix the server has seen.
- ``shared_prefix_prompts``: many requests over a few long system prompts, each with its own
  short suffix (what ``vllm bench serve``'s prefix datasets generate).
- ``summarize``: percentiles of TTFT and TPOT, throughput and wall time of a set of results.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

VOCAB_LOW, VOCAB_HIGH = 10, 30000  # token ids every model shape in tools/models/ knows


def _tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(count)]


@dataclass
class Conversation:
    user: int
    context_tokens: int
    question_tokens: int
    seed: int
    history: list[int] = field(default_factory=list)
    rounds_done: int = 0

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed * 1_000_003 + self.user)
        self.history = _tokens(self._rng, self.context_tokens)

    def next_prompt(self) -> list[int]:
        """This round's prompt: the history so far and a new question."""
        return self.history + _tokens(self._rng, self.question_tokens)

    def record(self, prompt: list[int], answer: list[int]) -> None:
        """The round is over: its prompt and the server's answer become the history."""
        if prompt[:len(self.history)] != self.history:
            raise ValueError("a round's prompt must extend the conversation's history")
        self.history = list(prompt) + list(answer)
        self.rounds_done += 1


def conversations(users: int, context_tokens: int, question_tokens: int, seed: int = 0) -> list[Conversation]:
    return [Conversation(u, context_tokens, question_tokens, seed) for u in range(users)]


def cacheable_tokens(prompt_len: int, computed_len: int, block_size: int) -> int:
    """Tokens of a prompt a complete cache serves: the full blocks of the part some replica
    has computed (``computed_len`` tokens of history), never the block holding the prompt's
    last token (vLLM computes at least one token)."""
    return min(computed_len, prompt_len - 1) // block_size * block_size


def later_rounds_cacheable(users: int, context_tokens: int, question_tokens: int, seed: int,
                           answers: list[list[list[int]]], block_size: int = 16) -> int:
    """The prompt tokens of rounds 2 on that a complete cache serves: per request, the full
    blocks of what the server computed of that conversation before (the previous prompt and
    its answer but the answer's last token, whose KV is never computed), never the block holding
    the prompt's last token.  ``answers[r][u]``: user u's answer in round r, as the server gave
    it (the conversations are rebuilt from the seed, so a run's JSON is enough)."""
    talks = conversations(users, context_tokens, question_tokens, seed)
    computed = [0] * users
    total = 0
    for r, round_answers in enumerate(answers):
        for u, (talk, answer) in enumerate(zip(talks, round_answers)):
            prompt = talk.next_prompt()
            if r:
                total += cacheable_tokens(len(prompt), computed[u], block_size)
            talk.record(prompt, answer)
            computed[u] = len(prompt) + max(0, len(answer) - 1)
    return total


def shared_prefix_prompts(num_prefixes: int, prefix_tokens: int, num_requests: int, suffix_tokens: int,
                          seed: int = 0) -> list[list[int]]:
    """``num_requests`` prompts, request i over system prompt i % num_prefixes."""
    rng = random.Random(seed)
    prefixes = [_tokens(rng, prefix_tokens) for _ in range(num_prefixes)]
    return [prefixes[i % num_prefixes] + _tokens(rng, suffix_tokens) for i in range(num_requests)]


def poisson_offsets(count: int, rate_per_s: float, seed: int = 0) -> list[float]:
    """Arrival times (seconds from the start) of ``count`` requests at ``rate_per_s`` on
    average; ``rate_per_s`` inf: all at once."""
    if math.isinf(rate_per_s):
        return [0.0] * count
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(count):
        out.append(t)
        t += rng.expovariate(rate_per_s)
    return out


@dataclass
class RequestResult:
    key: str                 # which request: "r{round}u{user}" or "p{index}"
    prompt_tokens: int
    tokens: list[int]        # the answer's token ids
    started_s: float         # time.monotonic() when sent
    first_token_s: float     # when the first token arrived
    done_s: float
    error: str = ""
    cached_tokens: int | None = None  # prompt tokens vLLM did not compute (its GPU cache or a connector)

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.started_s

    @property
    def tpot_s(self) -> float | None:
        n = len(self.tokens)
        return (self.done_s - self.first_token_s) / (n - 1) if n > 1 else None


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear between the closest ranks; nan for none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(results: list[RequestResult]) -> dict:
    """TTFT and TPOT percentiles (ms), request throughput and wall time of ``results``."""
    ok = [r for r in results if not r.error]
    ttft = [r.ttft_s * 1e3 for r in ok]
    tpot = [t * 1e3 for r in ok if (t := r.tpot_s) is not None]
    wall = (max(r.done_s for r in ok) - min(r.started_s for r in ok)) if ok else 0.0
    return {"requests": len(results), "errors": len(results) - len(ok), "wall_s": round(wall, 4),
            "throughput_rps": round(len(ok) / wall, 3) if wall > 0 else 0.0,
            "ttft_p50_ms": round(percentile(ttft, 50), 2), "ttft_p90_ms": round(percentile(ttft, 90), 2),
            "ttft_p99_ms": round(percentile(ttft, 99), 2), "tpot_p50_ms": round(percentile(tpot, 50), 3),
            "tpot_p99_ms": round(percentile(tpot, 99), 3)}


def identical_share(results: list[RequestResult], reference: list[RequestResult]) -> float:
    """Share of the requests (matched by key) whose answer equals the reference's."""
    ref = {r.key: r.tokens for r in reference}
    matched = [r for r in results if r.key in ref]
    if not matched:
        return 0.0
    return sum(r.tokens == ref[r.key] for r in matched) / len(matched)
