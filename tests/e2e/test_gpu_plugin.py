"""crihook beside NVIDIA's device plugin: `crihook serve` in front of a real containerd (1.6, and 2.x
with CDI on and a spec present), while the test plays kubelet with NVIDIA's plugin registered for
nvidia.com/gpu. No kubelet can run here, so `Kubelet` below does what kubelet does, taken from its
source (kubernetes/kubernetes):

- Devices are allocated at admission, before the pod's sandbox exists, for every container asking
  for the plugin's resource, whoever placed the pod; the checkpoint is rewritten after each
  allocation: pkg/kubelet/cm/devicemanager/manager.go (Allocate, allocateContainerResources,
  writeCheckpoint).
- The checkpoint: pkg/kubelet/cm/devicemanager/checkpoint/checkpoint.go (PodDeviceEntries with
  DeviceIDs by NUMA node, AllocResp the plugin's ContainerAllocateResponse as bytes, so base64 in
  the JSON); it lives in /var/lib/kubelet/device-plugins whatever --root-dir (DevicePluginPath).
- The pod directory <root dir>/pods/<uid> is made when the pod is synced, before its sandbox:
  pkg/kubelet/kubelet.go (SyncPod, makePodDataDirs) and kubelet_getters.go (getPodDir).
- The plugin's answer becomes the container's run options: pod_devices.go deviceRunContainerOptions
  (envs, mounts, devices, annotations, CDI devices of every resource merged), appended to kubelet's
  own by pkg/kubelet/cm/container_manager_linux.go (GetResources).
- Run options become the CRI ContainerConfig: pkg/kubelet/kuberuntime/kuberuntime_container.go
  generateContainerConfig (Envs, Mounts by makeMounts, Devices by makeDevices, CDI_devices by
  makeCDIDevices) and labels.go newContainerAnnotations (the plugin's annotations, then kubelet's
  own keys over them).
- A restarted container is a new CreateContainer with the next attempt number and the same devices
  (they stay allocated for the pod's life): kuberuntime_container.go startContainer.

NVIDIA's plugin's Allocate answer (NVIDIA/k8s-device-plugin, internal/plugin/server.go, uuid id
strategy): envvar strategy NVIDIA_VISIBLE_DEVICES=<uuids>, with --pass-device-specs the GPU's and the
control device nodes, volume-mounts a /dev/null mount per device under
/var/run/nvidia-container-devices; cdi-annotations `cdi.k8s.io/nvidia-device-plugin_<id>` naming
`k8s.device-plugin.nvidia.com/gpu=<uuid>` (its own CDI vendor, internal/cdi), cdi-cri the same names
as CDIDevices.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from crihook.base import allocation as al
from crihook.proto import deviceplugin_v1beta1_pb2 as dp
from crihook.proto import runtime_v1_pb2 as api
from crihook.scheduler.devices import PLUGIN_HELD, node_from_device
from crihook.scheduler.plugin import DeviceShare
from crihook.scheduler.pod import pod_from_json
from crihook.simnode import fakenvml
from crihook.simnode.node import NVIDIA_MAJOR, SimNode, make_sim_node
from tests.support.containerd import Containerd
from tests.support.cri import Cri, CriError, DeviceSpec, container_config, pod_config
from tests.support.daemon import Crihook, running_crihook
from tests.support.fakekube import ApiError, FakeKube
from tests.support.gpu_fixtures import Entry, fake_proc, write_checkpoint

pytestmark = pytest.mark.containerd

TOPOLOGY = "dgx-h100"  # minors 0..7, NVML index = minor
NODE = "gpu-node-1"
RESOURCE = "nvidia.com/gpu"
PLUGIN_CDI_KIND = "k8s.device-plugin.nvidia.com/gpu"
CONTROL = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")


def nvidia_allocate(node: SimNode, minors: list[int], strategy: str, request: str) -> dp.ContainerAllocateResponse:
    """NVIDIA's plugin's answer for `minors` ("envvar": env, device specs, volume mounts; "cdi": the
    cdi-annotations and cdi-cri strategies together)."""
    uuids = [node.uuid(m) for m in minors]
    resp = dp.ContainerAllocateResponse()
    if strategy == "envvar":
        resp.envs["NVIDIA_VISIBLE_DEVICES"] = ",".join(uuids)
        for name in [f"nvidia{m}" for m in minors] + list(CONTROL):
            resp.devices.add(container_path=f"/dev/{name}", host_path=f"{node.dev_root}/{name}", permissions="rw")
        for u in uuids:
            resp.mounts.add(container_path=f"/var/run/nvidia-container-devices/{u}", host_path="/dev/null")
    else:
        names = [f"{PLUGIN_CDI_KIND}={u}" for u in uuids]
        resp.annotations[f"cdi.k8s.io/nvidia-device-plugin_{request}"] = ",".join(names)
        for n in names:
            resp.cdi_devices.add(name=n)
    return resp


@dataclass
class Kubelet:
    """kubelet with NVIDIA's plugin registered, talking CRI to crihook (see the module docstring)."""

    node: SimNode
    cri: Cri
    pods_dir: Path
    strategy: str = "envvar"
    entries: list[Entry] = field(default_factory=list)
    answers: dict[tuple[str, str], dp.ContainerAllocateResponse] = field(default_factory=dict)
    stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    sandboxes: dict[str, str] = field(default_factory=dict)  # pod uid -> sandbox id

    def admit(self, pod: api.PodSandboxConfig, plugin_minors: list[int], container: str = "main") -> None:
        """Admission: the device manager asks the plugin for devices (which ones is kubelet's and
        the plugin's choice, never the scheduler's) and checkpoints the answer."""
        uid = pod.metadata.uid
        resp = nvidia_allocate(self.node, plugin_minors, self.strategy, f"{uid[:8]}-{container}")
        self.answers[(uid, container)] = resp
        ids = [self.node.uuid(m) for m in plugin_minors]
        self.entries.append(Entry(uid, container, ids, resource=RESOURCE, resp=resp, numa=0))
        write_checkpoint(self.node.checkpoint, self.entries)

    def config(self, pod: api.PodSandboxConfig, name: str, attempt: int = 0) -> api.ContainerConfig:
        resp = self.answers.get((pod.metadata.uid, name), dp.ContainerAllocateResponse())
        own = {"io.kubernetes.container.hash": "5a1b2c3d", "io.kubernetes.container.restartCount": str(attempt)}
        config = container_config(
            name,
            pod,
            envs={"NVIDIA_VISIBLE_DEVICES": "all", **resp.envs},  # a CUDA image's env, then the plugin's
            devices=[DeviceSpec(d.container_path, d.host_path, d.permissions) for d in resp.devices],
            annotations={**resp.annotations, **own},
            attempt=attempt,
        )
        for m in resp.mounts:
            config.mounts.add(container_path=m.container_path, host_path=m.host_path, readonly=m.read_only)
        for d in resp.cdi_devices:
            config.CDI_devices.add(name=d.name)
        return config

    def sync(self, pod: api.PodSandboxConfig, name: str = "main") -> str:
        """The pod worker: pod dir, sandbox, then the container created and started."""
        uid = pod.metadata.uid
        (self.pods_dir / uid).mkdir(parents=True, exist_ok=True)
        if uid not in self.sandboxes:
            self.sandboxes[uid] = self.stack.enter_context(self.cri.pod(pod))
        return self.stack.enter_context(self.cri.container(self.sandboxes[uid], self.config(pod, name), pod))

    def restart(self, pod: api.PodSandboxConfig, old: str, name: str = "main", attempt: int = 1) -> str:
        """The container exited: kubelet creates the next attempt in the same sandbox."""
        self.cri.stop_container(old, grace=0)
        return self.stack.enter_context(
            self.cri.container(self.sandboxes[pod.metadata.uid], self.config(pod, name, attempt), pod)
        )


