"""The extender fixtures: request and object bodies as kube-scheduler and the API server send them
(fixtures/extender/), and the small cluster they describe, loaded into an allocator."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from crihook.scheduler.devices import node_from_device
from crihook.scheduler.plugin import DeviceShare, PluginConfig

FIXTURES = Path(__file__).parent / "fixtures" / "extender"


def fixture(name: str) -> Any:
    return json.loads((FIXTURES / name).read_text())


def cluster_plugin(config: PluginConfig | None = None) -> DeviceShare:
    """The fixture cluster: gpu-node-1 (8 x A100 80GB), gpu-node-2 (4 x V100 32GB), cpu-node-1 (no Device)."""
    plugin = DeviceShare(config)
    nodes = {n["metadata"]["name"]: n for n in fixture("cluster_nodes.json")["items"]}
    for dev in fixture("cluster_devices.json")["items"]:
        node = nodes[dev["metadata"]["name"]]
        plugin.set_node(node_from_device(dev, node["metadata"]["labels"], node["status"]["allocatable"]))
    return plugin
