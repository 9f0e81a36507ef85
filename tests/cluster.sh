#!/usr/bin/env bash
# The cluster tests alone:  bash tests/cluster.sh [pytest arguments]
#
# The one-node Kubernetes cluster of tests/support/cluster.py in both node modes, with the chart
# installed by the real helm. Everything tests/run.sh prepares is prepared the same way (Debian
# packages, .venv, etcd, the Kubernetes programs, helm), then only tests/cluster runs.
set -euo pipefail
cd "$(dirname "$0")/.."
exec bash tests/run.sh tests/cluster "$@"
