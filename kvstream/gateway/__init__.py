"""The OpenAI-compatible gateway of a router replica: it tokenizes each request, routes
it with the replica's index, relays it byte for byte to the chosen worker, and keeps the
request's life (load added, prefill done, freed) for the fleet (issue 22)."""
