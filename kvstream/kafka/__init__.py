"""Kafka: client settings, topics, metadata and watermarks, a producer that counts
failures instead of raising, and the local development broker (DESIGN.md §2, §10)."""
