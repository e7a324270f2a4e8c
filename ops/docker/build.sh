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
    log "$tag built in $((SECONDS - t0)) s ($(docker image inspect -f '{{.Size}}' "$tag" | numfmt --to=iec))"
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

if ((router || worker)); then
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
        || die "$PYTHON is not CPython 3.11, the images' version: its wheels would not fit (set PYTHON)"
    wheels="$CACHE_ROOT/docker/wheel"
    rm -rf "$wheels" && mkdir -p "$wheels"
    log "building the kvstream wheel (maturin, Rust kernel) with $PYTHON"
    CARGO_TARGET_DIR="$CACHE_ROOT/cargo-target" "$PYTHON" -m pip wheel -q --no-deps -w "$wheels" "$ROOT"
    wheel="$(echo "$wheels"/kvstream-*.whl)"
    [[ -f "$wheel" ]] || die "no kvstream wheel was built"
    for target in router worker; do
        if [[ "$target" == router ]] && ((!router)); then continue; fi
        if [[ "$target" == worker ]] && ((!worker)); then continue; fi
        ctx="$CONTEXTS/$target"
        mkdir -p "$ctx/wheels"
        rm -f "$ctx"/wheels/kvstream-*.whl
        cp "$ROOT/docker/entrypoint.sh" "$ctx/"
        spec="$wheel"
        [[ "$target" == worker ]] && spec="$wheel[worker]"
        # Kept between runs: pip only fetches what changed (its own cache serves the rest).
        "$PYTHON" -m pip download -q -d "$ctx/wheels" "$spec"
        build "kvstream-$target:dev" "$ctx" "$ROOT/docker/Dockerfile" --target "$target" \
            --build-arg PYTHON_BASE="$PYTHON_BASE"
    done
fi
