#!/usr/bin/env bash
# Base images for a host that can reach Debian's mirror and PyPI but no image registry (an air-gapped build host,
# this project's CI): nothing is pulled. As root, with a Docker engine (engine.sh) and mmdebstrap.
#   tokenfleet-base:bookworm      Debian bookworm from the mirror apt already uses, Python 3.11 (and its headers,
#                                 for the CPU kernels) in a venv on PATH,
#                                 the host's extra CA certificates, and torch's CPU build when a wheel of it lies
#                                 in $TOKENFLEET_WHEELS (default /opt/wheels): what infra/docker/Dockerfile builds FROM
#   tokenfleet-redis:bookworm     Debian's redis-server, run as the official redis image runs it
#   tokenfleet-postgres:bookworm  Debian's PostgreSQL, initialised from POSTGRES_USER / _PASSWORD / _DB as the
#                                 official postgres image is
# Then:  TOKENFLEET_BASE_IMAGE=tokenfleet-base:bookworm TOKENFLEET_REDIS_IMAGE=tokenfleet-redis:bookworm \
#        TOKENFLEET_POSTGRES_IMAGE=tokenfleet-postgres:bookworm docker compose ... up --build
# An image already built is kept (FORCE=1 rebuilds).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
wheels=${TOKENFLEET_WHEELS:-/opt/wheels}

exists() { [ -z "${FORCE:-}" ] && docker image inspect "$1" >/dev/null 2>&1; }

if ! exists tokenfleet-rootfs:bookworm; then
    command -v mmdebstrap >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q mmdebstrap >/dev/null
    # The host's own Debian sources (its mirror, its security suite); its extra CAs, for pip and apt over HTTPS.
    sources=/etc/apt/sources.list.d/debian.sources
    [ -f "$sources" ] || sources=/etc/apt/sources.list
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    mkdir -p /usr/local/share/ca-certificates
    mmdebstrap --variant=minbase --include=python3,python3-venv,python3-dev,ca-certificates,passwd --quiet \
        --customize-hook='copy-in /usr/local/share/ca-certificates /usr/local/share' \
        --customize-hook='chroot "$1" update-ca-certificates >/dev/null' \
        --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
        bookworm "$work/rootfs.tar" "$sources"
    # tagged only once whole: an interrupted build leaves no half image that `exists` would trust
    docker import "$work/rootfs.tar" tokenfleet-rootfs:bookworm >/dev/null
    rm -rf "$work"
fi
if ! exists tokenfleet-base:bookworm; then
    context=$(mktemp -d)
    trap 'rm -rf "$context"' EXIT
    cp "$here/local/base.Dockerfile" "$context/Dockerfile"
    mkdir "$context/wheels"
    # torch's CPU build for this Python, when the host keeps one (else the image build takes it from PyTorch's index)
    cp "$wheels"/torch-2.13.0+cpu-cp311-*.whl "$context/wheels/" 2>/dev/null || true
    docker build -q -t tokenfleet-base:bookworm "$context" >/dev/null
fi
for service in redis postgres; do
    if ! exists "tokenfleet-$service:bookworm"; then
        docker build -q -t "tokenfleet-$service:bookworm" -f "$here/local/$service.Dockerfile" "$here/local" >/dev/null
    fi
done
docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E '^tokenfleet-(base|redis|postgres):'
