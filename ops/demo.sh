#!/usr/bin/env bash
# The main job (README): sets up everything (virtual environment, Kafka jars), then runs
# `kvstream demo`, which starts a local Kafka broker, emulated vLLM engines with their
# bridges and two router replicas, replays a slice of the conversation trace through the
# replicas' OpenAI API, restarts a replica, compares with round-robin, and cleans up.
source "$(dirname "$0")/env.sh"
kvstream_ensure_env
cd "$KVSTREAM_ROOT"
exec .venv/bin/kvstream demo "$@"
