"""Write deploy/'s manifests from the chart:  python3 deploy/render.py [--helm PATH] [--check]

charts/crihook is the one source of the cluster manifests. deploy/ holds its rendering with
deploy/values.yaml (release "crihook" in kube-system; a certificate you provide; the extender stanza
for your own kube-scheduler), for `kubectl apply` without Helm: each chart template becomes the file
of the same path under deploy/ (templates/scheduler/deployment.yaml -> deploy/scheduler/deployment.yaml).
Files of deploy/ that no template makes any more are removed, except the examples and the image
build. `--check` writes nothing and exits 1 when deploy/ differs (tests/deploy/test_chart.py checks
the same). Helm is `--helm`, else $CRIHOOK_HELM, else the one tests/helm.sh fetched, else `helm` on PATH.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "crihook"
DEPLOY = ROOT / "deploy"
VALUES = DEPLOY / "values.yaml"
RELEASE, NAMESPACE = "crihook", "kube-system"
# a fixed version, so the rendering does not change with the helm at hand
KUBE_VERSION = "1.28.0"
NOT_RENDERED = ("examples", "image", "render.py", "values.yaml")
SOURCE = re.compile(r"^# Source: [^/]+/templates/(?P<path>\S+)$", re.MULTILINE)


def helm_binary(given: str | None = None) -> str:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "crihook" / "helm"
    for candidate in (given, os.environ.get("CRIHOOK_HELM"), os.environ.get("CRIHOOK_HELM_CACHE")):
        if candidate:
            path = Path(candidate)
            return str(path / "helm" if path.is_dir() else path)
    if (cache / "helm").is_file():
        return str(cache / "helm")
    found = shutil.which("helm")
    if found is None:
        raise SystemExit("deploy/render.py: no helm: bash tests/helm.sh fetches one, or pass --helm")
    return found


def header(template: str) -> str:
    return (
        f"# Rendered from charts/crihook/templates/{template} with deploy/values.yaml by deploy/render.py:\n"
        "# edit the chart, then run `python3 deploy/render.py`.\n"
    )


def split(rendered: str) -> dict[str, str]:
    """`helm template` output -> {template path: its documents}, in the order helm printed them."""
    files: dict[str, list[str]] = {}
    for doc in rendered.split("\n---\n"):
        m = SOURCE.search(doc)
        if m is None:
            continue
        body = doc[m.end() :].strip("\n")
        if any(line and not line.startswith("#") for line in body.splitlines()):
            files.setdefault(m["path"], []).append(body + "\n")
    return {path: header(path) + "---\n".join(docs) for path, docs in files.items()}


def render(helm: str) -> dict[str, str]:
    """deploy/'s rendered files, by path relative to deploy/."""
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION]
    out = subprocess.run(
        [helm, *args, "--values", str(VALUES)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return split(out)


def on_disk() -> dict[str, str]:
    """deploy/'s files that the rendering owns."""
    return {
        str(p.relative_to(DEPLOY)): p.read_text()
        for p in sorted(DEPLOY.rglob("*.yaml"))
        if p.relative_to(DEPLOY).parts[0] not in NOT_RENDERED
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--helm", help="the helm binary")
    parser.add_argument("--check", action="store_true", help="only say whether deploy/ is in sync")
    args = parser.parse_args()
    want, have = render(helm_binary(args.helm)), on_disk()
    if args.check:
        stale = sorted(p for p in want.keys() | have.keys() if want.get(p) != have.get(p))
        for p in stale:
            print(f"deploy/{p} is not what the chart renders", file=sys.stderr)
        return 1 if stale else 0
    for p in have.keys() - want.keys():
        (DEPLOY / p).unlink()
    for p, text in want.items():
        (DEPLOY / p).parent.mkdir(parents=True, exist_ok=True)
        (DEPLOY / p).write_text(text)
    for d in sorted(DEPLOY.rglob("*"), reverse=True):
        if d.is_dir() and not any(d.iterdir()):
            d.rmdir()
    return 0


if __name__ == "__main__":
    sys.exit(main())
