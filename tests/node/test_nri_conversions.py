"""NRI's PodSandbox and Container as the hooks see them, and the hooks' result as a ContainerAdjustment.
The round trip plays the runtime: the adjustment applied to the NRI container the way containerd's
spec generator applies it (env and devices set by key, "-" marks on mounts and annotations), read
back, is what the hooks decided whenever nothing had to be refused."""

from __future__ import annotations

import json
from dataclasses import replace

from hypothesis import given

from crihook.base.spec import Device, Mount
from crihook.hooks.base import ContainerInfo, LinuxResources
from crihook.hooks.reach import DeviceNode, DeviceRule, every_device
from crihook.node.container import (
    DeviceNumber,
    adjusted_rules,
    nri_adjustment,
    nri_container_view,
    nri_listed_container,
    nri_reach,
    nri_rules,
    spec_container,
)
from crihook.node.nriruntime import nri_runtime, unapplied
from crihook.node.pod import nri_pod_view
from crihook.proto import nri_v1alpha1_pb2 as nri
from tests.node.test_nriruntime import edited

RUNTIME = nri_runtime("containerd", "2.1.9+unknown")


def node_of(path: str) -> tuple[DeviceNumber, int]:
    digits = "".join(ch for ch in path if ch.isdigit())
    return ("c", 195, int(digits or 255)), 0o666


def as_nri(c: ContainerInfo) -> nri.Container:
    """A container as containerd would show it to NRI (the test's inverse of nri_container_view)."""
    msg = nri.Container(id="c1", pod_sandbox_id="p1", name=c.name, env=[f"{k}={v}" for k, v in c.envs])
    msg.annotations.update(c.annotations)
    for m in c.mounts:
        msg.mounts.add(
            destination=m.container_path,
            source=m.host_path,
            type="bind",
            options=["rbind", "rprivate", "ro" if m.readonly else "rw"],
        )
    for d in c.devices:
        (kind, major, minor), mode = node_of(d.host_path)
        dev = msg.linux.devices.add(path=d.container_path, type=kind, major=major, minor=minor)
        dev.file_mode.value = mode
    msg.CDI_devices.extend(nri.CDIDevice(name=n) for n in c.cdi_devices)
    return msg


def apply(msg: nri.Container, adj: nri.ContainerAdjustment) -> nri.Container:
    """pkg/runtime-tools/generate/generate.go's Adjust, on the fields crihook writes."""
    out = nri.Container()
    out.CopyFrom(msg)
    for k, v in adj.annotations.items():
        if k.startswith("-"):
            out.annotations.pop(k[1:], None)
        else:
            out.annotations[k] = v
    env = dict(e.split("=", 1) for e in out.env)
    env.update({kv.key: kv.value for kv in adj.env})
    del out.env[:]
    out.env.extend(f"{k}={v}" for k, v in env.items())
    for m in adj.mounts:
        kept = [x for x in out.mounts if x.destination != m.destination.lstrip("-")]
        del out.mounts[:]
        out.mounts.extend(kept + ([] if m.destination.startswith("-") else [m]))
    for d in adj.linux.devices:
        kept_d = [x for x in out.linux.devices if x.path != d.path]
        del out.linux.devices[:]
        out.linux.devices.extend([*kept_d, d])
    out.CDI_devices.extend(adj.CDI_devices)
    return out


@given(edited())
def test_the_adjustment_makes_the_runtime_build_what_the_hooks_decided(
    pair: tuple[ContainerInfo, ContainerInfo],
) -> None:
    before_info, after = pair
    msg = as_nri(before_info)
    before = nri_container_view(msg)
    after = replace(after, id=before.id, annotations=dict(after.annotations))
    if unapplied(before, after, RUNTIME):
        return
    built = nri_container_view(apply(msg, nri_adjustment(before, after, node_of)))
    assert dict(built.envs) == dict(after.envs)
    assert {m.container_path: (m.host_path, m.readonly) for m in built.mounts} == {
        m.container_path: (m.host_path, m.readonly) for m in after.mounts
    }
    assert {d.container_path for d in built.devices} == {d.container_path for d in after.devices}
    assert set(built.cdi_devices) == set(after.cdi_devices)


