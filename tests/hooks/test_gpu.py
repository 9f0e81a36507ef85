"""The gpu hook at its I/O edge: options, the checkpoint file, device nodes under dev_root, pod
liveness from kubelet's pod directories, and the hook inside a real hook chain (allowlist included)."""

from __future__ import annotations

import asyncio
import json
import re
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import grpc
import pytest

from crihook.base import allocation as al
from crihook.base.config import ConfigError, HooksConfig, NodeConfig
from crihook.base.spec import Device
from crihook.devices import checkpoint as checkpoint_module
from crihook.devices.checkpoint import CheckpointReader
from crihook.devices.draclaims import STATE_FILE, ClaimsReader
from crihook.hooks.base import ContainerInfo, Edit, HookContext, HookError, PodInfo, Stage
from crihook.hooks.cdi import CdiIndex
from crihook.hooks.fscache import FsMemo
from crihook.hooks.gpu import GpuHook, PodDirs, StorePods, directory
from crihook.hooks.gpu_edit import GpuOptions, SeenPod
from crihook.hooks.grant import HamiCore
from crihook.hooks.reach import DeviceNode, Reach, Undecided
from crihook.hooks.registry import build_chain
from crihook.simnode.node import make_dev_root
from tests.devices.test_draclaims import checkpoint as dra_checkpoint
from tests.devices.test_draclaims import claim as dra_claim
from tests.support.gpu_fixtures import Entry, Inventory, fake_proc, gpus, nvidia_plugin_resp, write_checkpoint

POD_UID = "0b1c2d3e-0000-4000-8000-000000000001"
OTHER_UID = "0b1c2d3e-0000-4000-8000-000000000002"
BOX = gpus(4, minor_offset=2)  # minors 2..5


class Node:
    """A node in a temporary directory: dev root, kubelet root with checkpoint and pod directories."""

    def __init__(self, root: Path) -> None:
        self.dev = make_dev_root(root / "dev", [g.minor for g in BOX])
        self.kubelet = root / "kubelet"
        self.checkpoint = self.kubelet / "device-plugins" / "kubelet_internal_checkpoint"
        (self.kubelet / "pods").mkdir(parents=True)
        self.proc = fake_proc(root, ["kubelet", f"--root-dir={self.kubelet}"])
        self.config = NodeConfig(
            dev_root=str(self.dev), kubelet_checkpoint=str(self.checkpoint), proc_root=str(self.proc)
        )
        self.inventory = Inventory(BOX)

    def pod_dir(self, uid: str) -> None:
        (self.kubelet / "pods" / uid).mkdir()

    def hook(self, **options: Any) -> GpuHook:
        opts = gpu_options(options)
        reader = CheckpointReader(str(self.checkpoint), sleep=lambda s: None)
        pod_dirs = PodDirs(opts.kubelet_pods_dir, str(self.proc))
        return GpuHook(opts, self.inventory, reader, pod_dirs, dev_root=str(self.dev))


def gpu_options(values: Mapping[str, Any]) -> GpuOptions:
    """A `[hooks.gpu]` table as the chain checks it."""
    return HooksConfig(options={"gpu": values}, source="config.toml").table("gpu", GpuOptions)[1]


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path)


def pod(annotations: Mapping[str, str] | None = None, uid: str = POD_UID, **kw: Any) -> PodInfo:
    return PodInfo("train", "ml", uid, annotations=dict(annotations or {}), **kw)


def allocated(*minors: int) -> dict[str, str]:
    return {al.DEVICE_ALLOCATED: json.dumps({"gpu": [{"minor": m} for m in minors]})}


def handle(hook: GpuHook, p: PodInfo, c: ContainerInfo | None = None) -> Edit | None:
    return hook.handle(HookContext(Stage.PRE_CREATE_CONTAINER, p, c or ContainerInfo("cuda")))


def refusal(hook: GpuHook, p: PodInfo, c: ContainerInfo | None = None) -> HookError:
    with pytest.raises(HookError) as info:
        handle(hook, p, c)
    return info.value


# -- options ----------------------------------------------------------------------------------------


def test_defaults_follow_the_node(node: Node) -> None:
    opts = gpu_options({})
    assert opts == GpuOptions()
    assert opts.kubelet_pods_dir is None  # the running kubelet's, found when first needed
    assert PodDirs(opts.kubelet_pods_dir, str(node.proc)).directory() == str(node.kubelet / "pods")


