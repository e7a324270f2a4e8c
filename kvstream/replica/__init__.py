"""Router replica (DESIGN.md §6, §7, §9): folds ``kvstream.events`` into a Router,
snapshots the fold to RocksDB, restarts from it, shares load, serves HTTP.

``fold`` is the deterministic heart (no Kafka); ``replica`` is the facade that wires
Kafka to it (``recovery``, ``ingest``, ``lag``, ``load``, ``registry_reader``);
``snapshot`` persists it; ``service`` serves it.
"""
