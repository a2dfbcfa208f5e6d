"""``pegaflow-proxy``: the front of prefill/decode disaggregation (docs/disaggregation.md).

An OpenAI-compatible server (``/v1/completions``, ``/v1/chat/completions``, streaming or
not, ``/v1/models``, ``/health``, ``/metrics``) that sends each request first to a prefill
vLLM (``kv_role`` ``kv_producer``) with ``max_tokens=1``, which computes the prompt and
saves its KV to the pegaflow engine, then the request as it came to a decode vLLM
(``kv_consumer``), which loads the prompt's blocks from the engine and generates; its
answer goes back to the caller byte for byte.  Servers of each kind are chosen
round-robin.  A prefill server that fails (refused, an error status, past its timeout)
costs no request: the decode server computes the prompt itself (counted); one that keeps
failing is passed over.  Every read and wait is bounded (config.py lists the bounds).

    config.py        the one frozen config: servers, bounds and timeouts with their defaults
    request_body.py  a caller's body read within its bounds, parsed; the refusals (400/408/413/503)
    routing.py       which server next (failing ones passed over), and the prefill copy of a request
    app.py           the aiohttp application: handlers, forwarding, /health
    metrics.py       what it counts, at /metrics
    serve.py         serving it: open-file limit, failed accepts and bad HTTP as one log line
    cli.py           the console script
"""
