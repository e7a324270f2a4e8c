"""Fixtures of the gateway tests: the test tokenizer, and a replica per test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from tokenizers import Tokenizer

from kvstream.replica.replica import Replica
from kvstream.settings import Settings
from tests.gateway.fleet import HFPromptTokenizer, tokenizer_file
from tests.replica.test_replica_kafka import start


@pytest.fixture(scope="session")
def prompt_tokenizer() -> HFPromptTokenizer:
    return HFPromptTokenizer(Tokenizer.from_file(str(tokenizer_file())))


@pytest.fixture
def replica(kafka_topics: Settings) -> Iterator[Replica]:
    """A replica of its own for each test (its registry holds one gateway's metrics)."""
    r = start(kafka_topics)
    try:
        yield r
    finally:
        r.stop()