def test_options() -> None:
    opts = gpu_options(
        {
            "inject": "cdi",
            "deny_unallocated": False,
            "plugin_resources": ["example.com/gpu"],
            "hami_core": {"library": "/opt/hami/libvgpu.so", "cache_root": "/var/cache/hami", "lock_dir": ""},
            "kubelet_pods_dir": "/srv/kubelet/pods/",
        }
    )
    assert opts.inject == "cdi" and opts.deny_unallocated is False
    assert opts.plugin_resources == ("example.com/gpu",)
    assert opts.hami_core == HamiCore(library="/opt/hami/libvgpu.so", cache_root="/var/cache/hami", lock_dir="")
    assert opts.kubelet_pods_dir is not None and directory(opts.kubelet_pods_dir) == "/srv/kubelet/pods"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"inject": "env"}, r"\[hooks.gpu\].inject: must be one of 'env\+devices', 'cdi', not 'env'"),
        ({"inject": "CDI"}, r"\[hooks.gpu\].inject: must be one of"),
        ({"deny_unallocated": "yes"}, r"\[hooks.gpu\].deny_unallocated: expected bool, got str 'yes'"),
        ({"plugin_resources": "nvidia.com/gpu"}, r"\[hooks.gpu\].plugin_resources: expected a list of strings"),
        ({"plugin_resources": ["a", ""]}, r"\[hooks.gpu\].plugin_resources\[1\]: must not be empty"),
        ({"hami_core": "/opt"}, r"\[hooks.gpu\].hami_core: expected a table \(\[hooks.gpu.hami_core\]\)"),
        ({"hami_core": {"libary": "/x"}}, r"\[hooks.gpu.hami_core\].libary: unknown key \(known: cache_root, host"),
        ({"hami_core": {"library": "lib/vgpu.so"}}, r"\[hooks.gpu.hami_core\].library: must be an absolute, normal"),
        ({"hami_core": {"cache_root": "/a/../etc"}}, r"\[hooks.gpu.hami_core\].cache_root: must be an absolute"),
        ({"hami_core": {"library": ""}}, r"\[hooks.gpu.hami_core\].library: must be an absolute"),
        ({"kubelet_pods_dir": 3}, r"\[hooks.gpu\].kubelet_pods_dir: expected str, got int 3"),
        ({"kubelet_pods_dir": "pods"}, r"\[hooks.gpu\].kubelet_pods_dir: must be an absolute"),
        ({"verbose": True}, r"\[hooks.gpu\].verbose: unknown key \(known: cdi_spec_dirs, deny_unallocated, hami"),
    ],
)
def test_bad_options_are_named(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=r"^config.toml " + message):
        gpu_options(options)


# -- the checkpoint file ----------------------------------------------------------------------------


def test_no_checkpoint_file_means_no_device_plugin(node: Node) -> None:
    edit = handle(node.hook(), pod(allocated(3)))
    assert edit is not None and edit.env["NVIDIA_VISIBLE_DEVICES"] == BOX[1].uuid
    assert [d.host_path for d in edit.add_devices] == [
        f"{node.dev}/nvidia3",
        f"{node.dev}/nvidiactl",
        f"{node.dev}/nvidia-uvm",
        f"{node.dev}/nvidia-uvm-tools",
    ]
    assert edit.add_devices[0] == Device("/dev/nvidia3", f"{node.dev}/nvidia3", "rw")


def test_gpu_held_by_a_live_plugin_pod_then_freed(node: Node) -> None:
    write_checkpoint(node.checkpoint, [Entry(OTHER_UID, "trainer", [BOX[1].uuid])])
    node.pod_dir(OTHER_UID)
    hook = node.hook()
    err = refusal(hook, pod(allocated(3)))
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION
    assert err.reason == (
        f"annotation {al.DEVICE_ALLOCATED}: GPU minor 3 ({BOX[1].uuid}) is held by live pod {OTHER_UID} "
        "container trainer through the device plugin (nvidia.com/gpu, kubelet checkpoint)"
    )
    (node.kubelet / "pods" / OTHER_UID).rmdir()  # kubelet cleaned the pod up; its entry lingers
    edit = handle(hook, pod(allocated(3)))
    assert edit is not None and edit.env["NVIDIA_VISIBLE_DEVICES"] == BOX[1].uuid


