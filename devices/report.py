"""What the device reporter publishes, as a pure function of what discovery found, and the smallest
writes that bring the API server's objects there. No I/O here: devices/reporter.py does the calls.

Published: Koordinator's `Device` (scheduling.koordinator.sh/v1alpha1, cluster-scoped, named after
the node, owned by the Node), the GPU labels on Device and Node, and the node's extended resources.
Only the labels, annotations and resources listed here are ours; everything else on the objects
(other controllers' labels, kubelet's resources) is left as found.
"""

from __future__ import annotations

import copy
import json
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from crihook.base import allocation as al
from crihook.base import quantity
from crihook.devices import partitions
from crihook.devices.checkpoint import PodDeviceEntry, base_device_id, gpu_device_ids
from crihook.devices.nvml import GpuInfo, NodeGpus
from crihook.devices.rdma import RdmaNic

GROUP = "scheduling.koordinator.sh"
VERSION = "v1alpha1"
PLURAL = "devices"
KIND = "Device"
API_VERSION = f"{GROUP}/{VERSION}"

LABEL_VENDOR = "node.koordinator.sh/gpu-vendor"
LABEL_MODEL = "node.koordinator.sh/gpu-model"
LABEL_DRIVER = "node.koordinator.sh/gpu-driver-version"
GPU_LABELS = (LABEL_VENDOR, LABEL_MODEL, LABEL_DRIVER)
# the fields of a device entry the reporter writes (those it leaves out are absent), and its labels
OUR_ENTRY_FIELDS = frozenset({"type", "id", "minor", "health", "resources", "topology", "vfGroups", "labels"})
OUR_DEVICE_LABELS = (al.MIG_MODE_LABEL,)
VENDOR = "nvidia"
TOPOLOGY_ANNOTATION = "gpu.crihook.io/topology"
CHECKPOINT_ANNOTATION = "node.koordinator.sh/devices-checkpoints"
NODE_RESOURCES = (al.GPU_CORE, al.GPU_MEMORY, al.GPU_MEMORY_RATIO, al.GPU_SHARED, al.RDMA, al.NVIDIA_GPU)
FULL = 100  # a whole device, in the percent units of gpu-core, gpu-memory-ratio and rdma
# device-plugin resources whose checkpoint entries hold GPUs
GPU_PLUGIN_RESOURCES = re.compile(r"nvidia\.com/(gpu|gpu\.shared|mig-.+)\Z")

