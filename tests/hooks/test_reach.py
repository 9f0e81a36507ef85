"""Which GPUs a container reaches and which nobody granted: examples for each way in, and
properties over every combination hypothesis draws (no finding without a GPU of the node reached
and ungranted, paths never matter, privilege and grants only ever take findings away)."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from crihook.hooks.reach import (
    BY_RULE,
    DeviceNode,
    DeviceRule,
    Gpu,
    Grants,
    Reach,
    judge,
    named,
    visible_names,
)

# NVML index and minor differ on purpose: minor 3 is index 0, and so on
GPUS = (
    Gpu(minor=3, index=0, uuid="GPU-aaaa"),
    Gpu(minor=0, index=1, uuid="GPU-bbbb", mig=((0, "MIG-b0"), (1, "MIG-b1"))),
    Gpu(minor=1, index=2, uuid="GPU-cccc"),
    Gpu(minor=2, index=3, uuid="GPU-dddd"),
)
DENY_ALL = DeviceRule(allow=False)
NONE = Grants()


def gpu_node(minor: int, path: str = "") -> DeviceNode:
    return DeviceNode("c", 195, minor, path or f"/dev/nvidia{minor}")


def test_a_node_is_its_numbers_not_its_path() -> None:
    fake = Reach(nodes=(gpu_node(0, "/dev/nvidia-fake0"),), rules=(DENY_ALL, DeviceRule(True, "c", 195, 0, "rw")))
    v = judge(fake, NONE, GPUS)
    assert v.ungranted == (0,)
    assert "/dev/nvidia-fake0 (c 195:0)" in v.describe()
    misnamed = Reach(nodes=(DeviceNode("c", 195, 3, "/dev/nvidia0"),))
    assert judge(misnamed, NONE, GPUS).ungranted == (3,)
    assert judge(misnamed, Grants(scheduler=frozenset({3})), GPUS).ungranted == ()
    # nvidiactl, nvidia-modeset, block devices and other majors are no GPU
    others = (DeviceNode("c", 195, 255), DeviceNode("c", 195, 254), DeviceNode("b", 195, 0), DeviceNode("c", 1, 3))
    assert judge(Reach(nodes=others), NONE, GPUS).reached == {}


def test_a_node_the_cgroup_denies_reaches_nothing_and_a_rule_alone_reaches() -> None:
    denied = Reach(nodes=(gpu_node(1),), rules=(DENY_ALL,))
    assert judge(denied, NONE, GPUS).reached == {}
    # the last matching rule wins
    later_deny = (DENY_ALL, DeviceRule(True, "c", 195, 1), DeviceRule(False, "c", 195, 1))
    assert judge(Reach(nodes=(gpu_node(1),), rules=later_deny), NONE, GPUS).reached == {}
    rule_only = Reach(rules=(DENY_ALL, DeviceRule(True, "c", 195, 2, "rw")))
    assert judge(rule_only, NONE, GPUS).reached == {2: (BY_RULE,)}
    mknod_only = Reach(rules=(DENY_ALL, DeviceRule(True, "c", 195, 2, "m")))
    assert judge(mknod_only, NONE, GPUS).reached == {}


def test_wildcard_rules() -> None:
    every_gpu = Reach(rules=(DENY_ALL, DeviceRule(True, "c", 195, None, "rwm")))
    v = judge(every_gpu, Grants(scheduler=frozenset({0})), GPUS)
    assert v.ungranted == (1, 2, 3) and not v.privileged
    every_char = Reach(rules=(DENY_ALL, DeviceRule(True, "c", None, None, "rw")))
    assert judge(every_char, NONE, GPUS).ungranted == (0, 1, 2, 3)
    # privileged: containerd's wildcard allow last, every host node given; reached, never ungranted
    privileged = Reach(nodes=tuple(gpu_node(g.minor) for g in GPUS), rules=(DeviceRule(True, "a"),), visible="all")
    v = judge(privileged, NONE, GPUS)
    assert v.privileged and v.ungranted == () and sorted(v.reached) == [0, 1, 2, 3]
    # the same wildcard first, denied after: an ordinary container
    assert not judge(Reach(rules=(DeviceRule(True, "a"), DENY_ALL)), NONE, GPUS).privileged


def test_visible_devices_parsed() -> None:
    assert visible_names(None) == visible_names("") == visible_names(" void ") == visible_names("none") == ()
    assert visible_names("0, 1,") == ("0", "1")

    def minors(value: str) -> list[int]:
        return sorted(judge(Reach(visible=value), NONE, GPUS).reached)

    assert minors("0,1") == [0, 3]  # NVML indexes 0 and 1 are minors 3 and 0
    assert minors("all") == [0, 1, 2, 3]
    assert minors("GPU-cccc") == [1]
    assert minors("MIG-b1") == minors("1:0") == [0]  # a MIG device is its GPU's
    assert minors("nvidia.com/gpu=GPU-dddd") == [2]  # the runtime's CDI form
    assert minors("void") == minors("none") == minors("") == []
    v = judge(Reach(visible="GPU-elsewhere,7"), NONE, GPUS)
    assert (
        v.reached == {}
        and v.ungranted == ()
        and v.unknown
        == (
            "NVIDIA_VISIBLE_DEVICES=GPU-elsewhere",
            "NVIDIA_VISIBLE_DEVICES=7",
        )
    )


def test_cdi_devices() -> None:
    v = judge(Reach(cdi_devices=("nvidia.com/gpu=GPU-aaaa", "k8s.device-plugin.nvidia.com/gpu=2")), NONE, GPUS)
    assert v.ungranted == (1, 3)
    # another kind reaches a GPU only through the nodes its spec brings (numbers, as every node)
    assert judge(Reach(cdi_devices=("vendor.com/fake=gpu0",)), NONE, GPUS).reached == {}
    assert judge(Reach(cdi_devices=("nvidia.com/gpu=GPU-gone",)), NONE, GPUS).unknown == ("nvidia.com/gpu=GPU-gone",)


def test_a_claims_gpu_is_the_claims() -> None:
    """A DRA claim's CDI device (another kind: its node's number is in Grants.claims; a GPU kind:
    the name itself) is kept; without the claim the same container is ungranted."""
    claim = "k8s.gpu.nvidia.com/claim=uid-gpu0"
    reach = Reach(nodes=(gpu_node(0),), cdi_devices=(claim,), rules=(DENY_ALL, DeviceRule(True, "c", 195, 0)))
    assert judge(reach, Grants(claims=frozenset({0}), claim_cdi=frozenset({claim})), GPUS).ungranted == ()
    assert judge(reach, NONE, GPUS).ungranted == (0,)
    gpu_kind = Reach(cdi_devices=("nvidia.com/gpu=GPU-bbbb",))
    assert judge(gpu_kind, Grants(claim_cdi=frozenset({"nvidia.com/gpu=GPU-bbbb"})), GPUS).ungranted == ()


def test_names() -> None:
    assert named("all", GPUS) == GPUS
    assert named("3", GPUS) == (GPUS[3],)
    assert named("vendor.com/x=0", GPUS) is None


# -- properties ------------------------------------------------------------------------------------

minor_ = st.integers(0, 256)
nodes_ = st.builds(DeviceNode, st.sampled_from(["c", "b"]), st.sampled_from([195, 1, 10]), minor_, st.text(max_size=12))
rules_ = st.builds(
    DeviceRule,
    st.booleans(),
    st.sampled_from(["a", "", "c", "b"]),
    st.none() | st.sampled_from([195, 1]),
    st.none() | minor_,
    st.sampled_from(["rwm", "rw", "r", "w", "m", ""]),
)
name_ = st.sampled_from(["all", "0", "1", "7", "GPU-aaaa", "GPU-x", "MIG-b0", "1:1", "nvidia.com/gpu=2", "void", ""])
reach_ = st.builds(
    Reach,
    st.lists(nodes_, max_size=5).map(tuple),
    st.none() | st.lists(rules_, max_size=5).map(tuple),
    st.lists(
        st.sampled_from(["nvidia.com/gpu=GPU-cccc", "nvidia.com/gpu=all", "nvidia.com/gpu=9", "vendor.com/x=1"]),
        max_size=3,
    ).map(tuple),
    st.none() | st.lists(name_, max_size=3).map(",".join),
)
minors_ = st.frozensets(st.integers(0, 4), max_size=4)
grants_ = st.builds(Grants, minors_, minors_, minors_)


@given(reach_, grants_)
def test_a_finding_is_a_gpu_of_the_node_reached_and_granted_by_nobody(reach: Reach, grants: Grants) -> None:
    v = judge(reach, grants, GPUS)
    node_minors = {g.minor for g in GPUS}
    assert set(v.reached) <= node_minors
    for m in v.ungranted:
        assert m in v.reached and m not in grants.minors and v.reached[m]
    assert not (v.privileged and v.ungranted)
    assert set(v.ungranted) == (set() if v.privileged else set(v.reached) - grants.minors)


@given(reach_, grants_, grants_)
def test_more_grants_never_find_more(reach: Reach, a: Grants, b: Grants) -> None:
    both = Grants(a.scheduler | b.scheduler, a.plugin | b.plugin, a.claims | b.claims)
    assert set(judge(reach, both, GPUS).ungranted) <= set(judge(reach, a, GPUS).ungranted)
    every = Grants(scheduler=frozenset(g.minor for g in GPUS))
    assert judge(reach, every, GPUS).ungranted == ()


@given(reach_, grants_, st.text(max_size=12))
def test_paths_never_matter(reach: Reach, grants: Grants, path: str) -> None:
    renamed = replace(reach, nodes=tuple(replace(n, path=path) for n in reach.nodes))
    assert judge(renamed, grants, GPUS).ungranted == judge(reach, grants, GPUS).ungranted
    assert set(judge(renamed, grants, GPUS).reached) == set(judge(reach, grants, GPUS).reached)


@given(reach_, grants_)
def test_privilege_only_takes_findings_away(reach: Reach, grants: Grants) -> None:
    privileged = replace(reach, rules=(*(reach.rules or ()), DeviceRule(True, "a")))
    v = judge(privileged, grants, GPUS)
    assert v.privileged and v.ungranted == ()


@given(reach_, grants_)
def test_a_node_with_no_gpu_list_reaches_nothing(reach: Reach, grants: Grants) -> None:
    v = judge(reach, grants, ())
    assert v.reached == {} and v.ungranted == ()
