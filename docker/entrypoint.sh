#!/bin/sh
# Entrypoint of the kvstream images: `kvstream ARGS...`, with one rule first.
# The router's HTTP API listens on all interfaces only when it requires a bearer token
# (any KVSTREAM_REPLICA__*TOKEN or *TOKEN_FILE variable: one for all scopes or per scope);
# without one it stays on the container's loopback, where nothing outside the container
# reaches it. KVSTREAM_REPLICA__HOST set explicitly wins (the router itself refuses a
# non-loopback address without a token unless --allow-open-bind).
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
    if env | grep -q '^KVSTREAM_REPLICA__[A-Z_]*TOKEN\(_FILE\)\{0,1\}=.'; then
        export KVSTREAM_REPLICA__HOST=0.0.0.0
    else
        export KVSTREAM_REPLICA__HOST=127.0.0.1
        if [ "${1:-}" = router ]; then
            echo "kvstream-entrypoint: no KVSTREAM_REPLICA__*TOKEN, so the API listens on the container's loopback only" >&2
        fi
    fi
fi
exec kvstream "$@"
