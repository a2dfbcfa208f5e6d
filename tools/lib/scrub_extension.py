"""What a bench asks of a ``vllm serve``'s GPU workers over HTTP (``POST /collective_rpc``, with
``VLLM_SERVER_DEV_MODE=1``), mixed into vLLM's worker class by
``--worker-extension-cls tools.lib.scrub_extension.BenchWorker`` (``tools/lib/served_ttft.py``):

- ``bench_scrub_kv_cache(value)``: every KV cache tensor of the worker overwritten with ``value``
  (``tools/lib/warm_pass.py``'s scrub, as bench_ttft does it through the offline ``LLM``); the bytes;
- ``bench_cudagraph_mode()``: the CUDA graph mode vLLM runs under (a connector may make it
  piecewise only; first-token logprobs are compared only between servers of one mode).

The HTTP route passes only strings, and answers each worker's result (a number as a string).
Nothing of this repo's ``pegaflow`` is imported: a pegaflow-rs vLLM has PegaFlow's package of that
name first on its path (``tools/lib/peers.py``).
"""

from __future__ import annotations

from tools.lib.warm_pass import SCRUB_VALUE, fill_kv


class BenchWorker:
    """Methods vLLM adds to its worker (``self`` is the worker); their names are vLLM's nowhere."""

    def bench_scrub_kv_cache(self, value: str = str(SCRUB_VALUE)) -> int:
        return fill_kv(self, float(value))

    def bench_cudagraph_mode(self) -> str:
        return str(self.vllm_config.compilation_config.cudagraph_mode)


SERVE_ARGS = ("--worker-extension-cls", f"{__name__}.{BenchWorker.__name__}")