def placed(node: SimNode, *minors: int) -> dict[str, str]:
    """The extender's annotation for whole GPUs (scheduler/plugin.py pre_bind writes the same)."""
    return {al.DEVICE_ALLOCATED: json.dumps({"gpu": [{"minor": m, "id": node.uuid(m)} for m in minors]})}


def env_of(cri: Cri, cid: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in cri.output(cid, "env").splitlines() if "=" in line)


def gpu_nodes(cri: Cri, cid: str) -> set[int]:
    """The minors of the GPU device nodes in the container's runtime spec."""
    spec = json.loads(cri.container_status(cid, verbose=True).info["info"])["runtimeSpec"]
    return {
        d["minor"]
        for d in spec["linux"].get("devices", [])
        if re.fullmatch(r"/dev/nvidia\d+", d["path"]) and d["major"] == NVIDIA_MAJOR
    }


def sees_exactly(node: SimNode, cri: Cri, cid: str, minors: set[int], plugin: bool = False) -> None:
    """The container has exactly the GPUs `minors` in env, runtime spec and /dev, and the plugin's
    per-device mounts only where the plugin's allocation stands (`plugin`)."""
    env = env_of(cri, cid)
    assert set(env["NVIDIA_VISIBLE_DEVICES"].split(",")) == {node.uuid(m) for m in minors}
    assert gpu_nodes(cri, cid) == minors
    inside = set(cri.output(cid, "ls", "/dev").split())
    assert {n for n in inside if re.fullmatch(r"nvidia\d+", n)} == {f"nvidia{m}" for m in minors}
    mounts = cri.exec_sync(cid, "ls", "/var/run/nvidia-container-devices").stdout.decode().split()
    assert set(mounts) == ({node.uuid(m) for m in minors} if plugin else set())


