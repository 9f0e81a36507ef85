"""`crihook inspect POD|CONTAINER`: what crihook decided and did for one pod or container, read from
the store file (`crihook serve`'s and `crihook nri`'s alike), so it works while crihook runs and
after it stopped; the first line says which mode the node runs crihook in.

A pod or container is named the way operators have it at hand: an id or id prefix (as crictl
prints it), a pod uid, `namespace/pod`, `namespace/pod/container`, or a bare name when that is
unique.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from crihook.base.config import DEFAULT_CONFIG, ConfigError, load
from crihook.cli import state_dir as cli_state_dir
from crihook.cli.mode import node_mode

# Labels and annotations crihook's hooks read; the rest of a pod's metadata is noise here.
RELEVANT_PREFIXES = (
    "scheduling.koordinator.sh/",
    "koordinator.sh/",
    "runtimeproxy.koordinator.sh/",
    "gpu.crihook.io/",
    "nvidia.com/",
)
MIN_PREFIX = 4  # shorter id prefixes match too much to mean anything


@dataclass
class Match:
    pod: dict[str, Any]
    containers: list[dict[str, Any]] = field(default_factory=list)
    container_only: bool = False  # the query named one container: show just it


def _pod_key(pod: dict[str, Any]) -> str:
    return f"{pod.get('namespace', '?')}/{pod.get('name', '?')}"


def _newest(pods: list[dict[str, Any]]) -> dict[str, Any]:
    """Of several sandboxes of one pod (kubelet recreates them), the one that counts now."""
    return max(pods, key=lambda p: (p.get("state") == "ready", p.get("attempt", 0), p.get("created", 0.0)))


def find(body: dict[str, Any], query: str) -> Match:
    """The pod or container `query` names. LookupError with a message for the operator when it
    names nothing, or several different things."""
    pods: dict[str, dict[str, Any]] = {p["id"]: p for p in body.get("pods", [])}
    containers: list[dict[str, Any]] = list(body.get("containers", []))

    def containers_of(pod_id: str) -> list[dict[str, Any]]:
        return sorted((c for c in containers if c.get("pod_id") == pod_id), key=lambda c: c.get("created", 0.0))

    def for_container(c: dict[str, Any]) -> Match:
        pod = pods.get(c.get("pod_id", ""), {"id": c.get("pod_id", ""), "name": "?", "namespace": "?"})
        return Match(pod, [c], container_only=True)

    parts = query.split("/")
    # Most specific first: the first rule that matches anything decides.
    rules: list[tuple[list[dict[str, Any]], list[dict[str, Any]]]] = [
        ([p for p in pods.values() if p["id"] == query], [c for c in containers if c["id"] == query]),
        ([p for p in pods.values() if p.get("uid") == query], []),
    ]
    if len(parts) == 2:
        rules.append(([p for p in pods.values() if [p.get("namespace"), p.get("name")] == parts], []))
    if len(parts) == 3:
        pod_ids = {p["id"] for p in pods.values() if [p.get("namespace"), p.get("name")] == parts[:2]}
        rules.append(([], [c for c in containers if c.get("pod_id") in pod_ids and c.get("name") == parts[2]]))
    if len(parts) == 1:
        rules.append(
            ([p for p in pods.values() if p.get("name") == query], [c for c in containers if c.get("name") == query])
        )
        if len(query) >= MIN_PREFIX:
            rules.append(
                (
                    [p for p in pods.values() if p["id"].startswith(query)],
                    [c for c in containers if c["id"].startswith(query)],
                )
            )
    for pod_hits, container_hits in rules:
        if not pod_hits and not container_hits:
            continue
        # Sandboxes of one pod (same uid) and attempts of one container count as one thing.
        by_uid: dict[str, list[dict[str, Any]]] = {}
        for p in pod_hits:
            by_uid.setdefault(p.get("uid") or p["id"], []).append(p)
        by_name: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for c in container_hits:
            pod = pods.get(c.get("pod_id", ""), {})
            by_name.setdefault((pod.get("uid") or c.get("pod_id", ""), c.get("name", "")), []).append(c)
        if len(by_uid) + len(by_name) > 1:
            names = sorted({_pod_key(ps[0]) for ps in by_uid.values()})
            names += sorted(
                {f"{_pod_key(pods.get(cs[0].get('pod_id', ''), {}))}/{cs[0].get('name')}" for cs in by_name.values()}
            )
            raise LookupError(f"{query!r} names more than one thing: {', '.join(names)}; say which")
        if by_uid:
            pod = _newest(next(iter(by_uid.values())))
            return Match(pod, containers_of(pod["id"]))
        attempts = next(iter(by_name.values()))
        return for_container(max(attempts, key=lambda c: (c.get("attempt", 0), c.get("created", 0.0))))
    raise LookupError(
        f"crihook has no record of a pod or container {query!r} "
        "(it records pods created through it; `crictl ps -a` and `crictl pods` list what the runtime has)"
    )


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "unknown time"


def _relevant(mapping: dict[str, str]) -> list[tuple[str, str]]:
    return sorted((k, v) for k, v in mapping.items() if k.startswith(RELEVANT_PREFIXES))


def _detail_lines(detail: Any, indent: str) -> list[str]:
    if detail is None or detail == "" or detail == {} or detail == []:
        return []
    if isinstance(detail, dict):
        return [f"{indent}{k}: {v if isinstance(v, str) else json.dumps(v, sort_keys=True)}" for k, v in detail.items()]
    if isinstance(detail, list):
        return [f"{indent}- {v if isinstance(v, str) else json.dumps(v, sort_keys=True)}" for v in detail]
    return [f"{indent}{detail}"]


def _hook_lines(records: Sequence[dict[str, Any]], indent: str) -> list[str]:
    if not records:
        return [f"{indent}no hook ran"]
    lines = []
    for r in records:
        ms = r.get("ms")
        took = f"{ms:.1f} ms" if isinstance(ms, int | float) else "?"
        lines.append(f"{indent}{r.get('stage', '?')}  {r.get('hook', '?')}: {r.get('result', '?')} ({took})")
        lines.extend(_detail_lines(r.get("detail"), indent + "    "))
    return lines


def render(match: Match) -> str:
    pod = match.pod
    lines = [
        f"pod {_pod_key(pod)}  uid {pod.get('uid', '?')}  sandbox {pod['id'][:13]}  "
        f"state {pod.get('state', '?')}  since {_when(pod.get('created', 0.0))}"
    ]
    meta = [(f"label {k}", v) for k, v in _relevant(pod.get("labels", {}))]
    meta += [(f"annotation {k}", v) for k, v in _relevant(pod.get("annotations", {}))]
    if meta:
        lines.append("  what crihook reads:")
        lines += [f"    {k} = {v}" for k, v in meta]
    else:
        lines.append("  no label or annotation crihook reads (no GPU or RDMA asked for through the scheduler)")
    if not match.container_only:
        lines.append("  pod hooks:")
        lines += _hook_lines(pod.get("hooks", []), "    ")
    if not match.containers:
        lines.append("  no containers recorded")
    for c in match.containers:
        lines.append(
            f"  container {c.get('name', '?')}  id {c['id'][:13]}  attempt {c.get('attempt', 0)}  "
            f"state {c.get('state', '?')}  since {_when(c.get('created', 0.0))}"
        )
        lines += _hook_lines(c.get("hooks", []), "    ")
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "target", metavar="POD|CONTAINER", help="id or id prefix, uid, namespace/pod[/container], or name"
    )
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="crihook's config file (default %(default)s)")
    parser.add_argument("--state-dir", help="read the store from here instead of proxy.state_dir")
    parser.add_argument("--json", action="store_true", help="print the records as JSON, with all metadata")


def run(args: argparse.Namespace) -> int:
    from crihook.node.storefile import StoreFileError, read_file

    state_dir = cli_state_dir(args, "inspect")
    if state_dir is None:
        return 2
    path = Path(state_dir) / "store.json"
    try:
        body = read_file(path)
        match = find(body, args.target)
    except FileNotFoundError:
        print(
            f"crihook inspect: no store at {path}: crihook has recorded nothing yet (crihook doctor)", file=sys.stderr
        )
        return 1
    except (StoreFileError, PermissionError, LookupError) as e:
        print(f"crihook inspect: {e.args[0] if isinstance(e, LookupError) else e}", file=sys.stderr)
        return 1
    try:
        mode = node_mode(load(args.config).node.proc_root)
    except ConfigError:
        mode = node_mode("/proc")
    if args.json:
        out = {"pod": match.pod, "containers": match.containers, "node": mode}
        json.dump(out, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(f"node: {mode}\n" + render(match))
    return 0
