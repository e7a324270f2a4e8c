"""Kafka: client settings, topics and the local development broker (DESIGN.md §2, §10)."""
