"""``kvstream emulate``: an emulated vLLM engine (docs/EMULATOR.md). It answers vLLM's
OpenAI-compatible API, schedules as vLLM v1 does (continuous batching, chunked prefill, a
paged prefix cache), sleeps the time of the shared cost model (kvstream.engine_model) and
publishes vLLM 0.33's KV events. Output tokens are placeholders."""