def test_nothing_changed_is_an_empty_adjustment() -> None:
    c = ContainerInfo(name="main", envs=(("A", "1"),), devices=(Device("/dev/nvidia0", "/dev/nvidia0"),))
    assert nri_adjustment(c, c, node_of) == nri.ContainerAdjustment()


def test_container_view() -> None:
    msg = nri.Container(
        id="c1", pod_sandbox_id="p1", name="cuda", env=["PATH=/bin", "OPTS=a=b", "EMPTY="], state=nri.CONTAINER_RUNNING
    )
    msg.annotations.update({"io.kubernetes.container.restartCount": "2", "io.kubernetes.cri.image-name": "cuda:12"})
    msg.labels["io.kubernetes.container.name"] = "cuda"
    msg.mounts.add(destination="/data", source="/srv/data", options=["rbind", "rslave", "ro"])
    msg.mounts.add(destination="/cache", source="/srv/cache", options=["rprivate", "rshared", "rw"])  # the first
    msg.mounts.add(destination="/proc", source="proc", type="proc")
    dev = msg.linux.devices.add(path="/dev/nvidia3", type="c", major=195, minor=3)
    dev.file_mode.value = 0o644
    msg.linux.resources.devices.add(allow=True, type="c", access="rw").major.value = 195
    msg.linux.resources.devices[0].minor.value = 3
    msg.linux.resources.devices.add(allow=False, type="a", access="rwm")
    msg.linux.resources.memory.limit.value = 1 << 30
    msg.linux.oom_score_adj.value = 900
    view = nri_container_view(msg)
    assert (view.name, view.attempt, view.id, view.image) == ("cuda", 2, "c1", "cuda:12")
    assert view.envs == (("PATH", "/bin"), ("OPTS", "a=b"), ("EMPTY", ""))
    assert view.mounts == (
        Mount("/data", "/srv/data", readonly=True, propagation=1),
        Mount("/cache", "/srv/cache", propagation=0),
        Mount("/proc", "proc"),
    )
    assert view.devices == (Device("/dev/nvidia3", "/dev/nvidia3", "rw", ("c", 195, 3)),)
    assert view.resources == LinuxResources(memory_limit_in_bytes=1 << 30, oom_score_adj=900)
    reach = nri_reach(msg)
    assert reach.nodes == (DeviceNode("c", 195, 3, "/dev/nvidia3"),)
    assert reach.rules == (DeviceRule(True, "c", 195, 3, "rw"), DeviceRule(False, "a", None, None, "rwm"))
    rec = nri_listed_container(msg)
    assert (rec.id, rec.pod_id, rec.state, rec.attempt, rec.envs["OPTS"]) == ("c1", "p1", "running", 2, "a=b")


def test_adjustment_fields() -> None:
    before = ContainerInfo(
        name="main",
        annotations={"cdi.k8s.io/gpu": "nvidia.com/gpu=1", "keep": "1"},
        envs=(("NVIDIA_VISIBLE_DEVICES", "all"),),
        mounts=(Mount("/old", "/srv/old"),),
        resources=LinuxResources(cpu_shares=2),
    )
    after = replace(
        before,
        annotations={"keep": "1"},
        envs=(("NVIDIA_VISIBLE_DEVICES", "GPU-1"), ("CUDA_DEVICE_ORDER", "PCI_BUS_ID")),
        mounts=(Mount("/usr/lib/hami", "/opt/hami", readonly=True),),
        devices=(Device("/dev/nvidia5", "/dev/nvidia5", "rw"),),
        cdi_devices=("nvidia.com/gpu=GPU-1",),
        resources=LinuxResources(cpu_shares=2, cpuset_cpus="0-3", oom_score_adj=10),
    )
    adj = nri_adjustment(before, after, node_of)
    assert dict(adj.annotations) == {"-cdi.k8s.io/gpu": ""}
    assert [(kv.key, kv.value) for kv in adj.env] == [
        ("NVIDIA_VISIBLE_DEVICES", "GPU-1"),
        ("CUDA_DEVICE_ORDER", "PCI_BUS_ID"),
    ]
    assert [(m.destination, m.source, list(m.options)) for m in adj.mounts] == [
        ("/usr/lib/hami", "/opt/hami", ["rbind", "rprivate", "ro"]),
        ("-/old", "", []),
    ]
    (dev,) = adj.linux.devices
    assert (dev.path, dev.type, dev.major, dev.minor, dev.file_mode.value) == ("/dev/nvidia5", "c", 195, 5, 0o666)
    assert [d.name for d in adj.CDI_devices] == ["nvidia.com/gpu=GPU-1"]
    assert adj.linux.resources.cpu.cpus == "0-3" and not adj.linux.resources.cpu.HasField("shares")
    assert adj.linux.oom_score_adj.value == 10


