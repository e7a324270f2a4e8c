"""Router replica (DESIGN.md §6, §7, §9): folds ``kvstream.events`` into a Router,
snapshots the fold to RocksDB, restarts from it, shares load, serves HTTP.

``fold`` is the deterministic heart (no Kafka); ``consumer`` wires Kafka to it;
``snapshot`` persists it; ``service`` serves it.
"""
