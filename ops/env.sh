# Sourced by ops/test.sh and ops/demo.sh: makes ./.venv ready on a fresh machine.
#
# The virtual environment lives in a cache folder keyed by the dependency lists of
# pyproject.toml (and the Python version), so CI and fresh clones reuse it until the
# dependencies change; a machine without the cache installs everything from scratch.
# The project itself (with its Rust hashing kernel) is always reinstalled from this tree.
set -euo pipefail

KVSTREAM_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export KVSTREAM_CACHE="${KVSTREAM_CACHE:-$HOME/.cache/kvstream}"
PYTHON="${PYTHON:-python3}"

kvstream_ensure_env() {
    local key venv
    key="$("$PYTHON" - "$KVSTREAM_ROOT/pyproject.toml" <<'PY'
import hashlib, json, sys, tomllib, platform
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
deps = {"deps": sorted(project["dependencies"]),
        "extras": {k: sorted(v) for k, v in sorted(project.get("optional-dependencies", {}).items())},
        "python": platform.python_version()}
print(hashlib.sha256(json.dumps(deps, sort_keys=True).encode()).hexdigest()[:16])
PY
)"
    venv="$KVSTREAM_CACHE/venvs/$key"
    if [ ! -f "$venv/.complete" ]; then
        echo "==> creating the virtual environment $venv (first run: large downloads, torch included)" >&2
        rm -rf "$venv"
        mkdir -p "$KVSTREAM_CACHE/venvs"
        "$PYTHON" -m venv "$venv"
        "$venv/bin/pip" install --quiet --upgrade pip
        # Dependencies only: read them from pyproject.toml so the list lives in one place.
        "$venv/bin/python" - "$KVSTREAM_ROOT/pyproject.toml" > "$venv/requirements.txt" <<'PY'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
extras = project.get("optional-dependencies", {})
for req in [*project["dependencies"], *extras.get("worker", []), *extras.get("test", [])]:
    print(req)
PY
        "$venv/bin/pip" install --quiet -r "$venv/requirements.txt"
        touch "$venv/.complete"
    fi
    ln -sfn "$venv" "$KVSTREAM_ROOT/.venv"
    echo "==> installing kvstream from $KVSTREAM_ROOT (builds the Rust hashing kernel)" >&2
    CARGO_TARGET_DIR="$KVSTREAM_CACHE/cargo-target" \
        "$KVSTREAM_ROOT/.venv/bin/pip" install --quiet --no-deps -e "$KVSTREAM_ROOT"
    # The broker's jars and Kafka's tools' (kafka-acls, consumer groups): tests run them,
    # and a test must not skip on a machine where nothing fetched them before.
    echo "==> fetching the Apache Kafka jars and Kafka's tools (once)" >&2
    bash "$KVSTREAM_ROOT/ops/kafka/broker.sh" fetch-tools >&2
}
