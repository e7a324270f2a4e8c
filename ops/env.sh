# Sourced by ops/test.sh and ops/demo.sh: makes ./.venv ready on a fresh machine.
#
# The dependencies live in a virtual environment in a cache folder keyed by the
# dependency lists of pyproject.toml (and the Python version), so CI and fresh clones
# reuse it until the dependencies change; a machine without the cache installs everything
# from scratch. Each checkout's ./.venv is a thin environment of its own layered over
# those dependencies, with this tree installed into it (with its compiled core): two
# checkouts never run each other's code.
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
    # The shared environment holds dependencies only (older set-ups installed a checkout
    # into it: that install would shadow no one now, but it points at another tree).
    rm -rf "$venv"/lib/python*/site-packages/kvstream.pth "$venv"/lib/python*/site-packages/kvstream-*.dist-info
    local layer="$KVSTREAM_ROOT/.venv"
    [ -L "$layer" ] && rm "$layer"  # the link older set-ups made to the shared environment
    if [ "$(cat "$layer/.dependencies" 2>/dev/null)" != "$venv" ]; then
        rm -rf "$layer"
        "$PYTHON" -m venv "$layer"
        local own deps
        own="$("$layer/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
        deps="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
        # Read after this checkout's own install (.pth files load in name order).
        echo "import site; site.addsitedir('$deps')" > "$own/zz-kvstream-dependencies.pth"
        echo "$venv" > "$layer/.dependencies"
    fi
    echo "==> installing kvstream from $KVSTREAM_ROOT into its own .venv (builds the compiled core)" >&2
    CARGO_TARGET_DIR="$KVSTREAM_CACHE/cargo-target" \
        "$layer/bin/pip" install --quiet --no-deps -e "$KVSTREAM_ROOT"
    # The broker's jars and Kafka's tools' (kafka-acls, consumer groups): tests run them,
    # and a test must not skip on a machine where nothing fetched them before.
    echo "==> fetching the Apache Kafka jars and Kafka's tools (once)" >&2
    bash "$KVSTREAM_ROOT/ops/kafka/broker.sh" fetch-tools >&2
}
