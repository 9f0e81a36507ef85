"""The DRA driver's manifests: the chart's DeviceClasses and `crihook dra` DaemonSet, and the example
ResourceClaimTemplates, valid for every Kubernetes release with resource.k8s.io/v1, and naming only
attributes and capacities the driver's ResourceSlices publish."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from crihook.base import dra
from crihook.cli import dra as dra_cli
from crihook.devices import partitions, slices
from crihook.devices.nvml import GpuInfo, NodeGpus
from tests.support import helm

EXAMPLES = Path(__file__).resolve().parents[2] / "deploy" / "examples" / "005-dra.yaml"
DRA_RELEASES = ("1.34.0", "1.35.0", "1.36.0", "1.37.0")
_ATTRIBUTE = re.compile(r'device\.attributes\["gpu\.crihook\.io"\]\.(\w+)')


def examples() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(EXAMPLES.read_text()) if d]


def published_names() -> tuple[set[str], set[str]]:
    """The attribute and capacity names of a device on an 8-GPU NVSwitch node."""
    found = NodeGpus(
        "550.54.15",
        tuple(
            GpuInfo(
                i,
                i,
                f"GPU-{i}",
                "NVIDIA H100 80GB HBM3",
                80 << 30,
                f"0000:{i + 16:02x}:00.0",
                0,
                pcie_root_complex="pci0000:00",
                cuda_capability="9.0",
            )
            for i in range(8)
        ),
    )
    table = partitions.builtin_table("NVIDIA H100 80GB HBM3", list(range(8)), nvswitch=True)
    features = slices.Features(consumable_capacity=True, device_taints=True)
    device = slices.build("n", "", found, table, (), features, 1).slices[0]["spec"]["devices"][0]
    return set(device["attributes"]), set(device["capacity"])


def unqualified(name: str) -> str:
    return name.removeprefix(f"{dra.DRIVER}/")


@pytest.mark.parametrize("version", DRA_RELEASES)
def test_examples_pass_kubernetes_strict_schemas(version: str) -> None:
    for doc in examples():
        kubernetes_validate.validate(doc, version, strict=True)


def test_examples_name_only_what_the_slices_publish() -> None:
    attributes, capacities = published_names()
    named_attributes, named_capacities, classes = set(), set(), set()
    for doc in examples():
        if doc["kind"] != "ResourceClaimTemplate":
            continue
        devices = doc["spec"]["spec"]["devices"]
        for c in devices.get("constraints", ()):
            named_attributes.add(unqualified(c["matchAttribute"]))
        for r in devices["requests"]:
            for sub in r.get("firstAvailable") or [r["exactly"]]:
                classes.add(sub["deviceClassName"])
                named_capacities |= set((sub.get("capacity") or {}).get("requests", {}))
                for s in sub.get("selectors", ()):
                    named_attributes |= set(_ATTRIBUTE.findall(s["cel"]["expression"]))
    assert named_attributes and named_attributes <= attributes
    assert named_capacities == capacities
    assert classes == {dra.DEVICE_CLASS}


def test_the_chart_installs_the_classes_and_the_driver() -> None:
    docs = helm.rendered("dra")
    classes = {c["metadata"]["name"]: c["spec"] for c in helm.of_kind(docs, "DeviceClass")}
    assert classes[dra.DEVICE_CLASS] == {"selectors": [{"cel": {"expression": 'device.driver == "gpu.crihook.io"'}}]}
    assert classes["extended.gpu.crihook.io"]["extendedResourceName"] == "nvidia.com/gpu"
    (ds,) = [d for d in helm.of_kind(docs, "DaemonSet") if d["metadata"]["name"].endswith("-dra")]
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    assert c["args"][0] == "dra"
    parser = argparse.ArgumentParser(exit_on_error=False)
    dra_cli.add_arguments(parser)
    args = parser.parse_args(c["args"][1:])
    assert args.consumable_capacity == "on" and args.kubelet_root == "/var/lib/kubelet"
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert {"/var/lib/kubelet/plugins_registry", f"/var/lib/kubelet/plugins/{dra.DRIVER}", args.cdi_dir} <= mounts
    assert args.state_dir in mounts
    rules = {
        (r["apiGroups"][0], r["resources"][0]): set(r["verbs"])
        for c in helm.of_kind(docs, "ClusterRole")
        if c["metadata"]["name"].endswith("-dra")
        for r in c["rules"]
    }
    assert rules[("resource.k8s.io", "resourceclaims")] == {"get"}
    assert "update" in rules[("resource.k8s.io", "resourceslices")]


@pytest.mark.parametrize("version", DRA_RELEASES)
def test_the_chart_renders_dra_for_every_release_with_it(version: str) -> None:
    docs = helm.rendered("dra", version)
    assert len(helm.of_kind(docs, "DeviceClass")) == 2
    problems = [f"{where}: {p}" for where, d in docs if (p := helm.api_problem(d, version))]
    assert not problems, "\n".join(problems)


def test_only_the_class_where_the_nodes_run_the_driver_from_install_sh() -> None:
    """node.enabled=false: the nodes run `crihook dra` from crihook-dra.service, with credentials of
    their own, which the ClusterRole is for; claims still need the DeviceClass."""
    docs = helm.rendered("dra-no-node")
    assert [c["metadata"]["name"] for c in helm.of_kind(docs, "DeviceClass")] == [dra.DEVICE_CLASS]
    # the role to bind to the nodes' identity, and nothing that runs or binds in the cluster
    assert [
        (d["kind"], d["metadata"]["name"]) for d in (d for _, d in docs) if d["metadata"]["name"].endswith("-dra")
    ] == [("ClusterRole", "crihook-dra")]


def test_nothing_of_dra_for_a_cluster_without_it_or_by_default() -> None:
    assert not helm.of_kind(helm.rendered("dra", helm.OLDEST), "DeviceClass")
    assert not helm.of_kind(helm.rendered("defaults"), "DeviceClass")


def test_dra_convert_is_the_schedulers_flags_and_a_webhook_of_its_own() -> None:
    """dra.convert passes --dra-convert (and the pool and GPU memory) to the scheduler, which the
    scheduler's own parser takes, and adds /mutate-dra; off, neither is there."""
    from crihook.cli import scheduler as scheduler_cli

    def scheduler_args(name: str) -> argparse.Namespace:
        docs = helm.rendered(name)
        (c,) = [
            c
            for d in helm.of_kind(docs, "Deployment")
            for c in d["spec"]["template"]["spec"]["containers"]
            if (c.get("args") or [""])[0] == "scheduler"
        ]
        parser = argparse.ArgumentParser()
        scheduler_cli.add_arguments(parser)
        return parser.parse_args(c["args"][1:])

    def mutating(name: str) -> list[str]:
        (config,) = helm.of_kind(helm.rendered(name), "MutatingWebhookConfiguration")
        return [w["clientConfig"]["service"]["path"] for w in config["webhooks"]]

    on = scheduler_args("dra-convert")
    assert (on.dra_convert, on.dra_pool, on.dra_gpu_memory) == (True, "pool=dra", "80Gi")
    assert mutating("dra-convert") == ["/mutate", "/mutate-dra"]
    off = scheduler_args("dra")
    assert (off.dra_convert, off.dra_pool, off.dra_gpu_memory) == (False, "", "0")
    assert mutating("dra") == ["/mutate"]


def test_the_notes_say_how_nodes_without_node_pods_run_the_driver() -> None:
    values = helm.values_args({"node": {"enabled": False}, "dra": {"enabled": True}})
    out = helm.run("install", "crihook", str(helm.CHART), "--dry-run=client", "--namespace", "crihook", *values)
    notes = out.stdout.split("NOTES:", 1)[1]
    assert "install.sh --dra" in notes and "ClusterRole crihook-dra" in notes
