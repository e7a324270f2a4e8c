"""Operator and developer tools: hash, demo, replay, simulate, fleet, and the entry to the
benchmark harness (``bench_cmd``: the harness itself is ``bench/`` of a checkout)."""
