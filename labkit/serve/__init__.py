"""Serving: an OpenAI-compatible HTTP server on the engine, and a load generator to measure it.

- protocol.py:    OpenAI request bodies -> SamplingParams, and the errors that name a bad field
- engine_loop.py: the one thread that drives `LLM.step()` and feeds each request's queue
- app.py:         the HTTP routes (Starlette), streaming over server-sent events, the access log
- access.py:      the API key, the Host allow-list and the web origins allowed (CORS)
- metrics.py:     /metrics in Prometheus' text format
- server.py:      `labkit serve`, servers in a thread or a child process, and the connection limits
- loadgen.py:     Poisson arrivals, TTFT/TPOT percentiles and throughput per request rate

Needs the `serve` extra: `pip install 'labkit[serve]'` (starlette, uvicorn, prometheus-client).
"""
