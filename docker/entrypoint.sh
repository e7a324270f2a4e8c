#!/bin/sh
# Entrypoint of the kvstream images: `kvstream ARGS...`, with one rule first.
# The router's HTTP API listens on all interfaces only when it requires a bearer token
# (KVSTREAM_REPLICA__TOKEN); without one it stays on the container's loopback, where
# nothing outside the container reaches it. KVSTREAM_REPLICA__HOST set explicitly wins.
#   kvstream-entrypoint health VAR PATH   the images' health check: GET PATH on the port
#                                         that the variable VAR names answers 2xx
set -eu

if [ "${1:-}" = health ]; then
    exec python3 - "$2" "$3" <<'PY'
import os, sys, urllib.request
var, path = sys.argv[1:]
urllib.request.urlopen(f"http://127.0.0.1:{os.environ[var]}{path}", timeout=3)
PY
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
