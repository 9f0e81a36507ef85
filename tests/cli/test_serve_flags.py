"""The node daemon's flags (`crihook serve`, `crihook nri`) over the configuration file."""

from __future__ import annotations

import argparse
from pathlib import Path

from crihook.base import config as cfgmod
from crihook.cli.serve import add_node_arguments, overrides


def parse(*args: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_node_arguments(parser)
    return parser.parse_args(list(args))


def test_node_name_flag_names_the_node(tmp_path: Path) -> None:
    """The chart passes the pod's spec.nodeName: the metrics' node label is the Kubernetes node's
    name, which need not be the host name (kubelet's --hostname-override, cloud node names)."""
    config = tmp_path / "config.toml"
    config.write_text('[node]\nname = "from-file"\n')
    assert cfgmod.load(str(config), overrides(parse(f"--config={config}", "--node-name=gpu-7"))).node.name == "gpu-7"
    assert cfgmod.load(str(config), overrides(parse(f"--config={config}"))).node.name == "from-file"