@dataclass
class Node:
    sim: SimNode
    proxy: Crihook
    pods_dir: Path


@contextlib.contextmanager
def gpu_node(containerd: Containerd, root: Path, kubelet_root: Path | None, kubeconfig: str = "") -> Iterator[Node]:
    """An 8-GPU simulated node and crihook serving it. The simulated node's fake /proc holds a
    kubelet whose --root-dir is `kubelet_root` (default: beside the checkpoint's directory). With a
    `kubeconfig`, crihook's device reporter publishes the node every second."""
    sim = make_sim_node(root, TOPOLOGY, char_devices=True)
    kubelet_root = kubelet_root or sim.kubelet
    proc = fake_proc(root / "node", ["/usr/bin/kubelet", f"--root-dir={kubelet_root}", "--v=2"])
    config = sim.proxy_config(fakenvml.build(), node_name=NODE if kubeconfig else "", proc_root=proc)
    if kubeconfig:
        config += f'[reporter]\nkubeconfig = "{kubeconfig}"\ninterval_seconds = 1.0\n'

    env = {fakenvml.CONFIG_ENV: str(sim.config)}
    with running_crihook(containerd.address, root / "crihook", config, env) as proxy:
        yield Node(sim, proxy, kubelet_root / "pods")


@pytest.fixture
def node(containerd: Containerd, tmp_path: Path) -> Iterator[Node]:
    with gpu_node(containerd, tmp_path, None) as n:
        yield n


@pytest.fixture
def kubelet(node: Node) -> Iterator[Kubelet]:
    with Cri(node.proxy.address) as cri, contextlib.ExitStack() as stack:
        yield Kubelet(node.sim, cri, node.pods_dir, stack=stack)


@pytest.mark.runtimes("1.6", "2")
def test_eight_placed_pods_start_with_exactly_their_gpus(node: Node, kubelet: Kubelet) -> None:
    """The extender placed pod i on minor i; kubelet's plugin handed pod i minor i+1 (another order),
    so every chosen GPU is some other pod's plugin GPU in the checkpoint."""
    pods = [pod_config(f"train-{i}", annotations=placed(node.sim, i)) for i in range(8)]
    for i, pod in enumerate(pods):  # kubelet admits the batch, then its pod workers run
        kubelet.admit(pod, [(i + 1) % 8])
    started = [kubelet.sync(pod) for pod in pods]
    for i, cid in enumerate(started):
        sees_exactly(node.sim, kubelet.cri, cid, {i})
    again = kubelet.restart(pods[3], started[3])
    sees_exactly(node.sim, kubelet.cri, again, {3})
    assert "refused" not in node.proxy.log_text()


def test_a_plugin_pod_keeps_its_gpu_and_is_not_given_away(node: Node, kubelet: Kubelet) -> None:
    """A pod bound with spec.nodeName (no allocation annotation) keeps what the plugin gave it; a
    pod the extender places on that GPU is refused, either way round."""
    plugin_pod = pod_config("bound-by-name")
    kubelet.admit(plugin_pod, [5])
    sees_exactly(node.sim, kubelet.cri, kubelet.sync(plugin_pod), {5}, plugin=True)

    late = pod_config("placed-on-5", annotations=placed(node.sim, 5))
    kubelet.admit(late, [6])
    with pytest.raises(CriError) as err:
        kubelet.sync(late)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert f"is held by live pod {plugin_pod.metadata.uid} container main through the device plugin" in (
        err.value.details
    )

    # the other way round: the extender's pod runs on minor 2, then kubelet hands minor 2 to a new
    # spec.nodeName pod (it believes minor 2 free: it gave the extender's pod minor 7)
    first = pod_config("placed-on-2", annotations=placed(node.sim, 2))
    kubelet.admit(first, [7])
    sees_exactly(node.sim, kubelet.cri, kubelet.sync(first), {2})
    second = pod_config("bound-later")
    kubelet.admit(second, [2])
    with pytest.raises(CriError) as err:
        kubelet.sync(second)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert f"GPU minor 2 ({node.sim.uuid(2)}), which live pod {first.metadata.uid} uses" in err.value.details


