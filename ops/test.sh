#!/usr/bin/env bash
# The test command (README): sets up everything the tests need, then runs them all.
# Tests that need Kafka start a real local KRaft broker themselves (tests/conftest.py),
# or use KVSTREAM_BOOTSTRAP when it names an external cluster.
source "$(dirname "$0")/env.sh"
kvstream_ensure_env
cd "$KVSTREAM_ROOT"
exec .venv/bin/python -m pytest -q "$@"
