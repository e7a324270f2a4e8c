#!/bin/sh
# Entrypoint of the kvstream images: `kvstream ARGS...`, with one rule first.
# The router's HTTP API listens on all interfaces only when it requires a bearer token
# (KVSTREAM_REPLICA__TOKEN); without one it stays on the container's loopback, where
# nothing outside the container reaches it. KVSTREAM_REPLICA__HOST set explicitly wins.
#   kvstream-entrypoint health   the image's health check: the router's /readyz
set -eu

if [ "${1:-}" = health ]; then
    exec python3 -c 'import os, urllib.request
port = os.environ.get("KVSTREAM_REPLICA__PORT", "8470")
urllib.request.urlopen("http://127.0.0.1:" + port + "/readyz", timeout=3)'
fi
if [ -z "${KVSTREAM_REPLICA__HOST:-}" ]; then
    if [ -n "${KVSTREAM_REPLICA__TOKEN:-}" ]; then
        export KVSTREAM_REPLICA__HOST=0.0.0.0
    else
        export KVSTREAM_REPLICA__HOST=127.0.0.1
        if [ "${1:-}" = router ]; then
            echo "kvstream-entrypoint: no KVSTREAM_REPLICA__TOKEN, so the API listens on the container's loopback only" >&2
        fi
    fi
fi
exec kvstream "$@"
