#!/usr/bin/env bash
# Builds kvstream's images (docker/README.md):
#   kvstream-kafka:<Kafka version>   docker/kafka/Dockerfile, the jars of ops/kafka/broker.sh
#   kvstream-router:dev              docker/Dockerfile --target router
#   kvstream-worker:dev              docker/Dockerfile --target worker (only with --worker)
#
#   build.sh [--bases auto|official|local] [--worker] [--no-router] [--no-kafka]
#
# --bases: official (python:3.11-slim-bookworm, debian:bookworm-slim from a registry), local
# (made from Debian's packages by ops/docker/build-bases.sh), or auto (default): the
# official ones when present or pullable, else local.
# Python code and Java jars are gathered on the host (the kvstream wheel with its Rust
# kernel built by maturin, its dependencies' wheels by pip, Kafka's jars by Maven), so the
# image builds need no compiler, package index or Maven inside a container. Contexts live
# in $KVSTREAM_CACHE/docker/context; Docker's layer cache makes a re-run with unchanged
# inputs cheap. DOCKER_HOST is honoured.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CACHE_ROOT="${KVSTREAM_CACHE:-$HOME/.cache/kvstream}"
CONTEXTS="$CACHE_ROOT/docker/context"
PYTHON="${PYTHON:-$([[ -x "$ROOT/.venv/bin/python" ]] && echo "$ROOT/.venv/bin/python" || echo python3)}"
OFFICIAL_PYTHON="python:3.11-slim-bookworm"
OFFICIAL_DEBIAN="debian:bookworm-slim"

die() { echo "build.sh: $*" >&2; exit 1; }
log() { echo "build.sh: $*" >&2; }

bases=auto worker=0 router=1 kafka=1
while (($#)); do
    case "$1" in
        --bases) bases="${2:?--bases needs auto, official or local}"; shift 2 ;;
        --worker) worker=1; shift ;;
        --no-router) router=0; shift ;;
        --no-kafka) kafka=0; shift ;;
        -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 0 ;;
        *) die "unknown argument '$1'" ;;
    esac
done
[[ "$bases" =~ ^(auto|official|local)$ ]] || die "--bases must be auto, official or local, not '$bases'"
docker version --format '{{.Server.Version}}' >/dev/null 2>&1 || die "no Docker engine answers (DOCKER_HOST=${DOCKER_HOST:-default})"

present_or_pulled() {
    docker image inspect "$1" >/dev/null 2>&1 || timeout 120 docker pull -q "$1" >/dev/null 2>&1
}

if [[ "$bases" == auto ]]; then
    if present_or_pulled "$OFFICIAL_PYTHON" && present_or_pulled "$OFFICIAL_DEBIAN"; then
        bases=official
    else
        log "the official base images cannot be had: making them from Debian's packages"
        bases=local
    fi
fi
if [[ "$bases" == local ]]; then
    read -r DEBIAN_BASE PYTHON_BASE <<<"$(bash "$ROOT/ops/docker/build-bases.sh")"
else
    DEBIAN_BASE="$OFFICIAL_DEBIAN" PYTHON_BASE="$OFFICIAL_PYTHON"
fi
log "bases: $DEBIAN_BASE, $PYTHON_BASE"

build() {  # build TAG CONTEXT DOCKERFILE [docker build args...]
    local tag="$1" context="$2" file="$3" t0=$SECONDS
    shift 3
    docker build -q -t "$tag" -f "$file" "$@" "$context" >/dev/null
    log "$tag built in $((SECONDS - t0)) s ($(docker image inspect -f '{{.Size}}' "$tag" | numfmt --to=si))"
}