def test_the_reporter_publishes_plugin_gpus_and_the_allocator_keeps_off(containerd: Containerd, tmp_path: Path) -> None:
    """The reporter publishes what the plugin holds for pods the scheduler did not place (not the
    phantom entries of pods it did); the extender's allocator, fed that Device, counts it as used."""
    with FakeKube() as kube:
        kube.create("nodes", {"metadata": {"name": NODE}, "status": {"capacity": {}, "allocatable": {}}})
        kubeconfig = str(kube.write_kubeconfig(tmp_path / "kubeconfig"))
        node = gpu_node(containerd, tmp_path / "n", None, kubeconfig)
        with node as n, Cri(n.proxy.address) as cri, contextlib.ExitStack() as stack:
            kubelet = Kubelet(n.sim, cri, n.pods_dir, stack=stack)
            extender = pod_config("placed-on-2", annotations=placed(n.sim, 2))
            kubelet.admit(extender, [7])  # a phantom: the hook gives it minor 2
            sees_exactly(n.sim, cri, kubelet.sync(extender), {2})
            # admitted after the extender's pod started: a Device listing it was computed after that
            by_name = pod_config("bound-by-name")
            kubelet.admit(by_name, [5])
            sees_exactly(n.sim, cri, kubelet.sync(by_name), {5}, plugin=True)

            def published() -> Any:
                device = kube.get("devices", NODE)
                text = device["metadata"].get("annotations", {}).get(PLUGIN_HELD)
                return device if text and by_name.metadata.uid in text else None

            device = wait_for(published)
        held = json.loads(device["metadata"]["annotations"][PLUGIN_HELD])
        assert [(h["podUID"], h["minors"]) for h in held] == [(by_name.metadata.uid, [5])]

    ds = DeviceShare()
    ds.set_node(node_from_device(device))
    extender_pod = {"metadata": {"name": "placed-on-2", "uid": extender.metadata.uid, "annotations": placed(n.sim, 2)}}
    ds.add_pod(pod_from_json({**extender_pod, "spec": {"containers": [{"name": "main"}]}}), NODE)
    given = []
    for i in range(6):
        req = ds.pre_filter(pod_from_json(one_gpu_pod(f"new-{i}")))
        given += [g.minor for g in ds.reserve(req, NODE).gpus]
    assert sorted(given) == [0, 1, 3, 4, 6, 7]
    assert ds.filter(ds.pre_filter(pod_from_json(one_gpu_pod("one-more"))), NODE) is not None


def one_gpu_pod(name: str) -> dict[str, Any]:
    resources = {"requests": {RESOURCE: "1"}, "limits": {RESOURCE: "1"}}
    return {"metadata": {"name": name, "uid": name}, "spec": {"containers": [{"name": "main", "resources": resources}]}}


def wait_for(check: Any, seconds: float = 20) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(KeyError, ApiError):
            value = check()
            if value:
                return value
        time.sleep(0.1)
    raise AssertionError("condition not met in time")


@pytest.mark.parametrize("where", ["elsewhere", "missing"])
def test_another_kubelet_root_dir_keeps_the_conflict_check(containerd: Containerd, tmp_path: Path, where: str) -> None:
    """kubelet --root-dir=.../data/kubelet: the checkpoint stays in .../device-plugins beside the old
    root, the pods dir moves. crihook finds it from kubelet's command line. Where crihook can not
    see that pods dir ("missing": say another mount namespace), every holder counts as live, and
    crihook says so in its log."""
    actual = tmp_path / "data" / "kubelet"
    told = actual if where == "elsewhere" else tmp_path / "not-mounted" / "kubelet"
    with gpu_node(containerd, tmp_path / "n", told) as n, Cri(n.proxy.address) as cri, contextlib.ExitStack() as st:
        kubelet = Kubelet(n.sim, cri, actual / "pods", stack=st)
        holder = pod_config("holder")
        kubelet.admit(holder, [4])
        sees_exactly(n.sim, cri, kubelet.sync(holder), {4}, plugin=True)
        pod = pod_config("placed-on-4", annotations=placed(n.sim, 4))
        kubelet.admit(pod, [0])
        with pytest.raises(CriError, match=f"held by live pod {holder.metadata.uid}"):
            kubelet.sync(pod)
        log = n.proxy.log_text()
        if where == "missing":
            assert "kubelet pods dir missing: device-plugin holders count as live" in log and str(told) in log
        else:
            assert "kubelet pods dir found" in log and str(actual / "pods") in log
            (actual / "pods" / holder.metadata.uid).rmdir()  # kubelet cleaned the holder up: its entry lingers
            sees_exactly(n.sim, cri, kubelet.sync(pod), {4})


