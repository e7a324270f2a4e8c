"""Worker side (DESIGN.md §3, §8): what a worker's caches do, turned into router events.

``source_events`` is the seam: the tiered pool and engine bridges report per-tier
``Source*`` events; the consolidator merges them into router events; the publisher puts
those on Kafka. Nothing here knows about the router.
"""
