#!/usr/bin/env bash
# Base images made locally from Debian's packages, for machines that reach no image
# registry (Debian's package mirror is enough). The Dockerfiles default to the official
# bases; ops/docker/build.sh passes these instead when it was asked to (--local-bases).
#
#   build-bases.sh            make the bases that are missing, print their names
#   build-bases.sh --force    make them again
#
# Images (tags are what the Dockerfiles' base arguments take):
#   kvstream-base/debian:bookworm        debootstrap --variant=minbase bookworm, imported
#   kvstream-base/python:3.11-bookworm   the above + Debian's python3 (3.11), venv, CA certificates
# Needs root, debootstrap and a Docker engine (DOCKER_HOST is honoured).
# Environment: KVSTREAM_DEBIAN_MIRROR (default http://deb.debian.org/debian).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
MIRROR="${KVSTREAM_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
DEBIAN_IMAGE="kvstream-base/debian:bookworm"
PYTHON_IMAGE="kvstream-base/python:3.11-bookworm"

die() { echo "build-bases.sh: $*" >&2; exit 1; }
log() { echo "build-bases.sh: $*" >&2; }

have() { docker image inspect "$1" >/dev/null 2>&1; }

force=0
case "${1:-}" in
    --force) force=1 ;;
    "") ;;
    -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 0 ;;
    *) die "unknown argument '$1'" ;;
esac

if ((force)) || ! have "$DEBIAN_IMAGE"; then
    command -v debootstrap >/dev/null || die "debootstrap not found (Debian package debootstrap)"
    ((EUID == 0)) || die "debootstrap needs root"
    t0=$SECONDS
    root="$(mktemp -d /var/tmp/kvstream-debootstrap.XXXXXX)"
    trap 'rm -rf "$root"' EXIT
    log "debootstrap bookworm (minbase) from $MIRROR"
    debootstrap --variant=minbase bookworm "$root" "$MIRROR" >"$root.log" 2>&1 \
        || { tail -n 20 "$root.log" >&2; die "debootstrap failed (log above)"; }
    rm -f "$root.log"
    # What the official debian image does too: no package caches or lists in the image.
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    tar -C "$root" -c . | docker import \
        --change 'ENV LANG=C.UTF-8' --change 'CMD ["bash"]' - "$DEBIAN_IMAGE" >/dev/null
    rm -rf "$root"
    trap - EXIT
    log "$DEBIAN_IMAGE made in $((SECONDS - t0)) s"
fi

if ((force)) || ! have "$PYTHON_IMAGE"; then
    t0=$SECONDS
    docker build -q -t "$PYTHON_IMAGE" --build-arg DEBIAN_BASE="$DEBIAN_IMAGE" \
        -f "$HERE/python-base.Dockerfile" "$HERE" >/dev/null
    log "$PYTHON_IMAGE made in $((SECONDS - t0)) s"
fi
echo "$DEBIAN_IMAGE $PYTHON_IMAGE"