def test_checkpoint_parsed_only_when_it_changes(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    parsed: list[int] = []
    real = checkpoint_module.parse_checkpoint
    monkeypatch.setattr(checkpoint_module, "parse_checkpoint", lambda data: parsed.append(1) or real(data))
    write_checkpoint(node.checkpoint, [Entry(POD_UID, "cuda", [BOX[0].uuid], resp=nvidia_plugin_resp(BOX[:1]))])
    hook = node.hook()
    for _ in range(5):
        assert handle(hook, pod()) is None  # the device plugin's allocation stands
    assert len(parsed) == 1
    write_checkpoint(node.checkpoint, [Entry(OTHER_UID, "cuda", [BOX[0].uuid])])
    edit = handle(hook, pod())
    assert edit is not None and edit.env == {"NVIDIA_VISIBLE_DEVICES": "void"}
    assert len(parsed) == 2


def test_damaged_checkpoint_fails_closed_until_repaired(node: Node) -> None:
    node.checkpoint.parent.mkdir(parents=True)
    node.checkpoint.write_text('{"Data": {"PodDeviceEntries": {}}}')
    hook = node.hook()
    for p in (pod(allocated(2)), pod()):
        err = refusal(hook, p)
        assert err.code == grpc.StatusCode.FAILED_PRECONDITION
        assert err.reason == (
            f"kubelet checkpoint: Data.PodDeviceEntries: expected a list ({node.checkpoint}); "
            "can not tell which GPUs the device plugin handed out"
        )
    write_checkpoint(node.checkpoint, [])
    edit = handle(hook, pod(allocated(2)))
    assert edit is not None and edit.env["NVIDIA_VISIBLE_DEVICES"] == BOX[0].uuid


# -- device nodes, refusals, isolation between pods -------------------------------------------------


def test_missing_device_node_under_dev_root(node: Node) -> None:
    (node.dev / "nvidia4").unlink()
    err = refusal(node.hook(), pod(allocated(2, 4)))
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION
    assert f"device node {node.dev}/nvidia4 of minor 4 is missing on this node" in err.reason


def test_one_bad_pod_does_not_affect_another(node: Node) -> None:
    hook = node.hook()
    forged = pod({al.DEVICE_ALLOCATED: json.dumps({"gpu": [{"minor": 2, "id": "GPU-forged"}]})}, uid=OTHER_UID)
    malformed = pod({al.DEVICE_ALLOCATED: '{"gpu": [{"minor": -1}]}'}, uid=OTHER_UID)
    good = pod(allocated(2, 5))
    want = f"{BOX[3].uuid},{BOX[0].uuid}"
    for _ in range(3):
        assert refusal(hook, forged).code == grpc.StatusCode.FAILED_PRECONDITION
        assert refusal(hook, malformed).code == grpc.StatusCode.INVALID_ARGUMENT
        edit = handle(hook, good)
        assert edit is not None and edit.env["NVIDIA_VISIBLE_DEVICES"] == want


def test_cdi_mode_from_options(node: Node) -> None:
    edit = handle(node.hook(inject="cdi"), pod(allocated(4)))
    assert edit is not None
    assert edit.add_cdi_devices == [f"nvidia.com/gpu={BOX[2].uuid}"] and edit.add_devices == []


def test_deny_unallocated_switch(node: Node) -> None:
    leaky = ContainerInfo("cuda", devices=(Device("/dev/nvidia3", "/dev/nvidia3"),))
    edit = handle(node.hook(), pod(), leaky)
    assert edit is not None and edit.env == {"NVIDIA_VISIBLE_DEVICES": "void"}
    assert edit.remove_devices == {"/dev/nvidia3"}
    assert handle(node.hook(deny_unallocated=False), pod(), leaky) is None


def test_pod_dirs(tmp_path: Path) -> None:
    live = PodDirs(str(tmp_path))
    (tmp_path / POD_UID).mkdir()
    assert live(POD_UID)
    assert not live(OTHER_UID)
    assert live("../../etc")  # can not be checked: counts as live
    assert live("")


# -- inside the hook chain --------------------------------------------------------------------------

HAMI = {"koordinator.sh/gpu-isolation-provider": "HAMi-core"}
SHARED = {al.DEVICE_ALLOCATED: json.dumps({"gpu": [{"minor": 3, "resources": {al.GPU_MEMORY_RATIO: "50"}}]})}


def gpu_factory(node: Node) -> Callable[[GpuOptions, NodeConfig], GpuHook]:
    def make(options: GpuOptions, node_cfg: NodeConfig) -> GpuHook:
        reader = CheckpointReader(str(node.checkpoint))
        pod_dirs = PodDirs(options.kubelet_pods_dir, str(node.proc))
        return GpuHook(options, node.inventory, reader, pod_dirs, dev_root=node_cfg.dev_root)

    return make


def chain_run(node: Node, hooks: HooksConfig, p: PodInfo) -> Any:
    chain = build_chain(hooks, node.config, {"gpu": gpu_factory(node)})
    ctx = HookContext(Stage.PRE_CREATE_CONTAINER, p, ContainerInfo("cuda", envs=(("NVIDIA_VISIBLE_DEVICES", "all"),)))
    return asyncio.run(chain.run(ctx))


def test_chain_applies_the_edit_within_the_default_allowlist(node: Node) -> None:
    out = chain_run(node, HooksConfig(), pod(allocated(3)))
    assert out.error is None
    assert out.ctx.container.env("NVIDIA_VISIBLE_DEVICES") == BOX[1].uuid
    assert out.ctx.container.devices[0].host_path == f"{node.dev}/nvidia3"


def test_chain_names_pod_container_annotation_and_cause(node: Node) -> None:
    out = chain_run(node, HooksConfig(), pod(allocated(9)))
    assert out.error is not None and out.error.code == grpc.StatusCode.FAILED_PRECONDITION
    assert out.error.reason == (
        f"hook gpu: pod ml/train container cuda: annotation {al.DEVICE_ALLOCATED}: "
        "gpu minor 9: no such GPU on this node"
    )


def hami_files(tmp_path: Path) -> dict[str, str]:
    """HAMi-core's library and preload file, installed on the node as HAMi's device plugin does."""
    (tmp_path / "vgpu").mkdir()
    (tmp_path / "vgpu" / "libvgpu.so").write_bytes(b"\x7fELF")
    (tmp_path / "vgpu" / "ld.so.preload").write_text(f"{tmp_path}/vgpu/libvgpu.so\n")
    return {"library": f"{tmp_path}/vgpu/libvgpu.so", "preload_file": f"{tmp_path}/vgpu/ld.so.preload"}


def test_hami_core_paths_are_allowed_as_configured(node: Node, tmp_path: Path) -> None:
    hami = {
        **hami_files(tmp_path),
        "cache_root": f"{tmp_path}/c",
        "lock_dir": f"{tmp_path}/lock",
    }
    # the shipped allowlist, nothing added: what [hooks.gpu.hami_core] names is the operator's own
    out = chain_run(node, HooksConfig(options={"gpu": {"hami_core": hami}}), pod(SHARED, labels=HAMI))
    assert out.error is None
    c = out.ctx.container
    assert c.env("CUDA_DEVICE_MEMORY_LIMIT_0") == f"{(16 << 30) // 2 // (1 << 20)}m"
    assert c.env("CUDA_DEVICE_SM_LIMIT") == "100"
    assert {(m.container_path, m.host_path, m.readonly) for m in c.mounts} == {
        (f"{tmp_path}/vgpu/libvgpu.so", f"{tmp_path}/vgpu/libvgpu.so", True),
        ("/etc/ld.so.preload", f"{tmp_path}/vgpu/ld.so.preload", True),
        ("/tmp/vgpu", f"{tmp_path}/c/{POD_UID}_cuda", False),
        ("/tmp/vgpulock", f"{tmp_path}/lock", False),
    }
    # made before the runtime mounts them, writable by the container's user whoever it is
    for made in (tmp_path / "c" / f"{POD_UID}_cuda", tmp_path / "lock"):
        assert stat.S_IMODE(made.stat().st_mode) == 0o777


def test_a_hami_core_directory_that_can_not_be_made_refuses_the_container(node: Node, tmp_path: Path) -> None:
    (tmp_path / "c").write_text("a file where the cache root should be")
    hami = {**hami_files(tmp_path), "cache_root": f"{tmp_path}/c"}
    out = chain_run(node, HooksConfig(options={"gpu": {"hami_core": hami}}), pod(SHARED, labels=HAMI))
    assert out.error is not None and out.error.code == grpc.StatusCode.FAILED_PRECONDITION
    assert f"container cuda: HAMi-core directory {tmp_path}/c/{POD_UID}_cuda can not be made" in out.error.reason


def test_a_missing_hami_core_library_refuses_the_share_naming_the_pod_and_path(node: Node, tmp_path: Path) -> None:
    # the runtime would mount an empty directory there (CRI) and the share would run unlimited
    hami = {**hami_files(tmp_path), "cache_root": f"{tmp_path}/c", "lock_dir": f"{tmp_path}/lock"}
    (tmp_path / "vgpu" / "libvgpu.so").unlink()
    hooks = HooksConfig(options={"gpu": {"hami_core": hami}})
    out = chain_run(node, hooks, pod(SHARED, labels=HAMI))
    assert out.error is not None and out.error.code == grpc.StatusCode.FAILED_PRECONDITION
    assert out.error.reason == (
        f"hook gpu: pod ml/train container cuda: HAMi-core isolation needs {tmp_path}/vgpu/libvgpu.so, missing"
        " on this node; install HAMi-core there, or set [hooks.gpu.hami_core] library and preload_file"
        " (the chart's node.hamiCore) to where it is"
    )
    assert not (tmp_path / "c").exists() and not (tmp_path / "lock").exists()  # nothing made for it
    # the whole directory gone: both named
    (tmp_path / "vgpu" / "ld.so.preload").unlink()
    (tmp_path / "vgpu").rmdir()
    out = chain_run(node, hooks, pod(SHARED, labels=HAMI))
    assert out.error is not None
    assert f"needs {tmp_path}/vgpu/libvgpu.so and {tmp_path}/vgpu/ld.so.preload, missing" in out.error.reason
    # an unshared GPU takes no HAMi-core: not refused
    assert chain_run(node, hooks, pod(allocated(3), labels=HAMI)).error is None
    # with the memo: the answer is remembered, and HAMi-core installed afterwards is seen
    hook = gpu_factory(node)(hooks.table("gpu", GpuOptions)[1], node.config)
    hook.memo = FsMemo()
    assert "libvgpu.so and" in refusal(hook, pod(SHARED, labels=HAMI)).reason
    assert "libvgpu.so and" in refusal(hook, pod(SHARED, labels=HAMI)).reason
    hami_files(tmp_path)
    edit = handle(hook, pod(SHARED, labels=HAMI))
    assert edit is not None and edit.env["CUDA_DEVICE_SM_LIMIT"] == "100"
    hook.close()


def test_hami_core_files_are_looked_for_under_host_root(node: Node, tmp_path: Path) -> None:
    host = tmp_path / "host"
    host.mkdir()
    hami = {**hami_files(host), "cache_root": f"{tmp_path}/c", "lock_dir": ""}
    # configured as the host names them; seen under host_root (the node pod's mount of the host's /)
    named = {k: v.removeprefix(str(host)) for k, v in hami.items() if k in ("library", "preload_file")}
    hooks = HooksConfig(options={"gpu": {"hami_core": {**hami, **named, "host_root": str(host)}}})
    out = chain_run(node, hooks, pod(SHARED, labels=HAMI))
    assert out.error is None
    assert (named["library"], named["library"], True) in {
        (m.container_path, m.host_path, m.readonly) for m in out.ctx.container.mounts
    }
    (host / "vgpu" / "libvgpu.so").unlink()
    out = chain_run(node, hooks, pod(SHARED, labels=HAMI))
    assert out.error is not None and f"needs {named['library']}, missing" in out.error.reason
    # host_root not there at all (not mounted): nothing can be told, nothing is refused
    hooks = HooksConfig(options={"gpu": {"hami_core": {**hami, **named, "host_root": f"{tmp_path}/unmounted"}}})
    assert chain_run(node, hooks, pod(SHARED, labels=HAMI)).error is None


# -- the registered hook, with NVML answered by the fake library -----------------------------------


def test_registered_hook_over_nvml_makes_no_nvml_call_when_warm(tmp_path: Path, fake_nvml: Any) -> None:
    from crihook.hooks.registry import discover_factories

    fake = fake_nvml("dgx-h100")
    dev = make_dev_root(tmp_path / "dev", [g["minor"] for g in fake.doc["gpus"]])
    node_cfg = NodeConfig(
        dev_root=str(dev),
        sys_root=str(fake.sys_root),
        kubelet_checkpoint=str(tmp_path / "kubelet" / "device-plugins" / "kubelet_internal_checkpoint"),
        nvml_library=str(fake.library),
    )
    hook = discover_factories()["gpu"](GpuOptions(), node_cfg)
    assert (hook.name, hook.priority, hook.stages) == ("gpu", 200, frozenset({Stage.PRE_CREATE_CONTAINER}))
    last = fake.doc["gpus"][-1]
    p = pod({al.DEVICE_ALLOCATED: json.dumps({"gpu": [{"minor": last["minor"], "id": last["uuid"]}]})})
    first = handle(hook, p)
    assert first is not None and first.env["NVIDIA_VISIBLE_DEVICES"] == last["uuid"]
    calls = fake.call_count()
    for _ in range(3):
        assert handle(hook, p) == first
    assert fake.call_count() == calls


# -- kubelet's directories --------------------------------------------------------------------------


def test_pods_dir_follows_kubelets_root_dir_not_the_checkpoint(tmp_path: Path) -> None:
    # kubelet keeps the checkpoint in /var/lib/kubelet/device-plugins whatever --root-dir says, while
    # the pods dir is <root dir>/pods (pkg/kubelet/kubelet_getters.go getPodsDir)
    live = PodDirs(None, str(fake_proc(tmp_path, None)))
    assert live.directory() == "/var/lib/kubelet/pods"  # kubelet not running yet: its default, asked again
    fake_proc(tmp_path, ["kubelet", "--config=/etc/kubernetes/kubelet.yaml", "--root-dir", f"{tmp_path}/data/kubelet"])
    assert live.directory() == str(tmp_path / "data" / "kubelet" / "pods")
    (tmp_path / "data" / "kubelet" / "pods" / POD_UID).mkdir(parents=True)
    assert live(POD_UID) and not live(OTHER_UID)


def test_missing_pods_dir_counts_as_live_and_is_said_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    live = PodDirs(str(tmp_path / "nowhere" / "pods"))
    with caplog.at_level("WARNING", logger="crihook.hooks.gpu"):
        assert live(OTHER_UID) and live(POD_UID)
    said = [r for r in caplog.records if "kubelet pods dir missing" in r.getMessage()]
    assert len(said) == 1 and said[0].dir == str(tmp_path / "nowhere" / "pods")
    (tmp_path / "nowhere" / "pods").mkdir(parents=True)
    assert not live(OTHER_UID)


def test_checkpoint_in_a_missing_directory_is_said(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    reader = CheckpointReader(str(tmp_path / "no-such-dir" / "kubelet_internal_checkpoint"))
    with caplog.at_level("WARNING", logger="crihook.checkpoint"):
        assert reader.read().entries == () and reader.read().entries == ()
    assert [r.dir for r in caplog.records if "checkpoint directory missing" in r.getMessage()] == [
        str(tmp_path / "no-such-dir")
    ]
    caplog.clear()
    (tmp_path / "no-such-dir").mkdir()
    with caplog.at_level("WARNING", logger="crihook.checkpoint"):
        assert reader.read().entries == ()  # kubelet without device plugins writes no checkpoint: silent
    assert not caplog.records


def test_store_pods_reads_crihooks_store(tmp_path: Path) -> None:
    from crihook.node.records import ContainerRecord, PodRecord
    from crihook.node.store import Store

    store = Store(tmp_path)
    placed = allocated(3) | {"other": "x"}
    store.pods["s1"] = PodRecord("s1", "a", "ml", POD_UID, annotations=placed)
    store.pods["s2"] = PodRecord("s2", "b", "ml", OTHER_UID, attempt=0)
    store.pods["s3"] = PodRecord("s3", "b", "ml", OTHER_UID, attempt=1)  # the sandbox recreated
    store.pods["s4"] = PodRecord("s4", "c", "ml", "bad-uid", annotations={al.DEVICE_ALLOCATED: "{"})
    store.containers["c1"] = ContainerRecord("c1", "s1", "cuda")
    store.containers["c2"] = ContainerRecord("c2", "s2", "trainer")
    store.containers["c3"] = ContainerRecord("c3", "s3", "sidecar")
    pods = StorePods(store)
    assert pods.get(POD_UID) == SeenPod(True, frozenset({3}), frozenset({"cuda"}))
    assert pods.get(OTHER_UID) == SeenPod(False, frozenset(), frozenset({"trainer", "sidecar"}))
    assert pods.get("bad-uid") == SeenPod(True, frozenset(), frozenset())  # refused by the hook: never a holder
    assert pods.get("unknown") is None
    assert sorted(uid for uid, _ in pods.allocated()) == sorted([POD_UID, "bad-uid"])


def test_hook_with_the_store_ignores_phantoms_and_guards_plugin_pods(node: Node, tmp_path: Path) -> None:
    from crihook.node.records import ContainerRecord, PodRecord
    from crihook.node.store import Store

    store = Store(tmp_path / "state")
    # OTHER_UID was placed by the scheduler on minor 2; kubelet's plugin gave it minor 3 (a phantom)
    store.pods["s2"] = PodRecord("s2", "b", "ml", OTHER_UID, annotations=allocated(2))
    store.containers["c2"] = ContainerRecord("c2", "s2", "trainer")
    write_checkpoint(
        node.checkpoint,
        [
            Entry(OTHER_UID, "trainer", [BOX[1].uuid], resp=nvidia_plugin_resp(BOX[1:2])),
            Entry(POD_UID, "cuda", [BOX[0].uuid], resp=nvidia_plugin_resp(BOX[:1])),
        ],
    )
    node.pod_dir(OTHER_UID)
    hook = node.hook()
    assert refusal(hook, pod(allocated(3))).code == grpc.StatusCode.FAILED_PRECONDITION  # no store: counts
    hook.attach_store(store)
    edit = handle(hook, pod(allocated(3)))
    assert edit is not None and edit.env["NVIDIA_VISIBLE_DEVICES"] == BOX[1].uuid
    # a device-plugin pod (no annotation) that the plugin gave minor 2, which OTHER_UID uses
    err = refusal(hook, pod())
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION
    assert err.reason == (
        f"the device plugin gave this container GPU minor 2 ({BOX[0].uuid}), which live pod {OTHER_UID} uses as "
        "the scheduler placed it; it can start once that pod is gone"
    )


def test_containers_created_at_once_can_not_share_a_gpu(node: Node, tmp_path: Path) -> None:
    """Kubelet creates containers of different pods at the same time; the store shows a container
    only once the runtime created it. The hook remembers what it let through meanwhile."""
    from crihook.node.records import PodRecord
    from crihook.node.store import Store

    store = Store(tmp_path / "state")
    store.pods["s1"] = PodRecord("s1", "placed", "ml", POD_UID, annotations=allocated(2))
    store.pods["s2"] = PodRecord("s2", "bound", "ml", OTHER_UID)
    # the plugin gave the placed pod minor 5 (a phantom) and the spec.nodeName pod minor 2
    write_checkpoint(
        node.checkpoint,
        [
            Entry(POD_UID, "cuda", [BOX[3].uuid], resp=nvidia_plugin_resp(BOX[3:4])),
            Entry(OTHER_UID, "cuda", [BOX[0].uuid], resp=nvidia_plugin_resp(BOX[:1])),
        ],
    )
    node.pod_dir(POD_UID)
    node.pod_dir(OTHER_UID)
    hook = node.hook()
    hook.attach_store(store)
    now = [100.0]
    hook.clock = lambda: now[0]
    edit = handle(hook, pod(allocated(2)))  # let through; its CreateContainer is still on its way
    assert edit is not None and edit.env["NVIDIA_VISIBLE_DEVICES"] == BOX[0].uuid
    err = refusal(hook, pod(uid=OTHER_UID))
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION and f"which live pod {POD_UID} uses" in err.reason
    now[0] += 31  # the claim lapses; the store never showed the container (a later hook refused it)
    assert handle(hook, pod(uid=OTHER_UID)) is None  # the plugin's allocation stands
    hook.forget(OTHER_UID, "cuda")  # its creation failed: the front door says so (Lifecycle.create_failed)
    handle(hook, pod(allocated(2)))  # let through again, and that creation fails too
    refusal(hook, pod(uid=OTHER_UID))
    hook.forget(POD_UID, "cuda")  # no 30 s wait for the claim to lapse
    assert handle(hook, pod(uid=OTHER_UID)) is None


# -- the plain grant -------------------------------------------------------------------------------


def test_every_container_of_an_allocation_gets_the_placements_grant(node: Node) -> None:
    """Answered from the memo, every container of an allocation that brings no devices of its own
    gets the same Edit, the one a read gives."""
    from crihook.hooks.fscache import FsMemo

    write_checkpoint(node.checkpoint, [])
    hook = node.hook()
    hook.memo = FsMemo()
    p = pod(allocated(2, 3))
    full = handle(hook, p)  # fills the memo
    assert full is not None

    def cached(container: str) -> object:
        return hook.handle_cached(HookContext(Stage.PRE_CREATE_CONTAINER, p, ContainerInfo(container)))

    first, second = cached("cuda"), cached("sidecar")
    assert first is second and first == full
    hook.close()


def test_the_plain_grant_made_without_the_node_view_claims_its_gpus(node: Node, tmp_path: Path) -> None:
    """The plain grant (no device-plugin entry on the node) records its claim as the general
    decision does: a plugin pod handed the same GPU a moment later is refused."""
    from crihook.hooks import gpu as gpu_module
    from crihook.hooks.fscache import FsMemo
    from crihook.node.store import Store

    write_checkpoint(node.checkpoint, [])
    node.pod_dir(POD_UID)
    node.pod_dir(OTHER_UID)
    hook = node.hook()
    hook.memo = FsMemo()
    hook.attach_store(Store(tmp_path / "state"))
    p = pod(allocated(2))
    for _ in range(2):  # the memo filled, then the placement made under the stamp it allows
        assert handle(hook, pod(allocated(2), uid="someone-else")) is not None
    hook._claims.clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gpu_module, "NodeView", lambda *a: pytest.fail("the plain grant needs no node view"))
        edit = hook.handle_cached(HookContext(Stage.PRE_CREATE_CONTAINER, p, ContainerInfo("cuda")))
    assert isinstance(edit, Edit) and edit.env["NVIDIA_VISIBLE_DEVICES"] == BOX[0].uuid
    assert list(hook._claims) == [(POD_UID, "cuda")]
    write_checkpoint(node.checkpoint, [Entry(OTHER_UID, "cuda", [BOX[0].uuid], resp=nvidia_plugin_resp(BOX[:1]))])
    hook.memo.sync()
    err = refusal(hook, pod(uid=OTHER_UID))
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION and f"which live pod {POD_UID} uses" in err.reason
    hook.close()


# -- the verdict on a container as it is (hooks.reach through GpuHook.verdict) -----------------------


def verdict_hook(node: Node, tmp_path: Path) -> GpuHook:
    """The hook with kubelet's DRA checkpoint and a CDI spec dir; one claim of POD_UID's whose spec
    brings GPU minor 4 (numbers in the spec: the test's /dev holds plain files)."""
    hook = node.hook()
    specs = tmp_path / "cdi"
    specs.mkdir()
    spec = {
        "cdiVersion": "0.5.0",
        "kind": "example.com/claim",
        "devices": [
            {
                "name": "c1-gpu",
                "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia4", "type": "c", "major": 195, "minor": 4}]},
            }
        ],
    }
    (specs / "claim.json").write_text(json.dumps(spec))
    (node.kubelet / STATE_FILE).write_bytes(
        dra_checkpoint(dra_claim("c1", [POD_UID], **{"gpu.example.com": [["example.com/claim=c1-gpu"]]}))
    )
    hook.claims = ClaimsReader(str(node.kubelet / STATE_FILE))
    hook.specs = CdiIndex((str(specs),))
    return hook


