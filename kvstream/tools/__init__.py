"""Operator and developer tools: hash, bench, demo, replay, simulate."""
