"""The OpenAI-compatible gateway of a router replica (issue 22): it tokenizes each
request, routes it with the replica's index, relays it byte for byte to the chosen
worker, and keeps the request's life (load added, prefill done, freed) for the fleet.

The whole package sits on the replica's facade; nothing below imports it but the
settings, which derive ``[gateway]`` from ``options`` (whose errors are ``errors``).
``seams`` (the Protocols of the request path and the endpoint record), ``static`` (the
worker directories: ``[[gateway.workers]]``, the registered workers of the replica's
registry, and the fleet's join of both), ``options`` (the ``[gateway]`` settings'
definitions), ``errors`` (and their OpenAI form), ``tokenize`` with ``chat_template`` and
``prefix_cache`` (prompt ids as the engine computes them), ``prompts`` (given ids, a
local tokenizer or an engine's ``/tokenize``), ``health`` (a breaker per worker),
``upstream`` (a keep-alive HTTP/1.1 client on asyncio Protocols and httptools),
``request_body`` (the fields routing reads), ``metrics``; the request path: ``app`` (the
endpoints, mounted on the replica's HTTP app), ``relay`` (one request carried to a
worker and its answer back), ``lifecycle`` (its load in the fleet).
"""