def reaching(*minors: int, visible: str | None = None) -> Reach:
    return Reach(nodes=tuple(DeviceNode("c", 195, m, f"/dev/gpu{m}") for m in minors), visible=visible)


def test_the_verdict_names_what_none_of_the_three_grants_gives(node: Node, tmp_path: Path) -> None:
    hook = verdict_hook(node, tmp_path)
    p, c = pod(allocated(2)), ContainerInfo("cuda")
    assert hook.verdict(p, c, reaching(2)).ungranted == ()  # the scheduler's
    assert hook.verdict(p, c, reaching(2, 3)).ungranted == (3,)
    assert hook.verdict(p, c, reaching(visible="all")).ungranted == (3, 5)  # 2 the scheduler's, 4 the claim's
    write_checkpoint(node.checkpoint, [Entry(POD_UID, "cuda", [BOX[1].uuid + "::2"])])  # a replica of minor 3
    assert hook.verdict(p, c, reaching(2, 3)).ungranted == ()  # the device plugin's
    assert hook.verdict(p, c, reaching(4)).ungranted == ()  # the DRA claim's
    assert hook.verdict(pod(uid=OTHER_UID), c, reaching(4)).ungranted == (4,)  # another pod's claim
    assert hook.verdict(pod({al.DEVICE_ALLOCATED: "{"}), c, reaching(2)).ungranted == (2,)  # malformed: nothing


