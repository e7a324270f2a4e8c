"""Errors of the Kafka layer; each message says what went wrong and what to do."""

from __future__ import annotations


class KafkaSetupError(RuntimeError):
    """Base class: Kafka could not be set up or reached as configured."""


class BrokerError(KafkaSetupError):
    """The local development broker (ops/kafka/broker.sh) failed to start, stop or answer."""


class KafkaConfigError(KafkaSetupError, ValueError):
    """Client settings that cannot work (no bootstrap, an option kvstream owns, ...)."""


class TopicError(KafkaSetupError):
    """A topic could not be created or described."""


class TopicMismatchError(TopicError):
    """An existing topic differs from the settings in a way that breaks kvstream (e.g. its
    partition count, which fixes where each worker's events go)."""
