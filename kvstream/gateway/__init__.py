"""The OpenAI-compatible gateway of a router replica (issue 22): it tokenizes each
request, routes it with the replica's index, relays it byte for byte to the chosen
worker, and keeps the request's life (load added, prefill done, freed) for the fleet.

Below the replica (workers and replicas import these): ``registry`` (registrations on
``kvstream.workers`` folded into the worker directory), ``seams`` (the Protocols of the
request path), ``static`` (``[[gateway.workers]]``, and the fleet's directory),
``options`` (the ``[gateway]`` settings' definitions), ``errors`` (and their OpenAI
form), ``tokenize`` with ``chat_template`` and ``prefix_cache`` (prompt ids as the
engine computes them), ``prompts`` (given ids, a local tokenizer or an engine's
``/tokenize``), ``health`` (a breaker per worker), ``upstream`` (a keep-alive HTTP/1.1
client on asyncio Protocols and httptools), ``request_body`` (the fields routing reads),
``metrics``.

The request path, on the replica's facade: ``app`` (the endpoints, mounted on the
replica's HTTP app), ``relay`` (one request carried to a worker and its answer back),
``lifecycle`` (its load in the fleet).
"""