def test_a_fact_that_can_not_be_had_is_no_finding(node: Node, tmp_path: Path) -> None:
    hook = verdict_hook(node, tmp_path)
    assert hook.verdict(pod(), ContainerInfo("cuda"), Reach()).ungranted == ()  # nothing reached, nothing read
    node.checkpoint.parent.mkdir(parents=True)
    node.checkpoint.write_text("{")
    with pytest.raises(Undecided, match="kubelet checkpoint"):
        hook.verdict(pod(), ContainerInfo("cuda"), reaching(2))
    node.checkpoint.unlink()
    for spec in (tmp_path / "cdi").iterdir():
        spec.unlink()
    with pytest.raises(Undecided, match=re.escape("the pod's claim device example.com/claim=c1-gpu: no CDI spec")):
        hook.verdict(pod(), ContainerInfo("cuda"), reaching(2))
    hook.gpus = Inventory(())
    with pytest.raises(Undecided, match="NVML lists no GPU"):
        hook.verdict(pod(), ContainerInfo("cuda"), reaching(2))


def test_a_cdi_device_is_a_claims_only_by_kubelets_dra_checkpoint(node: Node, tmp_path: Path) -> None:
    """The claim's device kept for its pod (no change at all); the same device in another pod's
    request, or in its own once the checkpoint no longer lists the claim, is stripped. A claim
    whose spec the hook can not read is kept all the same (the runtime resolves it), not a refusal."""
    hook = verdict_hook(node, tmp_path)
    c = ContainerInfo("cuda", cdi_devices=("example.com/claim=c1-gpu",))
    assert handle(hook, pod(), c) is None
    edit = handle(hook, pod(uid=OTHER_UID), c)
    assert edit is not None and edit.remove_cdi_devices == {"example.com/claim=c1-gpu"}
    for spec in (tmp_path / "cdi").iterdir():
        spec.unlink()
    assert handle(hook, pod(), c) is None
    (node.kubelet / STATE_FILE).unlink()
    (tmp_path / "cdi" / "claim.json").write_text(
        json.dumps(
            {
                "cdiVersion": "0.5.0",
                "kind": "example.com/claim",
                "devices": [
                    {
                        "name": "c1-gpu",
                        "containerEdits": {
                            "deviceNodes": [{"path": "/dev/nvidia4", "major": 195, "minor": 4, "type": "c"}]
                        },
                    }
                ],
            }
        )
    )
    edit = handle(hook, pod(), c)
    assert edit is not None and edit.remove_cdi_devices == {"example.com/claim=c1-gpu"}


def test_the_allowlist_takes_only_what_the_hami_core_table_names(node: Node, tmp_path: Path) -> None:
    hami = {"library": "/opt/hami/libvgpu.so", "preload_file": "/opt/hami/p", "cache_root": f"{tmp_path}/c"}
    chain = build_chain(HooksConfig(options={"gpu": {"hami_core": hami}}), node.config, {"gpu": gpu_factory(node)})
    allows = chain.allowlist.allows
    assert allows("/opt/hami/libvgpu.so") and allows("/opt/hami/p") and allows(f"{tmp_path}/c/{POD_UID}_cuda")
    assert not allows("/opt/hami/other.so") and not allows(f"{tmp_path}/lock") and not allows(f"{tmp_path}/c")
    assert allows(f"{node.dev}/nvidia0")  # the configured patterns stay
