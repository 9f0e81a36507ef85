#!/usr/bin/env bash
# Fetch the newer containerd releases the test matrix runs besides the system's own (bookworm's 1.6):
#   trixie -> containerd 1.7.x      sid -> containerd 2.x (sid moves: never pinned, the version used is printed)
#
#   bash tests/runtimes.sh [suite|suite:package...]    (default: trixie sid; tests/run.sh calls it)
#
# `suite:package` fetches another package the same way into <suite>-<package>/ (the cluster tests take
# etcd from sid's etcd-server: `bash tests/runtimes.sh sid:etcd-server`).
#
# Each suite's `containerd` .deb is downloaded with apt-get against a private sources list, state and
# cache, so the machine's apt configuration, its package lists and its installed containerd stay
# untouched, and extracted under $CRIHOOK_RUNTIMES (default ${XDG_CACHE_HOME:-$HOME/.cache}/crihook/runtimes),
# outside any git checkout, so every checkout on the machine shares one copy:
#   <suite>/root/usr/bin/{containerd,containerd-shim-runc-v2,ctr}   the binaries
#   <suite>/version                                                 the package version
#   <suite>/unavailable                                             why it could not be had (then no root/)
# A suite already extracted is reused; CRIHOOK_RUNTIMES_REFRESH=1 fetches it again. A flock on the
# cache dir keeps two concurrent runs from extracting over each other.
# runc is never taken from these suites: theirs need glibc 2.38; bookworm's runc 1.1.5 serves every
# containerd. A suite that cannot be fetched (no network, mirror without the suite) is recorded in
# `unavailable` and the tests for it are skipped with that reason; this script still exits 0.
set -euo pipefail

cache=${CRIHOOK_RUNTIMES:-${XDG_CACHE_HOME:-$HOME/.cache}/crihook/runtimes}
mirror=${CRIHOOK_DEBIAN_MIRROR:-http://deb.debian.org/debian}
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
suites=("$@")
(( ${#suites[@]} )) || suites=(trixie sid)

mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9

why() {  # why LOG: apt's error lines, or its last lines when it printed none
    grep -E '^(E|Err):' "$1" >&2 || tail -n 3 "$1" >&2
}

fetch() {  # fetch SUITE PACKAGE DIR: download and extract PACKAGE into DIR; stderr says why not
    local suite=$1 package=$2 dir=$3 work
    work=$(mktemp -d "$cache/.$suite.XXXXXX")
    # shellcheck disable=SC2064
    trap "rm -rf '$work'" RETURN
    mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/debs" "$work/new/root"
    echo "deb [signed-by=$keyring] $mirror $suite main" >"$work/sources.list"
    local apt=(apt-get -q -o "Dir::Etc::SourceList=$work/sources.list" -o Dir::Etc::SourceParts=/dev/null
        -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache" -o Dir::Cache::pkgcache=
        -o Dir::Cache::srcpkgcache= -o APT::Get::List-Cleanup=false -o Acquire::Retries=2 -o APT::Sandbox::User=root)
    "${apt[@]}" update >"$work/update.log" 2>&1 || { why "$work/update.log"; return 1; }
    (cd "$work/debs" && "${apt[@]}" download "$package") >"$work/download.log" 2>&1 \
        || { why "$work/download.log"; return 1; }
    local deb
    deb=$(echo "$work/debs/${package}"_*.deb)
    dpkg-deb -x "$deb" "$work/new/root" || return 1
    dpkg-deb -f "$deb" Version >"$work/new/version" || return 1
    if [[ $package == containerd ]]; then
        [[ -x $work/new/root/usr/bin/containerd && -x $work/new/root/usr/bin/containerd-shim-runc-v2 ]] \
            || { echo "$deb holds no usr/bin/containerd or containerd-shim-runc-v2" >&2; return 1; }
    fi
    rm -rf "$dir"
    mv "$work/new" "$dir"
}

for entry in "${suites[@]}"; do
    suite=${entry%%:*}
    package=containerd
    dir=$cache/$suite
    if [[ $entry == *:* ]]; then
        package=${entry#*:}
        dir=$cache/$suite-$package
    fi
    if [[ ${CRIHOOK_RUNTIMES_REFRESH:-} == 1 || ! -f $dir/version ]]; then
        if ! why=$(fetch "$suite" "$package" "$dir" 2>&1 >/dev/null); then
            if [[ -f $dir/version ]]; then  # a failed refresh keeps the copy we have
                echo "tests/runtimes.sh: refreshing $suite $package failed, keeping the cached copy: $why" >&2
            else
                mkdir -p "$dir"
                printf '%s from Debian %s could not be downloaded from %s: %s\n' \
                    "$package" "$suite" "$mirror" "$(echo "$why" | tr '\n' ' ')" >"$dir/unavailable"
            fi
        fi
    fi
    if [[ -f $dir/version ]]; then
        rm -f "$dir/unavailable"
        echo "tests/runtimes.sh: $suite $package $(cat "$dir/version") ($dir)" >&2
    else
        echo "tests/runtimes.sh: $suite $package skipped: $(cat "$dir/unavailable")" >&2
    fi
done
