#!/usr/bin/env bash
# The main job on any Linux machine, no GPU or kubelet needed:  bash demo.sh [crihook demo options]
#
# Installs what is missing (python3-venv and gcc through apt when run as root on Debian), makes .venv,
# installs crihook into it, and runs `crihook demo`: a simulated 8-GPU node, the allocator, and
# `crihook serve` with the gpu hook in front of a private containerd (as root, with containerd and
# runc installed) or the embedded CRI runtime otherwise.
set -euo pipefail
cd "$(dirname "$0")"

missing=()
command -v gcc >/dev/null 2>&1 || missing+=(gcc libc6-dev)
python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || missing+=(python3-venv)
if (( ${#missing[@]} )); then
    if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
        echo "demo.sh: please install ${missing[*]} first" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
[[ -x .venv/bin/python ]] || python3 -m venv .venv
# Install when pyproject.toml changed since the last install (by this script or tests/run.sh).
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [[ "$(cat .venv/.crihook-demo.sha256 2>/dev/null)" != "$want" && \
      "$(cat .venv/.crihook-pyproject.sha256 2>/dev/null)" != "$want" ]]; then
    .venv/bin/python -m pip install -q -e .
    echo "$want" >.venv/.crihook-demo.sha256
fi
exec .venv/bin/crihook demo "$@"