def test_pod_view() -> None:
    p = nri.PodSandbox(id="p1", name="trainer", uid="u1", namespace="ml", runtime_handler="runc")
    p.annotations["scheduling.koordinator.sh/device-allocated"] = '{"gpu":[{"minor":3}]}'
    p.labels["app"] = "t"
    p.linux.cgroup_parent = "/kubepods/podu1"
    p.linux.pod_resources.cpu.shares.value = 1024
    view = nri_pod_view(p)
    assert (view.ref, view.uid, view.id, view.cgroup_parent, view.runtime_handler) == (
        "ml/trainer",
        "u1",
        "p1",
        "/kubepods/podu1",
        "runc",
    )
    assert view.annotations == {"scheduling.koordinator.sh/device-allocated": '{"gpu":[{"minor":3}]}'}
    assert view.resources == LinuxResources(cpu_shares=1024) and view.overhead is None


def test_a_container_listed_over_cri_as_nri_would_show_it() -> None:
    from crihook.proto import runtime_v1_pb2 as cri

    listed = cri.Container(id="c9", pod_sandbox_id="p9", state=cri.CONTAINER_RUNNING, created_at=5)
    listed.metadata.name, listed.metadata.attempt = "cuda", 1
    spec = {
        "process": {"env": ["NVIDIA_VISIBLE_DEVICES=all"]},
        "linux": {
            "devices": [{"path": "/dev/nvidia1", "type": "c", "major": 195, "minor": 1}],
            "resources": {
                "devices": [{"allow": False, "access": "rwm"}, {"allow": True, "type": "c", "major": 195, "minor": 1}]
            },
        },
    }
    status = cri.ContainerStatusResponse(info={"info": json.dumps({"runtimeSpec": spec})})
    msg = spec_container(listed, status)
    reach = nri_reach(msg)
    assert reach.nodes == (DeviceNode("c", 195, 1, "/dev/nvidia1"),)
    assert reach.rules == (DeviceRule(False, "a", None, None, "rwm"), DeviceRule(True, "c", 195, 1, ""))
    view = nri_container_view(msg)
    assert (view.name, view.attempt, view.env("NVIDIA_VISIBLE_DEVICES")) == ("cuda", 1, "all")
    assert nri_container_view(spec_container(listed, cri.ContainerStatusResponse())).envs == ()


