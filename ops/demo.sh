#!/usr/bin/env bash
# The main job (README): sets up everything (virtual environment, Kafka jars), then runs
# `kvstream demo`, which starts a local Kafka broker, synthetic workers and two router
# replicas, routes a workload through them, restarts a replica, and cleans up.
source "$(dirname "$0")/env.sh"
kvstream_ensure_env
cd "$KVSTREAM_ROOT"
exec .venv/bin/kvstream demo "$@"