def cdi_spec(node: SimNode, kind: str) -> dict[str, Any]:
    """A CDI spec as nvidia-ctk or the plugin writes one (device names by UUID and index, "all"),
    each device a real GPU node plus an env the test can see (format: the CDI specification,
    cncf-tags/container-device-interface SPEC.md)."""
    minors = [g["minor"] for g in node.doc["gpus"]]

    def edits(ms: list[int]) -> dict[str, Any]:
        return {
            "deviceNodes": [{"path": f"/dev/nvidia{m}", "hostPath": f"{node.dev_root}/nvidia{m}"} for m in ms],
            "env": [f"CDI_GPU_{m}=1" for m in ms],
        }

    devices = [{"name": node.uuid(m), "containerEdits": edits([m])} for m in minors]
    devices += [{"name": str(i), "containerEdits": edits([m])} for i, m in enumerate(minors)]
    devices.append({"name": "all", "containerEdits": edits(minors)})
    return {"cdiVersion": "0.6.0", "kind": kind, "devices": devices}


@pytest.mark.runtimes("1.7", "2")
def test_no_gpu_escapes_through_cdi(node: Node, kubelet: Kubelet, cdi_spec_dir: Path) -> None:
    """containerd 1.7 and 2.x with CDI on and specs for both kinds present: a leftover cdi.k8s.io
    annotation or CDI_devices entry would really inject its GPU."""
    (cdi_spec_dir / "plugin.json").write_text(json.dumps(cdi_spec(node.sim, PLUGIN_CDI_KIND)))
    (cdi_spec_dir / "ctk.json").write_text(json.dumps(cdi_spec(node.sim, "nvidia.com/gpu")))
    kubelet.strategy = "cdi"

    # the control: a spec.nodeName pod keeps its plugin GPU, injected by containerd from the spec
    plugin_pod = pod_config("bound-by-name")
    kubelet.admit(plugin_pod, [1])
    cid = kubelet.sync(plugin_pod)
    assert env_of(kubelet.cri, cid).get("CDI_GPU_1") == "1" and gpu_nodes(kubelet.cri, cid) == {1}

    # placed on minor 3, the plugin gave minor 6 by annotation and CDI_devices; a webhook left more
    pod = pod_config("placed-on-3", annotations=placed(node.sim, 3))
    kubelet.admit(pod, [6])
    config = kubelet.config(pod, "main")
    config.annotations["cdi.k8s.io/from-a-webhook"] = "nvidia.com/gpu=all"
    config.CDI_devices.add(name="nvidia.com/gpu=0")
    (kubelet.pods_dir / pod.metadata.uid).mkdir(parents=True)
    pod_id = kubelet.stack.enter_context(kubelet.cri.pod(pod))
    cid = kubelet.stack.enter_context(kubelet.cri.container(pod_id, config, pod))
    env = env_of(kubelet.cri, cid)
    assert not [k for k in env if k.startswith("CDI_GPU_")], env
    sees_exactly(node.sim, kubelet.cri, cid, {3})

    # a pod crihook gave no GPU, carrying CDI requests of its own
    bare = pod_config("no-gpu")
    config = container_config("main", bare, annotations={"cdi.k8s.io/image": f"{PLUGIN_CDI_KIND}={node.sim.uuid(2)}"})
    config.CDI_devices.add(name="nvidia.com/gpu=all")
    pod_id = kubelet.stack.enter_context(kubelet.cri.pod(bare))
    cid = kubelet.stack.enter_context(kubelet.cri.container(pod_id, config, bare))
    env = env_of(kubelet.cri, cid)
    assert env["NVIDIA_VISIBLE_DEVICES"] == "void" and not [k for k in env if k.startswith("CDI_GPU_")]
    assert gpu_nodes(kubelet.cri, cid) == set()
