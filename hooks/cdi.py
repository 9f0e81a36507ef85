"""CDI spec dirs on the node: which `vendor/class=name` devices a CDI-enabled runtime can inject.

containerd 1.7+ resolves a CDI device name against the spec files (`*.json`, `*.yaml`) in its
`cdi_spec_dirs`; a name that no spec declares fails CreateContainer deep in the runtime
("unresolvable CDI devices"), and a runtime without CDI drops it silently. The gpu hook (`inject =
"cdi"`) asks a `CdiIndex` first, so the refusal names the GPU, the dirs and the fix; `crihook
doctor` asks the same index whether every GPU of the node has its device.

The gpu hook also asks it which device nodes a CDI device brings (`device_nodes`): a GPU reached
through a DRA claim's CDI device is known by the numbers of the nodes its spec lists.

`declared` and `spec_nodes` are the pure part. `CdiIndex.scan` lists the dirs on each call and parses the specs again
only when that listing (names, sizes, mtimes) changed. It does file-system I/O, so it is only called
where blocking is allowed: the gpu hook runs in the hook chain's worker thread under its timeout,
never on the event loop, so a stalled file system holds up that one CreateContainer, not the proxy.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from crihook.hooks.reach import DeviceNode

# containerd's defaults (and CDI's): static specs, then generated ones, later dirs taking priority.
DEFAULT_SPEC_DIRS = ("/etc/cdi", "/var/run/cdi")
# The annotation prefix CDI-enabled runtimes (containerd >= 1.7, CRI-O) inject devices from; the
# value is a comma list of qualified names (CDI's pkg/cdi annotations.go).
ANNOTATION_PREFIX = "cdi.k8s.io/"
SPEC_SUFFIXES = (".json", ".yaml")  # what the CDI library reads; any other file is ignored
GENERATE_FIX = "nvidia-ctk cdi generate --device-name-strategy=uuid --output=/var/run/cdi/nvidia.yaml"

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def declared(spec: object) -> frozenset[str]:
    """The qualified device names (`<kind>=<name>`) a parsed spec declares; its `kind` is
    "vendor/class" and each of `devices` has a `name` (the CDI specification, SPEC.md). Empty for
    anything else."""
    if not isinstance(spec, dict):
        return frozenset()
    kind, devices = spec.get("kind"), spec.get("devices")
    if not isinstance(kind, str) or "/" not in kind or not isinstance(devices, list):
        return frozenset()
    return frozenset(
        f"{kind}={d['name']}" for d in devices if isinstance(d, dict) and isinstance(d.get("name"), str) and d["name"]
    )


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """A device node a CDI spec adds: its path in the container, on the host, and its numbers when
    the spec gives them (the runtime reads them from the host node otherwise)."""

    path: str
    host_path: str
    kind: str = ""
    major: int | None = None
    minor: int | None = None


def spec_nodes(spec: object) -> dict[str, tuple[NodeSpec, ...]]:
    """The device nodes each qualified name of a parsed spec brings: the device's own
    `containerEdits.deviceNodes`, then the spec-level ones (applied with any of its devices)."""
    if not isinstance(spec, dict) or not declared(spec):
        return {}
    common = _nodes(spec.get("containerEdits"))
    return {
        f"{spec['kind']}={d['name']}": (*_nodes(d.get("containerEdits")), *common)
        for d in spec["devices"]
        if isinstance(d, dict) and isinstance(d.get("name"), str) and d["name"]
    }


def _nodes(edits: Any) -> tuple[NodeSpec, ...]:
    raw = edits.get("deviceNodes") if isinstance(edits, dict) else None
    out = []
    for n in raw if isinstance(raw, list) else ():
        if isinstance(n, dict) and isinstance(n.get("path"), str):
            host, kind = n.get("hostPath"), n.get("type")
            major, minor = n.get("major"), n.get("minor")
            numbered = isinstance(major, int) and isinstance(minor, int)
            out.append(
                NodeSpec(
                    n["path"],
                    host if isinstance(host, str) and host else n["path"],
                    kind if isinstance(kind, str) else "",
                    major if numbered else None,
                    minor if numbered else None,
                )
            )
    return tuple(out)


@dataclass(frozen=True)
class Scan:
    """What the spec dirs held at the last change."""

    devices: frozenset[str]  # qualified names every readable spec declares
    specs: tuple[str, ...]  # the spec files read
    problems: tuple[str, ...]  # "<file>: <why>" for each one that could not be used
    nodes: Mapping[str, tuple[NodeSpec, ...]] = field(default_factory=dict)  # name -> its device nodes


_Listing = tuple[tuple[str, int, int], ...]  # (path, size, mtime_ns) of every spec file


class CdiIndex:
    """The devices declared in `dirs` (missing dirs count as empty, as they do for containerd)."""

    def __init__(self, dirs: Sequence[str] = DEFAULT_SPEC_DIRS) -> None:
        self.dirs = tuple(dirs)
        self._lock = threading.Lock()  # hook calls run in several worker threads
        self._listing: _Listing | None = None
        self._scan = Scan(frozenset(), (), ())

    def scan(self) -> Scan:
        listing = self._list()
        with self._lock:
            if listing != self._listing:
                self._scan = _read(listing)
                self._listing = listing
            return self._scan

    def _list(self) -> _Listing:
        found = []
        for top in self.dirs:
            for root, subdirs, names in os.walk(top):
                subdirs.sort()
                for name in sorted(names):
                    if not name.endswith(SPEC_SUFFIXES):
                        continue
                    path = os.path.join(root, name)
                    try:
                        st = os.stat(path)
                    except OSError:
                        continue  # gone meanwhile
                    found.append((path, st.st_size, st.st_mtime_ns))
        return tuple(found)

    def describe_dirs(self) -> str:
        return ", ".join(self.dirs)

    def device_nodes(self, name: str, stat: Callable[[str], DeviceNode]) -> tuple[DeviceNode, ...] | None:
        """The device nodes the CDI device `name` brings, with their numbers (`stat(host path)` for
        a node whose spec gives none, as the runtime does); None when no spec declares it.
        OSError from `stat`."""
        specs = self.scan().nodes.get(name)
        if specs is None:
            return None
        out = []
        for n in specs:
            if n.major is not None and n.minor is not None:
                out.append(DeviceNode(n.kind or "c", n.major, n.minor, n.path))
            else:
                found = stat(n.host_path)
                out.append(DeviceNode(found.kind, found.major, found.minor, n.path))
        return tuple(out)


def _read(listing: _Listing) -> Scan:
    devices: set[str] = set()
    nodes: dict[str, tuple[NodeSpec, ...]] = {}
    specs, problems = [], []
    for path, _, _ in listing:
        try:
            with open(path, "rb") as f:
                data = f.read()
            doc = json.loads(data) if path.endswith(".json") else yaml.load(data, Loader=_Loader)
        except (OSError, ValueError, yaml.YAMLError) as e:
            problems.append(f"{path}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            continue
        names = declared(doc)
        if not names:
            problems.append(f'{path}: not a CDI spec (no kind "vendor/class" with named devices)')
            continue
        specs.append(path)
        devices |= names
        nodes.update(spec_nodes(doc))  # a later dir's spec wins, as in the runtime
    return Scan(frozenset(devices), tuple(specs), tuple(problems), nodes)
