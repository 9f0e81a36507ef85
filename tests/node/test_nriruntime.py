"""The NRI refusals: which runtime applies what (docs/nri.md), and that crihook refuses exactly the
changes the runtime would not carry out. The oracle `applied` plays the runtime: containerd's NRI
merge (pkg/adaptation/result.go) then the spec generator (pkg/runtime-tools/generate/generate.go),
as read at containerd 1.7.24 (NRI v0.6.1) and 2.1.9 (NRI v0.8.0)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crihook.base.spec import Device, Mount
from crihook.hooks.base import ContainerInfo, LinuxResources
from crihook.hooks.reach import DeviceRule, Verdict
from crihook.node.nriruntime import (
    Answer,
    NriRuntime,
    answer,
    deniable,
    escapes,
    nri_runtime,
    opened_gpus,
    start_refusal,
    unapplied,
    update_unapplied,
)


@pytest.mark.parametrize(
    ("name", "version", "nri", "mounts", "cdi", "oom", "rules"),
    [
        ("containerd", "v1.7.24", (0, 6, 1), False, False, False, False),  # trixie
        ("containerd", "1.7.25", (0, 6, 1), False, False, False, False),
        ("containerd", "v1.7.26", (0, 8, 0), True, False, True, False),  # CDI injector not wired
        ("containerd", "v1.7.29", (0, 8, 0), True, False, True, False),
        ("containerd", "v1.7.30", (0, 8, 0), True, True, True, False),
        ("containerd", "v2.0.7", (0, 8, 0), True, False, True, False),
        ("containerd", "2.1.9+unknown", (0, 8, 0), True, True, True, False),  # sid
        ("containerd", "v2.2.0", (0, 10, 0), True, True, True, True),
        ("containerd", "v2.2.3", (0, 11, 0), True, True, True, True),
        ("containerd", "2.3", (0, 11, 0), True, True, True, True),  # sends its NRI release itself
        ("containerd", "1.6.20~ds1", None, False, False, False, False),  # no NRI
        ("containerd", "devel", None, False, False, False, False),  # unparsable: the least
        ("cri-o", "1.31.0", None, False, False, False, False),  # not read: the least
    ],
)
def test_what_each_runtime_applies(
    name: str, version: str, nri: tuple[int, int, int] | None, mounts: bool, cdi: bool, oom: bool, rules: bool
) -> None:
    rt = nri_runtime(name, version)
    assert (rt.nri, rt.removes_mounts, rt.cdi_devices, rt.oom_score_adj, rt.device_rules) == (
        nri,
        mounts,
        cdi,
        oom,
        rules,
    )
    assert rt.ref == f"{name} {version}"


@pytest.mark.parametrize(
    ("version", "nri_version", "nri", "rules"),
    [
        ("v2.3.0", "v0.12.5", (0, 12, 5), True),  # NRI v0.12+ says which it runs
        ("v2.1.9", "v0.10.0", (0, 10, 0), True),  # its word wins over the table
        ("v2.2.1", "v0.8.0", (0, 8, 0), False),
        ("v2.2.1", "", (0, 11, 0), True),  # before v0.12: read off containerd's version
        ("v2.2.1", "unknown", (0, 11, 0), True),  # NRI's stub says "unknown" when it does not know
    ],
)
def test_the_nri_release_configure_names_decides(
    version: str, nri_version: str, nri: tuple[int, int, int], rules: bool
) -> None:
    rt = nri_runtime("containerd", version, nri_version)
    assert (rt.nri, rt.device_rules, rt.removes_mounts) == (nri, rules, nri >= (0, 8, 0))


# -- the oracle: what the runtime makes of crihook's adjustment -------------------------------------


def applied(before: ContainerInfo, after: ContainerInfo, rt: NriRuntime) -> ContainerInfo:
    """The container as the runtime builds it when crihook sends the difference before → after."""
    env = dict(before.envs)
    for k, v in after.envs:
        if before.env(k) != v:
            env[k] = v  # set: replaced in place or appended; a "-NAME" removal never arrives
    devices = {d.container_path: d for d in before.devices}
    devices.update({d.container_path: d for d in after.devices})  # removals never arrive
    mounts = {m.container_path: m for m in before.mounts}
    if rt.removes_mounts:
        kept = {m.container_path for m in after.mounts}
        mounts = {p: m for p, m in mounts.items() if p in kept}
    mounts.update({m.container_path: m for m in after.mounts})
    cdi = set(before.cdi_devices) | (set(after.cdi_devices) if rt.cdi_devices else set())
    return replace(
        before,
        envs=tuple(env.items()),
        devices=tuple(devices.values()),
        mounts=tuple(mounts.values()),
        cdi_devices=tuple(sorted(cdi)),
    )


def same(a: ContainerInfo, b: ContainerInfo) -> bool:
    return (
        dict(a.envs) == dict(b.envs)
        and {d.container_path: d for d in a.devices} == {d.container_path: d for d in b.devices}
        and {m.container_path: m for m in a.mounts} == {m.container_path: m for m in b.mounts}
        and set(a.cdi_devices) == set(b.cdi_devices)
    )


KEYS = st.sampled_from(["NVIDIA_VISIBLE_DEVICES", "A", "B", "LD_PRELOAD"])
PATHS = st.sampled_from(["/dev/nvidia0", "/dev/nvidia3", "/dev/nvidiactl", "/dev/infiniband/uverbs0"])
DIRS = st.sampled_from(["/usr/lib/hami", "/etc/ld.so.preload", "/var/run/nvidia-container-devices/GPU-1"])
CDI = st.sampled_from(["nvidia.com/gpu=0", "nvidia.com/gpu=GPU-1", "vendor.com/nic=a"])
RUNTIMES = st.sampled_from(
    [nri_runtime("containerd", v) for v in ("v1.7.24", "v1.7.26", "v1.7.30", "v2.0.7", "2.1.9+unknown")]
)


@st.composite
def containers(draw: st.DrawFn) -> ContainerInfo:
    return ContainerInfo(
        name="main",
        envs=tuple(draw(st.dictionaries(KEYS, st.sampled_from(["all", "void", "x"]), max_size=3)).items()),
        devices=tuple(Device(p, p, draw(st.sampled_from(["rw", "rwm"]))) for p in draw(st.sets(PATHS, max_size=3))),
        mounts=tuple(Mount(p, "/host" + p, draw(st.booleans())) for p in draw(st.sets(DIRS, max_size=2))),
        cdi_devices=tuple(sorted(draw(st.sets(CDI, max_size=2)))),
    )


@st.composite
def edited(draw: st.DrawFn) -> tuple[ContainerInfo, ContainerInfo]:
    """A container and what some hooks made of it: entries kept, changed, dropped or added."""
    before = draw(containers())
    extra = draw(containers())

    def pick(old: tuple, new: tuple, key: str) -> tuple:
        kept = tuple(e for e in old if draw(st.booleans()))
        have = {getattr(e, key) if key else e[0] for e in kept}
        return kept + tuple(e for e in new if (getattr(e, key) if key else e[0]) not in have and draw(st.booleans()))

    after = replace(
        before,
        envs=pick(before.envs, extra.envs, ""),
        devices=pick(before.devices, extra.devices, "container_path"),
        mounts=pick(before.mounts, extra.mounts, "container_path"),
        cdi_devices=tuple(sorted(set(before.cdi_devices) | set(draw(st.sets(CDI, max_size=2))))),
    )
    return before, after


@given(edited(), RUNTIMES)
def test_refused_exactly_when_the_runtime_would_not_build_what_the_hooks_decided(
    pair: tuple[ContainerInfo, ContainerInfo], rt: NriRuntime
) -> None:
    before, after = pair
    reasons = unapplied(before, after, rt)
    assert (reasons == []) == same(applied(before, after, rt), after), reasons


def test_the_reasons_name_what_and_which_runtime_would_take_it() -> None:
    gpu = Device("/dev/nvidia3", "/dev/nvidia3")
    before = ContainerInfo(
        name="main",
        envs=(("NVIDIA_VISIBLE_DEVICES", "all"), ("PLUGIN_ENV", "1")),
        devices=(gpu,),
        mounts=(Mount("/var/run/nvidia-container-devices/GPU-1", "/dev/null"),),
    )
    after = replace(before, envs=(("NVIDIA_VISIBLE_DEVICES", "void"),), devices=(), mounts=(), cdi_devices=("x=y",))
    assert unapplied(before, after, nri_runtime("containerd", "v1.7.24")) == [
        "removing env PLUGIN_ENV (no NRI version applies env removals)",
        "removing device /dev/nvidia3 (no NRI version applies device removals)",
        "removing mount /var/run/nvidia-container-devices/GPU-1 (needs containerd 1.7.26 or 2.0)",
        "adding CDI device x=y (needs containerd 2.1 or 1.7.30)",
    ]
    assert unapplied(before, after, nri_runtime("containerd", "2.1.9+unknown")) == [
        "removing env PLUGIN_ENV (no NRI version applies env removals)",
        "removing device /dev/nvidia3 (no NRI version applies device removals)",
    ]
    # overwriting an image's NVIDIA_VISIBLE_DEVICES=all, and replacing a node, are applied everywhere
    swap = replace(before, envs=(("NVIDIA_VISIBLE_DEVICES", "void"), ("PLUGIN_ENV", "1")))
    swap = replace(swap, devices=(Device("/dev/nvidia3", "/dev/nvidia5"),))
    assert unapplied(before, swap, nri_runtime("containerd", "v1.7.24")) == []


def test_a_privileged_container_keeps_its_device_nodes_without_a_refusal() -> None:
    """Its wildcard rule reaches the device whether the node stays or not: only the device removal
    is waived, never what else the runtime would drop."""
    before = ContainerInfo(
        name="agent",
        envs=(("NVIDIA_VISIBLE_DEVICES", "all"), ("X", "1")),
        devices=(Device("/dev/nvidia3", "/dev/nvidia3"),),
    )
    after = replace(before, envs=(("NVIDIA_VISIBLE_DEVICES", "void"),), devices=())
    rt = nri_runtime("containerd", "2.1.9")
    assert unapplied(before, after, rt, every_device=True) == ["removing env X (no NRI version applies env removals)"]
    assert len(unapplied(before, after, rt)) == 2


def test_an_env_set_twice_can_not_be_changed() -> None:
    before = ContainerInfo(name="main", envs=(("NVIDIA_VISIBLE_DEVICES", "all"), ("NVIDIA_VISIBLE_DEVICES", "0")))
    after = replace(before, envs=(("NVIDIA_VISIBLE_DEVICES", "void"),))
    assert unapplied(before, after, nri_runtime("containerd", "2.1.9")) == [
        "changing env NVIDIA_VISIBLE_DEVICES, set 2 times (NRI replaces the first only)"
    ]


def test_resources_nri_can_not_set() -> None:
    before = ContainerInfo(name="main", resources=LinuxResources(memory_limit_in_bytes=1 << 30))
    after = replace(
        before,
        resources=LinuxResources(
            memory_limit_in_bytes=2 << 30, cpu_shares=512, oom_score_adj=500, memory_swap_limit_in_bytes=4 << 30
        ),
    )
    assert unapplied(before, after, nri_runtime("containerd", "v1.7.24")) == [
        "setting oom_score_adj (needs containerd 1.7.26 or 2.0)",
        "setting memory_swap_limit_in_bytes (needs proxy mode)",
    ]
    assert unapplied(before, after, nri_runtime("containerd", "v2.1.9")) == [
        "setting memory_swap_limit_in_bytes (needs proxy mode)"
    ]


def test_start_refusal_names_the_runtime_and_the_one_that_would_take_it() -> None:
    old = nri_runtime("containerd", "v1.7.24")
    msg = start_refusal(old, cdi_inject=True)
    assert msg is not None and "containerd v1.7.24 drops" in msg and "containerd 2.1 or 1.7.30" in msg
    assert start_refusal(old, cdi_inject=False) is None
    assert start_refusal(nri_runtime("containerd", "2.1.9+unknown"), cdi_inject=True) is None


def test_what_an_nri_update_can_not_carry() -> None:
    before = ContainerInfo(name="main", resources=LinuxResources(cpu_shares=1024, memory_limit_in_bytes=1 << 30))
    assert update_unapplied(before, replace(before, resources=LinuxResources(cpu_shares=512))) == [
        "clearing memory_limit_in_bytes (an update of 0 or empty leaves the container's value as it is)"
    ]
    grown = replace(before, resources=LinuxResources(cpu_shares=2048, memory_limit_in_bytes=2 << 30, oom_score_adj=5))
    assert update_unapplied(before, grown) == ["setting oom_score_adj (a container's is fixed at its creation)"]
    annotated = replace(before, annotations={"a": "1"})
    assert update_unapplied(before, annotated) == [
        "changing annotations (NRI's UpdateContainer carries resources only)"
    ]
    assert (
        update_unapplied(before, replace(before, resources=LinuxResources(cpu_shares=1, memory_limit_in_bytes=1))) == []
    )


def test_device_access_narrower_than_rw_needs_device_rules() -> None:
    before = ContainerInfo(name="main")
    ro = replace(before, devices=(Device("/dev/fuse", "/dev/fuse", "r"),))
    assert unapplied(before, ro, nri_runtime("containerd", "2.1.9")) == [
        "giving device /dev/fuse access 'r' (NRI before v0.10 gives every device node it adds rw; needs containerd 2.2)"
    ]
    assert unapplied(before, ro, nri_runtime("containerd", "2.2.0")) == []  # carried as a deny rule
    wider = replace(before, devices=(Device("/dev/fuse", "/dev/fuse", "rwm"),))
    assert unapplied(before, wider, nri_runtime("containerd", "1.7.24")) == []  # mknod less: never more access


def test_a_mount_to_relabel_is_refused_where_selinux_labels() -> None:
    before = ContainerInfo(name="main")
    after = replace(before, mounts=(Mount("/data", "/srv/data", selinux_relabel=True),))
    rt = nri_runtime("containerd", "2.1.9")
    assert unapplied(before, after, rt) == ["relabeling mount /data for SELinux (an NRI adjustment can not ask for it)"]
    assert unapplied(before, after, rt, selinux=False) == []  # containerd's relabel is a no-op there too


@pytest.mark.parametrize(
    ("field", "old", "new"),
    [("memory_limit_in_bytes", 1 << 30, 0), ("cpuset_cpus", "0-3", ""), ("cpuset_mems", "0", "")],
)
def test_a_limit_of_0_or_an_empty_cpuset_is_refused_not_sent(field: str, old: int | str, new: int | str) -> None:
    before = ContainerInfo(name="main", resources=LinuxResources(**{field: old}))
    after = replace(before, resources=LinuxResources(**{field: new}))
    assert unapplied(before, after, nri_runtime("containerd", "2.2.0")) == [
        f"clearing {field} (no NRI version applies a memory limit of 0 or an empty cpuset: the value stays)"
    ]


def rule(allow: bool, minor: int | None, access: str = "rw", major: int | None = 195) -> DeviceRule:
    return DeviceRule(allow, "c" if major is not None else "a", major, minor, access)


def test_the_gpus_a_device_cgroup_opens_the_last_matching_rule_deciding() -> None:
    deny_all = DeviceRule(False, "a", None, None, "rwm")
    assert opened_gpus([deny_all, rule(True, 0), rule(True, 3), rule(False, 0, "rwm")]) == {3}
    assert opened_gpus([deny_all, rule(True, 2, "m")]) == frozenset()  # mknod alone opens nothing
    assert opened_gpus([deny_all, rule(True, None), rule(False, 5, "rwm")]) == frozenset(range(254)) - {5}
    assert opened_gpus([deny_all, rule(True, 255)]) == frozenset()  # nvidiactl is no GPU
    assert opened_gpus([DeviceRule(True, "a", None, None, "rwm")]) is None  # privileged: every device


def test_what_a_final_adjustment_gives_beyond_crihooks_answer() -> None:
    own = Answer(frozenset({1}), "GPU-1", frozenset({"nvidia.com/gpu=GPU-1"}))
    assert escapes(own, own) == []
    assert escapes(own, Answer(frozenset({1, 4}), "GPU-1", own.cdi)) == [
        "GPU minor 4 through a device node or device-cgroup rule"
    ]
    assert escapes(own, Answer(None, "GPU-1", own.cdi)) == ["a device-cgroup rule allowing every device"]
    assert escapes(own, Answer(own.opened, "all", own.cdi | {"nvidia.com/gpu=GPU-0"})) == [
        "NVIDIA_VISIBLE_DEVICES=all where crihook set GPU-1",
        "CDI device nvidia.com/gpu=GPU-0",
    ]
    assert escapes(Answer(None, None, frozenset()), Answer(None, None, frozenset())) == []  # privileged
    assert answer([rule(True, 2)], None, ["nvidia.com/gpu=0", "vendor.com/nic=a"]).cdi == {"nvidia.com/gpu=0"}


def test_a_gpu_named_in_the_visible_devices_can_not_be_denied() -> None:
    by_node = Verdict({0: ("device node /dev/nvidia0 (c 195:0)", "device-cgroup rule")}, (0,))
    assert deniable(by_node)
    by_env = Verdict({0: ("device-cgroup rule", "NVIDIA_VISIBLE_DEVICES=GPU-0")}, (0,))
    assert not deniable(by_env)