if ((kafka)); then
    libs="$(bash "$ROOT/ops/kafka/broker.sh" fetch)"
    version="$(bash "$ROOT/ops/kafka/broker.sh" version)"
    ctx="$CONTEXTS/kafka"
    rm -rf "$ctx" && mkdir -p "$ctx"
    # Hard links where the cache shares the file system: no copy of 43 MB of jars.
    cp -al "$libs" "$ctx/libs" 2>/dev/null || cp -a "$libs" "$ctx/libs"
    rm -f "$ctx/libs/.complete"
    cp "$ROOT/ops/kafka/log4j2.properties" "$ROOT/docker/kafka/kafka.sh" "$ctx/"
    build "kvstream-kafka:$version" "$ctx" "$ROOT/docker/kafka/Dockerfile" --build-arg DEBIAN_BASE="$DEBIAN_BASE"
fi

# The dependencies' wheels, downloaded once per dependency list (pyproject.toml) and
# Python version: wheelhouse/KEY/deps (kvstream's) and worker-deps (the worker extra's).
wheelhouse() {
    local key dir
    key="$("$PYTHON" - "$ROOT/pyproject.toml" <<'PY'
import hashlib, json, platform, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
deps = {"deps": sorted(project["dependencies"]),
        "worker": sorted(project.get("optional-dependencies", {}).get("worker", [])),
        "python": platform.python_version()}
print(hashlib.sha256(json.dumps(deps, sort_keys=True).encode()).hexdigest()[:16])
PY
)"
    dir="$CACHE_ROOT/docker/wheelhouse/$key"
    if [[ ! -f "$dir/deps/.complete" ]]; then
        rm -rf "$dir/deps" && mkdir -p "$dir/deps"
        "$PYTHON" -m pip download -q -d "$dir/deps" "$wheel"
        rm -f "$dir"/deps/kvstream-*.whl
        touch "$dir/deps/.complete"
    fi
    if ((worker)) && [[ ! -f "$dir/worker-deps/.complete" ]]; then
        local all="$dir/worker-all" f
        rm -rf "$all" "$dir/worker-deps" && mkdir -p "$all" "$dir/worker-deps"
        "$PYTHON" -m pip download -q -d "$all" "$wheel[worker]"
        for f in "$all"/*.whl; do
            [[ -e "$dir/deps/${f##*/}" || "${f##*/}" == kvstream-* ]] || mv "$f" "$dir/worker-deps/"
        done
        rm -rf "$all"
        touch "$dir/worker-deps/.complete"
    fi
    echo "$dir"
}

if ((router || worker)); then
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
        || die "$PYTHON is not CPython 3.11, the images' version: its wheels would not fit (set PYTHON)"
    wheels="$CACHE_ROOT/docker/wheel"
    rm -rf "$wheels" && mkdir -p "$wheels"
    t0=$SECONDS
    CARGO_TARGET_DIR="$CACHE_ROOT/cargo-target" "$PYTHON" -m pip wheel -q --no-deps -w "$wheels" "$ROOT"
    wheel="$(echo "$wheels"/kvstream-*.whl)"
    [[ -f "$wheel" ]] || die "no kvstream wheel was built"
    log "kvstream wheel (maturin, Rust kernel) built in $((SECONDS - t0)) s with $PYTHON"
    t0=$SECONDS
    house="$(wheelhouse)"
    log "dependency wheels in $house ($((SECONDS - t0)) s)"
    for target in router worker; do
        if [[ "$target" == router ]] && ((!router)); then continue; fi
        if [[ "$target" == worker ]] && ((!worker)); then continue; fi
        ctx="$CONTEXTS/$target"
        rm -rf "$ctx" && mkdir -p "$ctx/wheels/kvstream" "$ctx/wheels/worker-deps"
        cp "$ROOT/docker/entrypoint.sh" "$ctx/"
        cp "$wheel" "$ctx/wheels/kvstream/"
        # Hard links: no copy of gigabytes of torch per build.
        cp -al "$house/deps" "$ctx/wheels/deps"
        if [[ "$target" == worker ]]; then
            rm -rf "$ctx/wheels/worker-deps" && cp -al "$house/worker-deps" "$ctx/wheels/worker-deps"
        fi
        rm -f "$ctx"/wheels/*/.complete
        build "kvstream-$target:dev" "$ctx" "$ROOT/docker/Dockerfile" --target "$target" \
            --build-arg PYTHON_BASE="$PYTHON_BASE"
    done
fi