_LABEL_BAD = re.compile(r"[^A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class Observed:
    """One round of discovery."""

    gpus: NodeGpus
    nics: Sequence[RdmaNic] = ()
    # device-plugin checkpoint entries; None when the checkpoint could not be read (keep what is published)
    plugin_entries: Sequence[PodDeviceEntry] | None = ()
    partition_table: Mapping[str, list[partitions.Partition]] | None = None  # the operator's, from config
    # resources a device plugin has registered with kubelet (the checkpoint's RegisteredDevices);
    # None when the checkpoint could not be read
    plugin_resources: frozenset[str] | None = frozenset()


@dataclass(frozen=True)
class Desired:
    """Our part of the objects. A label or annotation mapped to None must be absent; one not listed
    is left as it is."""

    spec: dict[str, Any]
    status: dict[str, Any]
    labels: dict[str, str | None]
    annotations: dict[str, str | None]
    node_resources: dict[str, int]
    problems: list[str] = field(default_factory=list)  # things to log; the report still goes out


def label_value(text: str) -> str:
    """`text` as a label value: NVML's product name without the vendor, e.g. "H100-80GB-HBM3"."""
    text = re.sub(r"^NVIDIA\s+", "", text.strip())
    value = _LABEL_BAD.sub("-", text)[:63]
    return re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", value)


def _compact(doc: Any) -> str:
    return json.dumps(doc, separators=(",", ":"))


def _topology(socket: int, node: int, pcie: str, bus: str) -> dict[str, Any]:
    return {"socketID": socket, "nodeID": node, "pcieID": pcie, "busID": bus}


def _whole(g: GpuInfo) -> bool:
    """Published as healthy: the scheduler may give it whole. A GPU in MIG mode runs CUDA only in its
    MIG devices, which NVIDIA's device plugin gives out (nvidia.com/mig-*), so it is not."""
    return g.healthy and not g.mig_enabled


def plugin_entries_json(entries: Iterable[PodDeviceEntry], gpus: NodeGpus) -> list[dict[str, Any]]:
    """Koordinator's PodDevicesEntry list for GPUs held through the device plugin, plus `minors`:
    the entry's device ids (GPU or MIG device, by UUID or by index) resolved to the GPUs they are or
    are part of, so the scheduler needs no id mapping of its own."""
    by_id = {i: g.minor for g in gpus.gpus for i in gpu_device_ids(g.index, g.uuid, g.mig_devices)}
    out = []
    for e in entries:
        if not GPU_PLUGIN_RESOURCES.match(e.resource_name):
            continue
        ids = list(e.device_ids)
        minors = sorted({by_id[d] for d in map(base_device_id, ids) if d in by_id})
        out.append(
            {
                "podUID": e.pod_uid,
                "containerName": e.container_name,
                "resourceName": e.resource_name,
                "deviceIDs": ids,
                "minors": minors,
            }
        )
    return sorted(out, key=lambda x: (x["podUID"], x["containerName"], x["resourceName"]))


def desired(obs: Observed) -> Desired:
    gpus = sorted(obs.gpus.gpus, key=lambda g: g.minor)
    devices: list[dict[str, Any]] = []
    for g in gpus:
        entry: dict[str, Any] = {
            "type": al.GPU,
            "id": g.uuid,
            "minor": g.minor,
            "health": _whole(g),
            "resources": {
                al.GPU_CORE: str(FULL),
                al.GPU_MEMORY: quantity.format_bytes(g.memory_total),
                al.GPU_MEMORY_RATIO: str(FULL),
            },
            "topology": _topology(g.socket, g.numa_node, g.pcie_root, g.pci_bus_id),
        }
        if g.mig_enabled:  # why it is not healthy, for the extender's message
            entry["labels"] = {al.MIG_MODE_LABEL: al.MIG_ENABLED}
        devices.append(entry)
    for minor, nic in enumerate(obs.nics):
        entry = {
            "type": al.RDMA_TYPE,
            "id": nic.pci_address,
            "minor": minor,
            "health": nic.healthy,
            "resources": {al.RDMA: str(FULL)},
            "topology": _topology(nic.socket, nic.numa_node, nic.pcie_root, nic.pci_address),
        }
        if nic.vfs:
            entry["vfGroups"] = [{"vfs": [{"minor": vf.index, "busID": vf.pci_address} for vf in nic.vfs]}]
        devices.append(entry)

    healthy = [g for g in gpus if _whole(g)]
    problems: list[str] = [
        f"GPU minor {g.minor} ({g.uuid}) is in MIG mode: published as not healthy, its MIG devices are the"
        " device plugin's to give"
        for g in gpus
        if g.mig_enabled
    ]
    models = Counter(g.name for g in obs.gpus.gpus)
    model = models.most_common(1)[0][0] if models else ""
    if len(models) > 1:
        problems.append(f"GPUs of several models on one node ({', '.join(sorted(models))}); labelled {model!r}")
    labels: dict[str, str | None] = dict.fromkeys(GPU_LABELS)
    if gpus:
        labels = {LABEL_VENDOR: VENDOR, LABEL_MODEL: label_value(model), LABEL_DRIVER: obs.gpus.driver_version}

    annotations: dict[str, str | None] = {TOPOLOGY_ANNOTATION: None, partitions.ANNOTATION: None}
    topo = obs.gpus.topology
    if gpus and topo is not None:
        annotations[TOPOLOGY_ANNOTATION] = _compact(
            {
                "minors": list(topo.minors),
                "nvlinks": [list(r) for r in topo.nvlinks],
                "nvlinkVersions": [list(r) for r in topo.nvlink_versions],
                "pcie": [list(r) for r in topo.pcie],
                "nvswitch": topo.nvswitch,
            }
        )
        try:
            table = partitions.table_for_node(obs.partition_table, model, topo.minors, topo.nvswitch)
        except partitions.PartitionTableError as e:
            problems.append(f"partition table not published: {e}")
            table = None
        if table is not None and len(models) == 1:
            annotations[partitions.ANNOTATION] = _compact(table)
    if obs.plugin_entries is not None:
        held = plugin_entries_json(obs.plugin_entries, obs.gpus)
        annotations[CHECKPOINT_ANNOTATION] = _compact(held) if held else None

    status: dict[str, Any] = {
        "gpuCount": len(gpus),
        "healthyGPUCount": len(healthy),
        "migGPUCount": sum(1 for g in gpus if g.mig_enabled),
        "gpuModel": model,
        "rdmaCount": len(obs.nics),
    }
    if obs.gpus.reason:
        status["message"] = obs.gpus.reason
    n = len(healthy)
    resources = {
        al.GPU_CORE: FULL * n,
        al.GPU_MEMORY: sum(g.memory_total for g in healthy),
        al.GPU_MEMORY_RATIO: FULL * n,
        al.GPU_SHARED: FULL * n,
        al.RDMA: FULL * sum(1 for nic in obs.nics if nic.healthy),
    }
    # Whole GPUs, so `kubectl describe node` counts nvidia.com/gpu pods, unless a device plugin
    # registered the resource: kubelet then sets it from the plugin's devices at every node status
    # update (pkg/kubelet/nodestatus MachineInfo) and the two writers would fight. Other extended
    # resources kubelet leaves as it finds them.
    if obs.plugin_resources is not None and al.NVIDIA_GPU not in obs.plugin_resources:
        resources[al.NVIDIA_GPU] = n
    return Desired(
        spec={"devices": devices},
        status=status,
        labels=labels,
        annotations=annotations,
        node_resources=resources,
        problems=problems,
    )


# -- diffs against what the API server holds ---------------------------------------------------------


def _apply_meta(meta: dict[str, Any], key: str, wanted: Mapping[str, str | None]) -> None:
    values = dict(meta.get(key) or {})
    for k, v in wanted.items():
        if v is None:
            values.pop(k, None)
        else:
            values[k] = v
    if values:
        meta[key] = values
    else:
        meta.pop(key, None)


def owner_reference(node_name: str, node_uid: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "name": node_name, "uid": node_uid}


def device_object(
    node_name: str, node_uid: str, want: Desired, current: Mapping[str, Any] | None
) -> dict[str, Any] | None:
    """The Device to write (POST when `current` is None, else PUT, carrying its resourceVersion),
    or None when `current` already says everything `want` says. `status` is written separately."""
    obj: dict[str, Any] = (
        copy.deepcopy(dict(current))
        if current is not None
        else {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": node_name}}
    )
    obj.pop("status", None)
    meta = obj.setdefault("metadata", {})
    _apply_meta(meta, "labels", want.labels)
    _apply_meta(meta, "annotations", want.annotations)
    refs = [
        r for r in meta.get("ownerReferences") or [] if not (r.get("kind") == "Node" and r.get("apiVersion") == "v1")
    ]
    meta["ownerReferences"] = [owner_reference(node_name, node_uid), *refs]
    obj["spec"] = _keep_others(want.spec, current)
    if current is not None:
        before = {k: v for k, v in current.items() if k != "status"}
        before.setdefault("metadata", {})
        if before == obj:
            return None
    return obj


def _keep_others(spec: Mapping[str, Any], current: Mapping[str, Any] | None) -> dict[str, Any]:
    """`spec` with what others wrote into its device entries kept: the fields we do not write
    (Koordinator's `conditions`, say) and the labels that are not ours, of the entry with the same
    type, minor and id (a GPU swapped in at the same minor starts bare). The rest of the current spec
    is replaced."""
    out = copy.deepcopy(dict(spec))
    entries = ((current or {}).get("spec") or {}).get("devices")
    if not isinstance(entries, list):
        return out
    found = {
        (e["type"], e["minor"], e["id"]): e
        for e in entries
        if isinstance(e, dict) and all(isinstance(e.get(k), str | int) for k in ("type", "minor", "id"))
    }
    for entry in out.get("devices", ()):
        before = found.get((entry["type"], entry["minor"], entry["id"]))
        if before is None:
            continue
        for key, value in before.items():
            if key not in OUR_ENTRY_FIELDS:
                entry[key] = copy.deepcopy(value)
        theirs = before.get("labels")
        if isinstance(theirs, dict):
            labels = {k: v for k, v in theirs.items() if k not in OUR_DEVICE_LABELS} | entry.get("labels", {})
            if labels:
                entry["labels"] = labels
    return out


def status_changed(current: Mapping[str, Any] | None, want: Desired) -> bool:
    return current is None or (current.get("status") or {}) != want.status


def node_label_patch(node: Mapping[str, Any], want: Desired) -> dict[str, Any] | None:
    """A merge patch of the node's labels, or None when they already agree."""
    labels = (node.get("metadata") or {}).get("labels") or {}
    change = {k: v for k, v in want.labels.items() if labels.get(k) != v}
    return {"metadata": {"labels": change}} if change else None


def _same_quantity(current: Any, wanted: int) -> bool:
    try:
        return quantity.parse(current) == wanted
    except quantity.QuantityError:
        return False


def node_status_patch(node: Mapping[str, Any], want: Desired) -> dict[str, Any] | None:
    """A merge patch of the node's capacity and allocatable, or None when they already agree. The
    API server rewrites quantities in canonical form ("85520809984" may come back as "83516416Ki"),
    so values are compared as numbers. A resource we would set to 0 that the node does not list is
    left unlisted."""
    status = node.get("status") or {}
    patch: dict[str, dict[str, str]] = {}
    for section in ("capacity", "allocatable"):
        have = status.get(section) or {}
        change = {
            k: str(v)
            for k, v in want.node_resources.items()
            if not (k not in have and v == 0) and not (k in have and _same_quantity(have[k], v))
        }
        if change:
            patch[section] = change
    return {"status": patch} if patch else None
