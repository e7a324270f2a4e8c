"""Worker side (DESIGN.md §3, §8): what a worker's caches do, turned into router events.

``source_events`` is the seam: the tiered pool and engine bridges report per-tier
``Source*`` events; the consolidator merges them into router events; the publisher puts
those on Kafka. Nothing here knows about the router.

- Caches: ``pool`` (the tiered block pool G1/G2/G3), ``layout`` (block layout and
  storage), ``offload`` (write-through G1 → G2 → G3), ``onboard`` (a cached prefix back
  into G1), ``lifecycle`` (a request's life on the pool), ``synthetic`` (an engine with
  no model) and ``node`` (a whole synthetic worker).
- Engine bridging: ``engine_events`` (engine KV events → source events, pure),
  ``zmq_bridge`` (the engines' sockets, sequence numbers and replay), ``engine_node``
  (every DP rank of one engine under one epoch), ``bridge_state`` (its RocksDB state).
- To Kafka: ``consolidator`` (per-source events → router events), ``batcher`` (ids,
  merging, batches: the pure half of the publisher), ``publisher`` (epochs, the
  producer, resyncs from ``kvstream.control``).
- Identity: ``announce`` (registration on ``kvstream.workers``), ``incarnation`` (is the
  id already live?), ``fence`` (a worker taken over stops).
- ``options`` (the ``[worker]`` settings' definitions), ``cli`` (``kvstream worker``),
  ``metrics``, ``errors``.
"""