def test_a_privileged_container_listed_over_cri_keeps_its_wildcard_rule() -> None:
    """containerd's spec of a privileged container: every host node and one allow-all rule, which
    the listing must keep (without it every GPU node would look ungranted)."""
    from crihook.proto import runtime_v1_pb2 as cri

    listed = cri.Container(id="dp", pod_sandbox_id="p9", state=cri.CONTAINER_RUNNING)
    spec = {
        "linux": {
            "devices": [{"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0}],
            "resources": {"devices": [{"allow": True, "access": "rwm"}]},
        }
    }
    msg = spec_container(listed, cri.ContainerStatusResponse(info={"info": json.dumps({"runtimeSpec": spec})}))
    assert nri_reach(msg).rules == (DeviceRule(True, "a", None, None, "rwm"),)
    assert every_device(nri_rules(msg))


def rules(*spec: tuple[bool, str, str, int | None]) -> nri.Container:
    """A container whose device-cgroup rules are (allow, type, access, major or None for any), minor
    the same as major."""
    msg = nri.Container(id="c1", name="agent")
    for allow, kind, access, number in spec:
        r = msg.linux.resources.devices.add(allow=allow, type=kind, access=access)
        if number is not None:
            r.major.value, r.minor.value = 195, number
    return msg


def test_a_privileged_container_is_told_by_its_wildcard_allow_rule() -> None:
    # what containerd 1.7.24 and 2.1.9 show NRI for a privileged container: one rule, no type
    assert every_device(nri_rules(rules((True, "", "rwm", None))))
    assert every_device(nri_rules(rules((False, "a", "rwm", None), (True, "a", "rwm", None))))
    # an unprivileged container: deny all, then one rule per device
    assert not every_device(nri_rules(rules((False, "", "rwm", None), (True, "c", "rw", 0))))
    assert not every_device(nri_rules(rules((True, "a", "rwm", None), (False, "a", "rwm", None))))  # the last wins
    assert not every_device(nri_rules(rules((True, "a", "m", None))))  # mknod alone opens nothing
    assert not every_device(nri_rules(rules((True, "c", "rwm", None))))  # every char device but no wildcard
    assert not every_device(nri_rules(rules()))


def test_device_access_is_made_exact_by_rules_where_the_runtime_applies_them() -> None:
    """NRI's runtime allows a node it adds rw (rwm for a block device); NRI v0.10+ then applies the
    adjustment's rules in order, so a rule allowing what is missing and one denying the rest give
    exactly the access the hooks asked for."""
    before = ContainerInfo(name="main")
    after = replace(
        before,
        devices=(
            Device("/dev/nvidia1", "/dev/nvidia1", "r"),
            Device("/dev/nvidia2", "/dev/nvidia2", "rwm"),
            Device("/dev/nvidia3", "/dev/nvidia3", "rw"),
        ),
    )
    rules = nri_adjustment(before, after, node_of, device_rules=True).linux.resources.devices
    assert [(r.allow, r.type, r.major.value, r.minor.value, r.access) for r in rules] == [
        (False, "c", 195, 1, "w"),
        (True, "c", 195, 2, "m"),
    ]
    assert not nri_adjustment(before, after, node_of).linux.resources.devices  # not before NRI v0.10


def test_removed_nodes_and_ungranted_gpus_are_denied_where_the_runtime_applies_rules() -> None:
    gpu0 = Device("/dev/nvidia0", "/dev/nvidia0", "rw", ("c", 195, 0))
    gpu1 = Device("/dev/nvidia1", "/dev/nvidia1", "rw", ("c", 195, 1))
    before = ContainerInfo(name="main", devices=(gpu0, gpu1))
    after = replace(before, devices=(gpu1, Device("/dev/nvidia-moved", "/dev/nvidia2", "rw")))
    adj = nri_adjustment(before, after, node_of, device_rules=True, deny_gpus=[7])
    denied = [(r.type, r.major.value, r.minor.value, r.access) for r in adj.linux.resources.devices if not r.allow]
    assert denied == [("c", 195, 0, "rwm"), ("c", 195, 7, "rwm")]  # GPU 1 kept, GPU 2 given
    assert [(r.allow, r.kind, r.major, r.minor) for r in adjusted_rules(adj)] == [
        (True, "c", 195, 2),  # the runtime's allow rule for the node added, before the adjustment's rules
        (False, "c", 195, 0),
        (False, "c", 195, 7),
    ]
    # the allow rules of nodes left out by number; the adjustment's own rules stay whatever they name
    assert [(r.allow, r.major, r.minor) for r in adjusted_rules(adj, unless={("c", 195, 2), ("c", 195, 0)})] == [
        (False, 195, 0),
        (False, 195, 7),
    ]
    assert not nri_adjustment(before, after, node_of).linux.resources.devices  # NRI before v0.10 ignores rules
