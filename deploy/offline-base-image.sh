#!/usr/bin/env bash
# Builds a stand-in for the python:3.11-slim base image on a machine that reaches a Debian
# mirror and PyPI but no container registry, for the CPU compose smoke test:
#
#   TORCH_WHEEL=/path/torch-*-cp311-*.whl deploy/offline-base-image.sh [TAG]
#   HEADRACE_DOCKER_SMOKE=1 HEADRACE_SMOKE_BASE_IMAGE=TAG pytest tests/test_compose.py
#
# Environment (all optional):
#   DEBIAN_MIRROR  Debian mirror for debootstrap (default http://deb.debian.org/debian)
#   CA_BUNDLE      CA bundle pip must trust inside the build (default: pip's configured `cert`,
#                  else /etc/ssl/certs/ca-certificates.crt)
#   TORCH_WHEEL    a torch wheel to preinstall (when download.pytorch.org is unreachable)
# Needs root, debootstrap and a running Docker engine. Nothing here enters the shipped image
# unless this stand-in is passed as its BASE_IMAGE.
set -euo pipefail
TAG=${1:-local/headrace-smoke-base}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
CA=${CA_BUNDLE:-$(pip config get global.cert 2>/dev/null || echo /etc/ssl/certs/ca-certificates.crt)}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

if ! docker image inspect local/python-base > /dev/null 2>&1; then
  debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
    bookworm "$WORK/rootfs" "$MIRROR"
  tar -C "$WORK/rootfs" -c . | docker import - local/python-base
  rm -rf "$WORK/rootfs"
fi

mkdir -p "$WORK/ctx"
cp "$CA" "$WORK/ctx/ca.crt"
{
  echo "FROM local/python-base"
  echo "COPY ca.crt /etc/ssl/certs/ca-certificates.crt"
  echo "ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt"
} > "$WORK/ctx/Dockerfile"
if [ -n "${TORCH_WHEEL:-}" ]; then
  cp "$TORCH_WHEEL" "$WORK/ctx/"
  wheel=$(basename "$TORCH_WHEEL")
  echo "COPY $wheel /tmp/$wheel" >> "$WORK/ctx/Dockerfile"
  echo "RUN python3 -m pip install --break-system-packages --no-cache-dir /tmp/$wheel && rm /tmp/$wheel" \
    >> "$WORK/ctx/Dockerfile"
fi
docker build --network host -t "$TAG" "$WORK/ctx"
echo "built $TAG"
