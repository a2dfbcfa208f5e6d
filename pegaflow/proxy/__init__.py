"""``pegaflow-proxy``: the front of prefill/decode disaggregation (docs/disaggregation.md).

An OpenAI-compatible server (``/v1/completions``, ``/v1/chat/completions``, streaming or
not, ``/v1/models``, ``/health``, ``/metrics``) that sends each request first to a prefill
vLLM (``kv_role`` ``kv_producer``) with ``max_tokens=1``, which computes the prompt and
saves its KV to the pegaflow engine, then the request as it came to a decode vLLM
(``kv_consumer``), which loads the prompt's blocks from the engine and generates; its
answer goes back to the caller byte for byte.  Servers of each kind are chosen
round-robin.  A prefill server that fails (refused, an error status, past its timeout)
costs no request: the decode server computes the prompt itself (counted).

    routing.py   which server next, and the prefill copy of a request
    app.py       the aiohttp application: handlers, forwarding, metrics
    cli.py       the console script
"""
