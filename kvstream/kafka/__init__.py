"""Kafka (DESIGN.md §2, §10): ``config`` (librdkafka client settings from the
settings), ``topics`` (the topics, created idempotently and verified), ``metadata``
(whether a topic exists, its partitions and watermarks, with retry), ``producer`` (a
producer that counts failures instead of raising), ``local_broker`` and ``cli``
(``kvstream broker``, ``kvstream topics``: the local development broker), ``errors``."""
