"""The GPU hook's decision, without I/O: what one container ends up with, and every refusal."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crihook.base import allocation as al
from crihook.base.spec import Device, Mount
from crihook.devices.checkpoint import Checkpoint, parse_checkpoint
from crihook.hooks.base import ContainerInfo, Edit, HookContext, HookError, PodInfo, Stage
from crihook.hooks.edit import apply_edit
from crihook.hooks.gpu_edit import (
    ISOLATION_LABEL,
    GpuOptions,
    NodeView,
    Placements,
    SeenPod,
    brings_devices,
    gpu_edit,
    plain_grant,
)
from crihook.hooks.grant import HamiCore
from crihook.hooks.reach import DeviceNode
from crihook.hooks.scheduled import scheduled
from tests.support.gpu_fixtures import Entry, Gpu, Inventory, alloc_resp, checkpoint_doc, gpus, nvidia_plugin_resp

POD_UID = "11111111-2222-3333-4444-555555555555"
OTHER_UID = "99999999-8888-7777-6666-555555555555"
BOX = gpus(4, minor_offset=2)  # minors 2..5, index = minor - 2, bus order reversed
MiB = 1 << 20
DEFAULTS = GpuOptions()


def pod(annotations: Mapping[str, str] | None = None, labels: Mapping[str, str] | None = None) -> PodInfo:
    return PodInfo("train", "ml", POD_UID, labels=dict(labels or {}), annotations=dict(annotations or {}))


def container(name: str = "cuda", **kw: Any) -> ContainerInfo:
    return ContainerInfo(name, **kw)


def allocated(*minors: int, **resources: Any) -> dict[str, str]:
    return {
        al.DEVICE_ALLOCATED: json.dumps(
            {
                "gpu": [
                    {
                        "minor": m,
                        "resources": {"koordinator.sh/" + k.replace("_", "-"): v for k, v in resources.items()},
                    }
                    for m in minors
                ]
            }
        )
    }


def node(
    entries: Iterable[Entry] = (),
    *,
    present: Iterable[str] | None = None,
    live: Iterable[str] = (POD_UID, OTHER_UID),
    checkpoint: Checkpoint | None = None,
) -> NodeView:
    names = (
        set(present)
        if present is not None
        else {f"nvidia{g.minor}" for g in BOX}
        | {
            "nvidiactl",
            "nvidia-uvm",
            "nvidia-uvm-tools",
        }
    )
    cp = checkpoint if checkpoint is not None else parse_checkpoint(json.dumps(checkpoint_doc(entries)).encode())
    live_set = set(live)
    return NodeView(cp, lambda path: path.removeprefix("/dev/") in names, live_set.__contains__)


def run(
    p: PodInfo,
    c: ContainerInfo | None = None,
    n: NodeView | None = None,
    opts: GpuOptions = DEFAULTS,
    inventory: Sequence[Gpu] = BOX,
) -> Edit | None:
    return gpu_edit(p, c or container(), Inventory(inventory), n or node(), opts)


def refused(code: grpc.StatusCode, pattern: str, *args: Any, **kwargs: Any) -> HookError:
    with pytest.raises(HookError) as info:
        run(*args, **kwargs)
    assert info.value.code == code
    assert re.search(pattern, info.value.reason), info.value.reason
    return info.value


def final(p: PodInfo, c: ContainerInfo, edit: Edit | None) -> ContainerInfo:
    ctx = HookContext(Stage.PRE_CREATE_CONTAINER, p, c)
    return (apply_edit(ctx, edit) if edit is not None else ctx).container  # type: ignore[return-value]


def devices(c: ContainerInfo) -> list[str]:
    return [d.host_path for d in c.devices]


# -- containers without an allocation ---------------------------------------------------------------

LEAKY = container(
    envs=(("NVIDIA_VISIBLE_DEVICES", "all"), ("PATH", "/bin")),
    devices=(
        Device("/dev/nvidia3", "/dev/nvidia3"),
        Device("/dev/gpu", "/dev/nvidia4"),  # renamed inside: caught by its host path
        Device("/dev/fuse", "/dev/fuse"),
        Device("/dev/nvidiactl", "/dev/nvidiactl"),
    ),
    cdi_devices=("nvidia.com/gpu=all", "vendor.example/fpga=0"),
)


def test_no_allocation_gets_void_and_loses_gpu_nodes() -> None:
    p = pod()
    edit = run(p, LEAKY)
    assert edit is not None
    after = final(p, LEAKY, edit)
    assert after.env("NVIDIA_VISIBLE_DEVICES") == "void"
    assert after.env("PATH") == "/bin"
    assert devices(after) == ["/dev/fuse", "/dev/nvidiactl"]
    assert after.cdi_devices == ("vendor.example/fpga=0",)


def test_no_allocation_plain_container_still_gets_void() -> None:
    # An image's NVIDIA_VISIBLE_DEVICES=all is not in the CRI request: void must be set regardless.
    edit = run(pod(), container())
    assert edit is not None
    assert edit.env == {"NVIDIA_VISIBLE_DEVICES": "void"}
    assert not (edit.remove_devices or edit.remove_env or edit.add_devices or edit.remove_cdi_devices)


def test_deny_unallocated_off_leaves_the_container_alone() -> None:
    assert run(pod(), LEAKY, opts=GpuOptions(deny_unallocated=False)) is None


def test_device_plugin_allocation_stands_without_the_scheduler() -> None:
    n = node([Entry(POD_UID, "cuda", [BOX[0].uuid], resp=nvidia_plugin_resp(BOX[:1]))])
    assert run(pod(), container(), n) is None


def test_other_containers_plugin_entries_do_not_count() -> None:
    n = node([Entry(POD_UID, "sidecar", [BOX[0].uuid]), Entry(OTHER_UID, "cuda", [BOX[1].uuid])])
    edit = run(pod(), container(), n)
    assert edit is not None and edit.env["NVIDIA_VISIBLE_DEVICES"] == "void"


def test_other_device_types_do_not_count_as_a_gpu_allocation() -> None:
    n = node([Entry(POD_UID, "cuda", ["mlx5_0"], resource="rdma/hca")])
    p = pod({al.DEVICE_ALLOCATED: '{"rdma":[{"minor":0,"id":"0000:09:00.0"}]}'})
    edit = run(p, container(), n)
    assert edit is not None and edit.env["NVIDIA_VISIBLE_DEVICES"] == "void"


# -- containers with an allocation ------------------------------------------------------------------


def test_allocated_gpus_by_uuid_in_bus_order_with_nodes() -> None:
    p = pod(allocated(2, 4))
    edit = run(p, LEAKY)
    assert edit is not None
    after = final(p, LEAKY, edit)
    # BOX[2] (minor 4) sits lower on the bus than BOX[0] (minor 2)
    assert after.env("NVIDIA_VISIBLE_DEVICES") == f"{BOX[2].uuid},{BOX[0].uuid}"
    # /dev/nvidia3 goes; /dev/gpu is GPU minor 4 by its numbers, one of the chosen: it stays
    assert devices(after) == [
        "/dev/nvidia4",
        "/dev/fuse",
        "/dev/nvidia4",
        "/dev/nvidia2",
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
    ]
    assert [d.container_path for d in after.devices][2:4] == ["/dev/nvidia4", "/dev/nvidia2"]
    assert all(d.permissions == "rw" for d in edit.add_devices)
    assert after.cdi_devices == ("vendor.example/fpga=0",)


def test_control_nodes_only_where_present() -> None:
    n = node(present=["nvidia2", "nvidiactl"])
    edit = run(pod(allocated(2)), container(), n)
    assert edit is not None
    assert [d.host_path for d in edit.add_devices] == ["/dev/nvidia2", "/dev/nvidiactl"]


def test_dev_root_is_the_host_side_only() -> None:
    seen: list[str] = []
    n = NodeView(Checkpoint(), lambda path: seen.append(path) or True, lambda uid: True)
    edit = run(pod(allocated(3)), container(), replace(n, dev_root="/run/test/dev"))
    assert edit is not None
    assert edit.add_devices[0] == Device("/dev/nvidia3", "/run/test/dev/nvidia3", "rw")
    assert all(path.startswith("/run/test/dev/") for path in seen)


def test_annotation_id_confirmed_by_nvml() -> None:
    text = json.dumps({"gpu": [{"minor": 3, "id": BOX[1].uuid}]})
    edit = run(pod({al.DEVICE_ALLOCATED: text}))
    assert edit is not None and edit.env["NVIDIA_VISIBLE_DEVICES"] == BOX[1].uuid


def test_plugin_injections_are_replaced() -> None:
    resp = alloc_resp(
        envs={"NVIDIA_VISIBLE_DEVICES": BOX[3].uuid, "NVIDIA_DRIVER_CAPABILITIES": "all"},
        devices=[("/dev/nvidia5", "/dev/nvidia5"), ("/dev/nvidia-caps/cap1", "/dev/nvidia-caps/cap1")],
        mounts=[("/usr/bin/nvidia-smi", "/host/nvidia-smi")],
        cdi=["nvidia.com/gpu=" + BOX[3].uuid, "k8s.device-plugin.nvidia.com/gpu=5"],
    )
    c = container(
        envs=(("NVIDIA_VISIBLE_DEVICES", BOX[3].uuid), ("NVIDIA_DRIVER_CAPABILITIES", "all"), ("HOME", "/root")),
        devices=(Device("/dev/nvidia5", "/dev/nvidia5"), Device("/dev/nvidia-caps/cap1", "/dev/nvidia-caps/cap1")),
        mounts=(Mount("/usr/bin/nvidia-smi", "/host/nvidia-smi", True), Mount("/data", "/srv/data")),
        cdi_devices=("nvidia.com/gpu=" + BOX[3].uuid, "k8s.device-plugin.nvidia.com/gpu=5"),
    )
    n = node([Entry(POD_UID, "cuda", [BOX[3].uuid], resp=resp), Entry(POD_UID, "cuda", ["x"], resource="rdma/hca")])
    p = pod(allocated(2))
    edit = run(p, c, n)
    assert edit is not None
    assert edit.remove_env == {"NVIDIA_DRIVER_CAPABILITIES"}
    assert edit.remove_mounts == {"/usr/bin/nvidia-smi"}
    assert edit.remove_devices == {"/dev/nvidia5", "/dev/nvidia-caps/cap1"}
    after = final(p, c, edit)
    assert after.envs == (("HOME", "/root"), ("NVIDIA_VISIBLE_DEVICES", BOX[0].uuid))
    assert after.mounts == (Mount("/data", "/srv/data"),)
    assert devices(after)[0] == "/dev/nvidia2"
    assert after.cdi_devices == ()


def test_undecodable_plugin_response_for_this_container_fails() -> None:
    cp = parse_checkpoint(
        json.dumps(
            {
                "Data": {
                    "PodDeviceEntries": [
                        {
                            "PodUID": POD_UID,
                            "ContainerName": "cuda",
                            "ResourceName": "nvidia.com/gpu",
                            "AllocResp": "%%%",
                        }
                    ]
                }
            }
        ).encode()
    )
    refused(
        grpc.StatusCode.FAILED_PRECONDITION,
        r"can not tell what the device plugin injected for nvidia.com/gpu: .*AllocResp",
        pod(allocated(2)),
        n=node(checkpoint=cp),
    )


def test_cdi_mode() -> None:
    p = pod(allocated(2, 5))
    edit = run(p, LEAKY, opts=GpuOptions(inject="cdi"))
    assert edit is not None
    after = final(p, LEAKY, edit)
    assert after.env("NVIDIA_VISIBLE_DEVICES") == "void"
    assert after.cdi_devices == (
        "vendor.example/fpga=0",
        f"nvidia.com/gpu={BOX[3].uuid}",
        f"nvidia.com/gpu={BOX[0].uuid}",
    )
    assert devices(after) == ["/dev/fuse", "/dev/nvidiactl"]


def test_cdi_mode_does_not_need_device_nodes() -> None:
    edit = run(pod(allocated(2)), n=node(present=[]), opts=GpuOptions(inject="cdi"))
    assert edit is not None and edit.add_cdi_devices == [f"nvidia.com/gpu={BOX[0].uuid}"]


def test_per_container_assignment() -> None:
    ann = allocated(2, 3, 4) | {
        al.CONTAINER_DEVICES: al.format_container_devices({"a": {"gpu": [3]}, "b": {"gpu": [2, 4]}})
    }
    p = pod(ann)
    edit_a, edit_b, edit_init = run(p, container("a")), run(p, container("b")), run(p, container("init"))
    assert edit_a is not None and edit_a.env["NVIDIA_VISIBLE_DEVICES"] == BOX[1].uuid
    assert edit_b is not None and edit_b.env["NVIDIA_VISIBLE_DEVICES"] == f"{BOX[2].uuid},{BOX[0].uuid}"
    assert edit_init is not None and edit_init.env == {"NVIDIA_VISIBLE_DEVICES": "void"}


def test_scheduler_word_beats_the_plugin_for_a_container_it_gave_nothing() -> None:
    ann = allocated(2) | {al.CONTAINER_DEVICES: '{"a":{"gpu":[2]}}'}
    n = node([Entry(POD_UID, "b", [BOX[3].uuid], resp=nvidia_plugin_resp(BOX[3:]))])
    c = container(
        "b", envs=(("NVIDIA_VISIBLE_DEVICES", BOX[3].uuid),), devices=(Device("/dev/nvidia5", "/dev/nvidia5"),)
    )
    edit = run(pod(ann), c, n)
    assert edit is not None
    assert edit.env == {"NVIDIA_VISIBLE_DEVICES": "void"}
    assert edit.remove_devices == {"/dev/nvidia5"}


# -- refusals ---------------------------------------------------------------------------------------


def test_malformed_annotation() -> None:
    err = refused(
        grpc.StatusCode.INVALID_ARGUMENT,
        r"^annotation scheduling.koordinator.sh/device-allocated: gpu\[0\].minor: expected an integer",
        pod({al.DEVICE_ALLOCATED: '{"gpu":[{"minor":"2"}]}'}),
    )
    assert "device-allocated" in str(err)


def test_unparseable_annotation() -> None:
    refused(grpc.StatusCode.INVALID_ARGUMENT, r"device-allocated: not valid JSON", pod({al.DEVICE_ALLOCATED: "{gpu"}))


def test_malformed_container_map() -> None:
    refused(
        grpc.StatusCode.INVALID_ARGUMENT,
        r"^annotation gpu.crihook.io/container-devices: cuda.gpu\[0\]: minor 7 is not among",
        pod(allocated(2) | {al.CONTAINER_DEVICES: '{"cuda":{"gpu":[7]}}'}),
    )


def test_malformed_rdma_part_does_not_concern_the_gpu() -> None:
    p = pod({al.DEVICE_ALLOCATED: '{"gpu":[{"minor":2}],"rdma":[{"minor":"x"}]}'})
    edit = run(p)
    assert edit is not None and edit.env["NVIDIA_VISIBLE_DEVICES"] == BOX[0].uuid


def test_unknown_minor() -> None:
    refused(
        grpc.StatusCode.FAILED_PRECONDITION,
        r"^annotation scheduling.koordinator.sh/device-allocated: gpu minor 9: no such GPU on this node$",
        pod(allocated(2, 9)),
    )


def test_unknown_uuid() -> None:
    text = json.dumps({"gpu": [{"minor": 2, "id": "GPU-forged"}]})
    refused(
        grpc.StatusCode.FAILED_PRECONDITION,
        r"gpu minor 2: no GPU GPU-forged on this node",
        pod({al.DEVICE_ALLOCATED: text}),
    )


def test_uuid_of_another_minor() -> None:
    text = json.dumps({"gpu": [{"minor": 2, "id": BOX[1].uuid}]})
    refused(
        grpc.StatusCode.INVALID_ARGUMENT,
        rf"gpu minor 2 is {BOX[0].uuid} on this node, not {BOX[1].uuid} \(that is minor 3\)",
        pod({al.DEVICE_ALLOCATED: text}),
    )


def test_missing_device_node() -> None:
    refused(
        grpc.StatusCode.FAILED_PRECONDITION,
        r"device node /dev/nvidia3 of minor 3 is missing on this node",
        pod(allocated(2, 3)),
        n=node(present=["nvidia2", "nvidiactl"]),
    )


MIG_UUID = "MIG-5d2f0c3e-7a41-5b6e-9f0a-3c1d2e4f5a6b"
# BOX with minor 2 in MIG mode, one MIG device in slot 1
MIG_BOX = [replace(BOX[0], mig_enabled=True, mig_devices=((1, MIG_UUID),)), *BOX[1:]]


def test_a_gpu_in_mig_mode_is_not_given_whole() -> None:
    refused(
        grpc.StatusCode.FAILED_PRECONDITION,
        rf"gpu minor 2 \({BOX[0].uuid}\) is in MIG mode on this node: it can not be given whole, its MIG devices"
        r" are the device plugin's \(nvidia.com/mig-\*\)$",
        pod(allocated(3, 2)),
        inventory=MIG_BOX,
    )
    assert run(pod(allocated(3)), inventory=MIG_BOX) is not None


@pytest.mark.parametrize("device_id", [BOX[1].uuid, BOX[1].uuid + "::3", str(BOX[1].index)])
def test_gpu_held_by_another_live_pod(device_id: str) -> None:
    n = node([Entry(OTHER_UID, "trainer", [device_id])])
    refused(
        grpc.StatusCode.FAILED_PRECONDITION,
        rf"GPU minor 3 \({BOX[1].uuid}\) is held by live pod {OTHER_UID} container trainer through the device "
        r"plugin \(nvidia.com/gpu, kubelet checkpoint\)",
        pod(allocated(3)),
        n=n,
    )


def test_gpu_held_by_a_pod_that_is_gone_is_free() -> None:
    n = node([Entry(OTHER_UID, "trainer", [BOX[1].uuid])], live=[POD_UID])
    edit = run(pod(allocated(3)), n=n)
    assert edit is not None and edit.env["NVIDIA_VISIBLE_DEVICES"] == BOX[1].uuid


def test_liveness_is_asked_only_on_a_match() -> None:
    asked: list[str] = []
    cp = parse_checkpoint(json.dumps(checkpoint_doc([Entry(OTHER_UID, "x", [BOX[0].uuid])])).encode())
    n = NodeView(cp, lambda path: True, lambda uid: asked.append(uid) or True)
    assert run(pod(allocated(3)), n=n) is not None
    assert asked == []


def test_other_gpus_and_own_pod_do_not_conflict() -> None:
    n = node([Entry(OTHER_UID, "x", [BOX[0].uuid]), Entry(POD_UID, "cuda", [BOX[1].uuid])])
    edit = run(pod(allocated(3)), n=n)
    assert edit is not None and edit.env["NVIDIA_VISIBLE_DEVICES"] == BOX[1].uuid


# -- HAMi-core --------------------------------------------------------------------------------------

HAMI = {"koordinator.sh/gpu-isolation-provider": "HAMi-core"}


def test_hami_core_limits_and_mounts() -> None:
    ann = {
        al.DEVICE_ALLOCATED: json.dumps(
            {
                "gpu": [
                    {"minor": 2, "resources": {al.GPU_CORE: "50", al.GPU_MEMORY: "8Gi", al.GPU_MEMORY_RATIO: "50"}},
                    {"minor": 4, "resources": {al.GPU_CORE: 30, al.GPU_MEMORY_RATIO: 25}},
                ]
            }
        )
    }
    p = pod(ann, HAMI)
    edit = run(p)
    assert edit is not None
    # bus order: minor 4 (index 2) first, then minor 2
    assert edit.env == {
        "NVIDIA_VISIBLE_DEVICES": f"{BOX[2].uuid},{BOX[0].uuid}",
        "CUDA_DEVICE_MEMORY_LIMIT_0": f"{(16 << 30) // 4 // MiB}m",
        "CUDA_DEVICE_MEMORY_LIMIT_1": "8192m",
        "CUDA_DEVICE_SM_LIMIT": "30",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": "/tmp/vgpu/cudevshr.cache",
    }
    assert edit.add_mounts == [
        Mount("/usr/local/vgpu/libvgpu.so", "/usr/local/vgpu/libvgpu.so", readonly=True),
        Mount("/etc/ld.so.preload", "/usr/local/vgpu/ld.so.preload", readonly=True),
        Mount("/tmp/vgpu", f"/var/lib/crihook/hami-core/containers/{POD_UID}_cuda"),
        Mount("/tmp/vgpulock", "/var/lib/crihook/hami-core/lock"),
    ]


def test_hami_core_paths_from_config() -> None:
    paths = HamiCore(
        library="/opt/hami/lib.so", preload_file="/opt/hami/preload", cache_root="/var/cache/h", lock_dir=""
    )
    edit = run(
        pod(allocated(2, gpu_memory_ratio=50), {"koordinator.sh/gpu-isolation-provider": "hami-core"}),
        opts=GpuOptions(hami_core=paths),
    )
    assert edit is not None
    assert [(m.container_path, m.host_path) for m in edit.add_mounts] == [
        ("/opt/hami/lib.so", "/opt/hami/lib.so"),
        ("/etc/ld.so.preload", "/opt/hami/preload"),
        ("/tmp/vgpu", f"/var/cache/h/{POD_UID}_cuda"),
    ]
    assert edit.env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "8192m"
    assert edit.env["CUDA_DEVICE_SM_LIMIT"] == "100"


@pytest.mark.parametrize(
    ("labels", "resources"),
    [
        (HAMI, {"gpu_core": 100, "gpu_memory_ratio": 100, "gpu_memory": "16Gi"}),  # a whole GPU
        ({}, {"gpu_core": 50, "gpu_memory_ratio": 50}),  # shared, but nobody asked for isolation
        ({"koordinator.sh/gpu-isolation-provider": "other"}, {"gpu_memory_ratio": 50}),
    ],
)
def test_no_hami_core(labels: dict[str, str], resources: dict[str, Any]) -> None:
    edit = run(pod(allocated(2, **resources), labels))
    assert edit is not None
    assert list(edit.env) == ["NVIDIA_VISIBLE_DEVICES"] and edit.add_mounts == []


@pytest.mark.parametrize("resources", [{"gpu_core": 50}, {"gpu_memory": "4Gi"}, {"gpu_memory_ratio": 99}])
def test_what_counts_as_shared(resources: dict[str, Any]) -> None:
    edit = run(pod(allocated(2, **resources), HAMI))
    assert edit is not None and "CUDA_DEVICE_SM_LIMIT" in edit.env


def test_hami_core_refuses_a_uid_that_is_not_a_path_part() -> None:
    p = replace(pod(allocated(2, gpu_memory_ratio=50), HAMI), uid="../../etc")
    refused(grpc.StatusCode.INVALID_ARGUMENT, r"pod UID '../../etc' can not name a cache directory", p)


# -- properties -------------------------------------------------------------------------------------

minor_lists = st.lists(st.integers(min_value=0, max_value=8), max_size=4, unique=True)
CDI_NAMES = [
    "nvidia.com/gpu=all",
    "nvidia.com/gpu=1",
    f"k8s.device-plugin.nvidia.com/gpu={BOX[2].uuid}",
    "nvidia.com/gpu=0:0",
    "x.io/y=1",
]


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[PodInfo, ContainerInfo, NodeView]:
    minors = draw(minor_lists)
    ann: dict[str, str] = {}
    if draw(st.booleans()):
        ann[al.DEVICE_ALLOCATED] = json.dumps({"gpu": [{"minor": m} for m in minors]})
    if draw(st.booleans()):
        ann[al.CONTAINER_DEVICES] = json.dumps(
            {"cuda": {"gpu": draw(st.lists(st.sampled_from(minors or [0]), unique=True))}}
        )
    if draw(st.booleans()):
        ann[al.DEVICE_ALLOCATED] = draw(st.text(max_size=40))
    own = [f"/dev/nvidia{m}" for m in draw(minor_lists)]
    c = container(
        envs=(("NVIDIA_VISIBLE_DEVICES", draw(st.sampled_from(["all", "0", "none", ""]))),),
        devices=(*(Device(path, path) for path in own), Device("/dev/fuse", "/dev/fuse")),
        cdi_devices=tuple(draw(st.lists(st.sampled_from(["nvidia.com/gpu=all", "nvidia.com/gpu=0", "x.io/y=1"])))),
        annotations={
            "cdi.k8s.io/any": ",".join(draw(st.lists(st.sampled_from(CDI_NAMES), min_size=1))),
        },
    )
    holders = [
        Entry(draw(st.sampled_from([POD_UID, OTHER_UID])), "cuda", [g.uuid])
        for g in draw(st.lists(st.sampled_from(BOX), max_size=2))
    ]
    n = node(holders, live=draw(st.sampled_from([[POD_UID], [POD_UID, OTHER_UID]])))
    return pod(ann), c, n


@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)  # node() parses a checkpoint per example
@given(scenarios(), st.sampled_from(["env+devices", "cdi"]))
def test_a_container_never_reaches_a_gpu_it_was_not_given(
    scenario: tuple[PodInfo, ContainerInfo, NodeView], inject: str
) -> None:
    p, c, n = scenario
    try:
        edit = run(p, c, n, GpuOptions(inject=inject))
    except HookError as e:
        assert e.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
        assert e.reason.startswith("annotation ")
        return
    allocs = al.allocated_to(p.annotations, c.name, "gpu")
    if allocs is None and n.checkpoint.for_container(POD_UID, c.name):
        assert edit is None  # the device plugin's own allocation, untouched
        return
    after = final(p, c, edit)
    given_minors = {a.minor for a in (allocs or ())}
    uuids = {g.uuid for g in BOX if g.minor in given_minors}
    visible = after.env("NVIDIA_VISIBLE_DEVICES")
    assert visible is not None and visible != "all"
    if inject == "cdi" or not given_minors:
        assert visible == "void"
    else:
        assert set(visible.split(",")) == uuids
    nodes = {
        int(d.host_path.removeprefix("/dev/nvidia"))
        for d in after.devices
        if re.fullmatch(r"/dev/nvidia\d+", d.host_path)
    }
    assert nodes == (given_minors if inject == "env+devices" else set())
    cdi = {n.split("=", 1)[1] for n in after.cdi_devices if n.startswith("nvidia.com/gpu=")}
    indices = {str(g.index) for g in BOX if g.minor in given_minors}
    assert cdi <= (uuids | indices if inject == "cdi" else indices)
    if inject == "cdi":
        assert uuids <= cdi
    leftover = after.annotations.get("cdi.k8s.io/any", "")
    named = {n.split("=", 1)[1] for n in leftover.split(",") if "nvidia.com/gpu=" in n}
    assert named <= uuids | indices


# -- CDI: no GPU through a cdi.k8s.io annotation or a CDI_devices entry ----------------------------

PLUGIN_CDI_KEY = "cdi.k8s.io/nvidia-device-plugin_0d7e6a3b"  # NVIDIA's plugin: <prefix>nvidia-device-plugin_<id>


def test_cdi_annotations_lose_the_gpus_not_chosen_and_keep_the_rest() -> None:
    # NVIDIA's plugin with the cdi-annotations strategy: one annotation listing the GPU (by its
    # device-id strategy: uuid or index) and the gds/mofed extras (k8s-device-plugin, getCDIDeviceAnnotations)
    resp = alloc_resp(
        annotations={
            PLUGIN_CDI_KEY: f"k8s.device-plugin.nvidia.com/gpu={BOX[3].uuid},k8s.device-plugin.nvidia.com/gds=all"
        }
    )
    c = container(
        annotations={
            PLUGIN_CDI_KEY: f"k8s.device-plugin.nvidia.com/gpu={BOX[3].uuid},k8s.device-plugin.nvidia.com/gds=all",
            "cdi.k8s.io/from-a-webhook": f"nvidia.com/gpu=all, nvidia.com/gpu={BOX[0].index}",
            "cdi.k8s.io/mine": f"nvidia.com/gpu={BOX[0].uuid},management.nvidia.com/gpu=all",
            "cdi.k8s.io/nic": "vendor.example/nic=eth1",
            "io.kubernetes.container.hash": "1234",
        },
        cdi_devices=(
            f"k8s.device-plugin.nvidia.com/gpu={BOX[3].index}",
            "nvidia.com/gpu=0:1",
            f"nvidia.com/gpu=MIG-{BOX[0].uuid[4:]}",
            f"nvidia.com/gpu={BOX[0].index}",
            "nvidia.com/gds=all",
        ),
    )
    p = pod(allocated(2))  # minor 2 is BOX[0]
    edit = run(p, c, node([Entry(POD_UID, "cuda", [BOX[3].uuid], resp=resp)]))
    assert edit is not None
    after = final(p, c, edit)
    assert after.annotations == {
        PLUGIN_CDI_KEY: "k8s.device-plugin.nvidia.com/gds=all",
        "cdi.k8s.io/from-a-webhook": f" nvidia.com/gpu={BOX[0].index}",
        "cdi.k8s.io/mine": f"nvidia.com/gpu={BOX[0].uuid}",
        "cdi.k8s.io/nic": "vendor.example/nic=eth1",
        "io.kubernetes.container.hash": "1234",
    }
    assert after.cdi_devices == (f"nvidia.com/gpu={BOX[0].index}", "nvidia.com/gds=all")


def test_a_container_without_gpus_loses_every_gpu_cdi_annotation() -> None:
    c = container(
        annotations={"cdi.k8s.io/x": "nvidia.com/gpu=all", "cdi.k8s.io/y": "k8s.device-plugin.nvidia.com/gpu=1"}
    )
    p = pod()
    after = final(p, c, run(p, c))
    assert after.annotations == {} and after.env("NVIDIA_VISIBLE_DEVICES") == "void"


def test_a_plugin_pods_own_cdi_stays() -> None:
    resp = alloc_resp(annotations={PLUGIN_CDI_KEY: f"k8s.device-plugin.nvidia.com/gpu={BOX[1].uuid}"})
    c = container(annotations=dict(resp.annotations))
    assert run(pod(), c, node([Entry(POD_UID, "cuda", [BOX[1].uuid], resp=resp)])) is None


# -- phantom holders: crihook's store says which pods the scheduler placed -------------------------


class Seen:
    def __init__(self, pods: Mapping[str, SeenPod]) -> None:
        self.pods = dict(pods)

    def get(self, uid: str) -> SeenPod | None:
        return self.pods.get(uid)

    def allocated(self) -> list[tuple[str, SeenPod]]:
        return [(uid, p) for uid, p in self.pods.items() if p.allocated]


def seen_node(
    entries: Iterable[Entry], pods: Mapping[str, SeenPod], live: Iterable[str] = (POD_UID, OTHER_UID)
) -> NodeView:
    return replace(node(entries, live=live), pods=Seen(pods))


HOLDS_3 = [Entry(OTHER_UID, "trainer", [BOX[1].uuid])]  # BOX[1] is minor 3


@pytest.mark.parametrize(
    ("other", "counts"),
    [
        (SeenPod(False, containers=frozenset({"trainer"})), True),  # a device-plugin pod, running
        (SeenPod(True, frozenset({2}), frozenset({"trainer"})), False),  # placed by the scheduler: a phantom
        (SeenPod(False, containers=frozenset({"sidecar"})), False),  # its GPU container is not created yet
        (None, False),  # no sandbox yet: it uses nothing; its own CreateContainer is checked
    ],
)
def test_a_holder_counts_only_when_it_is_a_running_plugin_pod(other: SeenPod | None, counts: bool) -> None:
    n = seen_node(HOLDS_3, {OTHER_UID: other} if other else {})
    if counts:
        refused(grpc.StatusCode.FAILED_PRECONDITION, r"held by live pod", pod(allocated(3)), n=n)
        gone = seen_node(HOLDS_3, {OTHER_UID: other} if other else {}, live=[POD_UID])
        assert run(pod(allocated(3)), n=gone) is not None
    else:
        edit = run(pod(allocated(3)), n=n)
        assert edit is not None and edit.env["NVIDIA_VISIBLE_DEVICES"] == BOX[1].uuid


@pytest.mark.parametrize(
    "device_id",
    [
        BOX[0].uuid,
        BOX[0].uuid + "::2",
        str(BOX[0].index),
        # a MIG device of the GPU, by UUID or as `<GPU index>:<slot>` (the plugin's index strategy): the
        # scheduler's pod was placed before the GPU went into MIG mode
        MIG_UUID,
        f"{BOX[0].index}:1::2",
    ],
)
def test_a_plugin_container_may_not_start_on_a_gpu_the_scheduler_gave_away(device_id: str) -> None:
    mine = [Entry(POD_UID, "cuda", [device_id], resp=nvidia_plugin_resp(BOX[:1]))]
    user = SeenPod(True, frozenset({2}), frozenset({"trainer"}))
    refused(
        grpc.StatusCode.FAILED_PRECONDITION,
        rf"the device plugin gave this container GPU minor 2 \({BOX[0].uuid}\), which live pod {OTHER_UID} uses",
        pod(),
        n=seen_node(mine, {OTHER_UID: user}),
        inventory=MIG_BOX,
    )
    for free in (
        {OTHER_UID: replace(user, containers=frozenset())},  # placed, no container yet: first come
        {OTHER_UID: replace(user, minors=frozenset({4}))},
        {},
    ):
        assert run(pod(), n=seen_node(mine, free), inventory=MIG_BOX) is None
    assert run(pod(), n=seen_node(mine, {OTHER_UID: user}, live=[POD_UID]), inventory=MIG_BOX) is None
    # a MIG device of another GPU, or of none on this node
    for other in (f"{BOX[1].index}:1", "MIG-not-on-this-node"):
        theirs = [Entry(POD_UID, "cuda", [other], resp=nvidia_plugin_resp(BOX[:1]))]
        assert run(pod(), n=seen_node(theirs, {OTHER_UID: user}), inventory=MIG_BOX) is None


@st.composite
def plain_cases(draw: st.DrawFn) -> tuple[PodInfo, ContainerInfo, NodeView, bool]:
    """A pod (allocation whole, split, shared or malformed), a container that brings nothing or
    something, a node with or without device-plugin entries, and whether the placement's stamp
    still holds."""
    minors = draw(st.lists(st.sampled_from([g.minor for g in BOX] + [9]), max_size=3, unique=True))
    ann = allocated(*minors, **draw(st.sampled_from([{}, {}, {}, {"gpu_core": 50}])))
    if draw(st.booleans()):
        ann[al.CONTAINER_DEVICES] = json.dumps({"cuda": {"gpu": minors[:1]}})
    if draw(st.sampled_from([False] * 9 + [True])):
        ann[al.DEVICE_ALLOCATED] = "{"
    brings = draw(
        st.sampled_from(
            [
                {},
                {"annotations": {"x": "y"}},  # kubelet's own annotations bring nothing
                {"devices": (Device("/dev/nvidia2", "/dev/nvidia2"),)},
                {"annotations": {"cdi.k8s.io/x": "nvidia.com/gpu=0"}},
            ]
        )
    )
    c = container(draw(st.sampled_from(["cuda", "sidecar"])), **brings)
    holders = [Entry(OTHER_UID, "cuda", [g.uuid]) for g in draw(st.sampled_from([(), (), BOX[1:2]]))]
    n = replace(node(holders), placements=Placements(), stamp=(1, 1))
    labels = draw(st.sampled_from([{}, {ISOLATION_LABEL: "HAMi-core"}]))
    return pod(ann, labels), c, n, draw(st.sampled_from([True, True, False]))


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(plain_cases())
def test_the_plain_grant_is_what_gpu_edit_answers(case: tuple[PodInfo, ContainerInfo, NodeView, bool]) -> None:
    """plain_grant answers exactly where nothing but the placement decides, and then as gpu_edit does."""
    p, c, n, same_stamp = case
    with contextlib.suppress(HookError):
        run(p, c, n)  # places the allocation, as the hook's prepare_pod or first call does
    assert n.placements is not None
    stamp = n.stamp if same_stamp else (2, 1)
    try:
        plain = plain_grant(p, c, n.checkpoint, n.placements, stamp)
    except HookError as e:
        with pytest.raises(HookError) as info:
            run(p, c, n)
        assert (info.value.code, info.value.reason) == (e.code, e.reason)
        return
    brings_nothing = not brings_devices(c)
    if plain is None:  # declined: it must not be the case plain_grant is for
        if same_stamp and not n.checkpoint.entries and brings_nothing:
            allocs = scheduled(p, c, al.GPU)
            placed = n.placements.get(allocs, n.stamp) if allocs else None
            assert placed is None or placed.shared
        return
    assert same_stamp and not n.checkpoint.entries and brings_nothing
    assert run(p, c, n) is plain  # the placement's own grant


# -- devices by their numbers, DRA claims ---------------------------------------------------------


def test_a_device_is_a_gpu_by_its_numbers_whatever_its_name() -> None:
    """NRI shows each node's numbers: /dev/nvidia-fake2 that is c 195:2 goes, /dev/nvidia2 that is
    c 195:3 is GPU minor 3 (the chosen one) and stays; in a CRI request the host path is read."""
    fake = Device("/dev/nvidia-fake2", "/dev/nvidia-fake2", "rw", ("c", 195, 2))
    misnamed = Device("/dev/nvidia2", "/dev/nvidia2", "rw", ("c", 195, 3))
    edit = run(pod(allocated(3)), container(devices=(fake, misnamed)))
    assert edit is not None and edit.remove_devices == {"/dev/nvidia-fake2"}
    crafted = Device("/dev/x", "/host/x")  # a CRI request: its numbers come from the host node
    n = node()
    n.number_of = {"/host/x": ("c", 195, 2)}.get
    edit = run(pod(), container(devices=(crafted,)), n)
    assert edit is not None and edit.remove_devices == {"/dev/x"}


def test_a_cdi_device_whose_spec_brings_a_gpu_node_is_stripped() -> None:
    """A CDI device of any kind whose spec's node is a GPU nobody granted goes, in CDI_devices and
    in cdi.k8s.io/* annotations alike; one whose nodes are no GPU stays."""
    specs = {"vendor.example/fake=gpu0": (DeviceNode("c", 195, 2, "/dev/nvidia-fake0"),), "vendor.example/nic=0": ()}
    n = node()
    n.cdi_nodes = specs.get
    c = container(
        cdi_devices=("vendor.example/fake=gpu0", "vendor.example/nic=0"),
        annotations={"cdi.k8s.io/x": "vendor.example/fake=gpu0"},
    )
    edit = run(pod(), c, n)
    assert edit is not None
    assert edit.remove_cdi_devices == {"vendor.example/fake=gpu0"} and edit.remove_annotations == {"cdi.k8s.io/x"}


def test_a_dra_claims_gpu_is_kept_as_its_driver_made_it() -> None:
    """The claim's CDI device and the node it brought (NRI's view) stay, and so does the env its
    spec set; a pod without the claim loses both."""
    claim = "k8s.gpu.nvidia.com/claim=uid-gpu0"
    node0 = Device("/dev/nvidia2", "/dev/nvidia2", "rw", ("c", 195, 2))
    c = container(devices=(node0,), cdi_devices=(claim,), envs=(("NVIDIA_VISIBLE_DEVICES", BOX[0].uuid),))
    n = node()
    n.claimed, n.claim_cdi = frozenset({2}), frozenset({claim})
    n.cdi_nodes = {claim: (DeviceNode("c", 195, 2, "/dev/nvidia2"),)}.get
    assert run(pod(), c, n) is None
    unclaimed = node()
    unclaimed.cdi_nodes = n.cdi_nodes
    edit = run(pod(), c, unclaimed)
    assert edit is not None and edit.remove_devices == {"/dev/nvidia2"} and edit.remove_cdi_devices == {claim}
    assert edit.env["NVIDIA_VISIBLE_DEVICES"] == "void"
