"""Trace-driven fleet simulation (``kvstream simulate``, DESIGN.md §11): simulated engines
with the real tiered pool, offload and consolidator, their events through an event log
(in memory or Kafka) folded into this project's Router, and routing policies compared
on the same cost model."""
