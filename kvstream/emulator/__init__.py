"""``kvstream emulate``: an emulated vLLM engine (docs/EMULATOR.md). It answers vLLM's
OpenAI-compatible API, schedules as vLLM v1 does (continuous batching, chunked prefill, a
paged prefix cache), sleeps the time of the shared cost model (kvstream.engine_model) and
publishes vLLM 0.33's KV events. Output tokens are placeholders.

``server`` (the HTTP API), ``protocol`` (vLLM's request fields and response shapes),
``tokenizer`` (prompt ids), ``engine`` (the step loop), ``scheduler`` (vLLM v1's
scheduler), ``blocks`` (G1 with vLLM's prefix caching), ``kv_events`` and ``kv_wire``
(the KV events as vLLM's ZMQ publisher sends them), ``metrics`` (vLLM's ``/metrics``
names), ``options``, ``cli``, ``errors``."""
