#!/usr/bin/env bash
# Builds the Kubernetes programs of the cluster tests from the k8s.io/kubernetes module named in
# tests/kube/go.mod (one binary, `kube`, that runs kube-apiserver, kube-controller-manager,
# kube-scheduler or kubelet by its first argument) into a cache outside git, keyed by a hash of
# go.mod, go.sum, main.go and this script, reusing Go's module and build caches. Prints the binary's
# path. The programs report the module's version (/version, the node's kubelet version), as a
# release build does: charts read it to choose images and check kubeVersion.
#   bash tests/kube/build.sh           build when missing; print the path
#   bash tests/kube/build.sh --path    print the path; exit 1 when it is not built (builds nothing)
# A cold build takes tens of minutes on two cores (docs/testing.md); a warm one, none.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
key=$(cat "$here/go.mod" "$here/go.sum" "$here/main.go" "$here/build.sh" | sha256sum | cut -c1-16)
cache=${XDG_CACHE_HOME:-$HOME/.cache}/crihook/kube/$key
bin=$cache/kube
if [[ -x $bin || ${1:-} == --path ]]; then
    echo "$bin"
    [[ -x $bin ]]
    exit
fi
command -v go >/dev/null || { echo "tests/kube/build.sh: go is not installed" >&2; exit 1; }
mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9
if [[ ! -x $bin ]]; then
    start=$(date +%s)
    version=$(grep -o 'k8s.io/kubernetes v[^ ]*' "$here/go.mod" | cut -d' ' -f2)
    major=${version#v}
    minor=${major#*.}
    pkg=k8s.io/component-base/version
    ldflags="-s -w -X $pkg.gitVersion=$version -X $pkg.gitMajor=${major%%.*} -X $pkg.gitMinor=${minor%%.*}"
    ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
    (cd "$here" && CGO_ENABLED=1 go build -trimpath -ldflags="$ldflags" -o "$bin.tmp" .)
    mv "$bin.tmp" "$bin"
    echo "tests/kube/build.sh: built $(grep -o 'k8s.io/kubernetes v[^ ]*' "$here/go.mod") in $(( $(date +%s) - start )) s" >&2
fi
echo "$bin"
