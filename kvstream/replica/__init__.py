"""Router replica (DESIGN.md §6, §7, §9): folds ``kvstream.events`` into a Router,
snapshots the fold to RocksDB, restarts from it, shares load, serves HTTP.

- The fold, with no Kafka and no clock: ``fold`` (the deterministic fold of the log),
  ``record`` (a Kafka message read as the fold sees it), ``authority`` (what the fold
  accepts from the topic), ``admission`` (which workers may win a route).
- The Kafka side, behind the ``replica`` facade (``Replica``): ``recovery`` (start from
  the newest valid snapshot), ``ingest`` (the events topic folded under the router
  lock, its outbox produced after), ``lag`` (readiness, staleness, new partitions),
  ``load`` (load ops shared on ``kvstream.active``, with ``active_codec``), ``resync``
  (requests on ``kvstream.control``), ``dlq`` (copies for ``kvstream.dlq``), ``ticks``
  (log-clock ticks), ``positions`` (read positions in a consumer group),
  ``registry`` (the fold of ``kvstream.workers``: who is registered) with
  ``registry_reader`` (its thread), ``supervisor`` (threads restarted, failures counted).
- Persistence: ``snapshot`` (RocksDB generations), ``snapshotter`` (taken a partition
  at a time without stalling ingest), ``peer`` (bootstrap from a peer's snapshot),
  ``snapshot_cli`` (``kvstream snapshot``).
- Serving: ``service`` (the HTTP API), ``route_body`` (route request fields),
  ``loop_lock`` (the router lock as the event loop takes it),
  ``request_ids``, ``auth`` (bearer tokens by scope), ``http_limits``, ``metrics``.
- ``options`` (the ``[replica]`` settings' definitions), ``cli`` (the settings as the
  parts' options, and the HTTP server, for ``kvstream router``: kvstream.serve, which
  adds the gateway), ``errors``.
"""
