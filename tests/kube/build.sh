#!/usr/bin/env bash
# Builds the Kubernetes programs of the cluster tests from the k8s.io/kubernetes module named in
# tests/kube/go.mod (one binary, `kube`, that runs kube-apiserver, kube-controller-manager,
# kube-scheduler or kubelet by its first argument) into a cache outside git, keyed by a hash of
# go.mod, go.sum and main.go, reusing Go's module and build caches. Prints the binary's path.
# A cold build takes tens of minutes on two cores (docs/testing.md); a warm one, none.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
key=$(cat "$here/go.mod" "$here/go.sum" "$here/main.go" | sha256sum | cut -c1-16)
cache=${XDG_CACHE_HOME:-$HOME/.cache}/crihook/kube/$key
bin=$cache/kube
if [[ -x $bin ]]; then
    echo "$bin"
    exit 0
fi
command -v go >/dev/null || { echo "tests/kube/build.sh: go is not installed" >&2; exit 1; }
mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9
if [[ ! -x $bin ]]; then
    start=$(date +%s)
    (cd "$here" && CGO_ENABLED=1 go build -trimpath -ldflags='-s -w' -o "$bin.tmp" .)
    mv "$bin.tmp" "$bin"
    echo "tests/kube/build.sh: built $(grep -o 'k8s.io/kubernetes v[^ ]*' "$here/go.mod") in $(( $(date +%s) - start )) s" >&2
fi
echo "$bin"
