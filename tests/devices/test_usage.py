"""Attribution of GPU processes to containers: cgroup parsing for every runtime layout, grants from
the allocation annotation, and the attribution's invariants (nothing dropped, nothing counted twice).

The cgroup paths are those containerd's CRI plugin gives runc (pkg/cri/.../container_create_linux.go:
`<cgroup parent>:cri-containerd:<id>` with the systemd driver, `<cgroup parent>/<id>` with cgroupfs),
as the kernel shows them in /proc/<pid>/cgroup (cgroup v1: `<n>:<controllers>:<path>` per hierarchy,
v2: `0::<path>`) and as systemd lays slices out (`a-b.slice` under `a.slice`)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crihook.base.allocation import CONTAINER_DEVICES, DEVICE_ALLOCATED, AnnotationError
from crihook.devices import usage
from crihook.devices.usage import (
    CONTAINER,
    EXITED,
    HOST,
    UNKNOWN,
    GpuProcess,
    GpuState,
    Grant,
    KnownContainer,
    Owner,
    Usage,
)

CID = "a" * 64
CID2 = "b" * 64
SANDBOX = "c" * 64
UID = "0f1e2d3c_4b5a_6978_8796_a5b4c3d2e1f0"  # kubelet's systemd spelling of the pod uid
GPU0, GPU1 = "GPU-00000000-0000-0000-0000-000000000000", "GPU-11111111-1111-1111-1111-111111111111"
MIG = "MIG-22222222-2222-2222-2222-222222222222"
GiB = 1 << 30

SYSTEMD_V2 = (
    f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID}.slice/cri-containerd-{CID}.scope\n"
)
CGROUPFS_V2 = f"0::/kubepods/burstable/pod{UID}/{CID}\n"
SYSTEMD_V1 = "".join(
    f"{n}:{c}:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID}.slice/cri-containerd-{CID}.scope\n"
    for n, c in ((12, "memory"), (11, "cpu,cpuacct"), (10, "devices"), (1, "name=systemd"))
)
CGROUPFS_V1 = "".join(
    f"{n}:{c}:/kubepods/pod{UID}/{CID}\n" for n, c in ((9, "memory"), (4, "pids"), (1, "name=systemd"))
)
# hybrid: v1 controllers and the unified hierarchy side by side
HYBRID = CGROUPFS_V1 + f"0::/kubepods/pod{UID}/{CID}\n"
NESTED = f"0::/kubepods.slice/kubepods-pod{UID}.slice/cri-containerd-{CID}.scope/init\n"
# crihook in a cgroup namespace of its own sees the others relative to its own cgroup
NAMESPACED = f"0::/../../kubepods.slice/kubepods-pod{UID}.slice/cri-containerd-{CID}.scope\n"
HOST_V2 = "0::/system.slice/cuda-daemon.service\n"
HOST_V1 = "12:memory:/user.slice\n1:name=systemd:/user.slice/user-0.slice/session-1.scope\n"
ROOT = "0::/\n"
CONMON = f"0::/kubepods.slice/kubepods-pod{UID}.slice/crio-conmon-{CID}.scope\n"
CRIO = f"0::/kubepods.slice/kubepods-pod{UID}.slice/crio-{CID}.scope\n"
DOCKER = f"0::/system.slice/docker-{CID}.scope\n"


@pytest.mark.parametrize(
    "text",
    [SYSTEMD_V2, CGROUPFS_V2, SYSTEMD_V1, CGROUPFS_V1, HYBRID, NESTED, NAMESPACED, CRIO, DOCKER],
    ids=["systemd-v2", "cgroupfs-v2", "systemd-v1", "cgroupfs-v1", "hybrid", "nested", "namespaced", "crio", "docker"],
)
def test_every_layout_names_the_container(text: str) -> None:
    assert usage.container_in(usage.cgroup_paths(text), {CID}) == (CID, True)
    assert usage.container_in(usage.cgroup_paths(text), set()) == (CID, False)


@pytest.mark.parametrize("text", [HOST_V2, HOST_V1, ROOT, CONMON, "", "garbage\n", "1:cpu\n"])
def test_processes_outside_containers_are_the_hosts(text: str) -> None:
    assert usage.container_in(usage.cgroup_paths(text), {CID}) is None


def test_the_unified_path_is_read_first_then_memory() -> None:
    text = "4:pids:/p\n9:memory:/m\n0::/u\n"
    assert usage.cgroup_paths(text) == ("/u", "/m", "/p")


def test_a_known_id_anywhere_beats_an_unknown_deeper_one() -> None:
    # the sandbox's id in the path of a pod-level cgroup, the container's known id above it
    text = f"0::/kubepods/pod{UID}/{CID}/{SANDBOX}\n"
    assert usage.container_in(usage.cgroup_paths(text), {CID}) == (CID, True)
    assert usage.container_in(usage.cgroup_paths(text), set()) == (SANDBOX, False)


def test_ids_of_other_runtimes_are_looked_up_as_the_store_has_them() -> None:
    # a runtime whose ids are not 64 hex digits: found when the store knows the id
    assert usage.container_in(["/kubepods/podx/ctr-1"], {"ctr-1"}) == ("ctr-1", True)
    assert usage.container_in(["/kubepods/podx/ctr-1"], set()) is None


@pytest.mark.parametrize(
    ("cgroups_path", "directory"),
    [
        (
            f"kubepods-burstable-pod{UID}.slice:cri-containerd:{CID}",
            f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID}.slice/cri-containerd-{CID}.scope",
        ),
        (
            f"kubepods-pod{UID}.slice:cri-containerd:{CID}",
            f"/kubepods.slice/kubepods-pod{UID}.slice/cri-containerd-{CID}.scope",
        ),
        (f"-.slice:cri-containerd:{CID}", f"/cri-containerd-{CID}.scope"),
        (f"/kubepods/burstable/pod{UID}/{CID}", f"/kubepods/burstable/pod{UID}/{CID}"),
    ],
)
def test_cgroup_dir_from_the_cgroups_path(cgroups_path: str, directory: str) -> None:
    assert usage.cgroup_dir(cgroups_path) == directory
    assert usage.container_in([usage.cgroup_dir(cgroups_path)], {CID}) == (CID, True)


_hex64 = st.text(alphabet="0123456789abcdef", min_size=64, max_size=64)
_word = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_", min_size=1, max_size=12)


@given(
    cid=_hex64,
    slices=st.lists(_word, min_size=1, max_size=4),
    systemd=st.booleans(),
    v1=st.booleans(),
    tail=st.lists(_word, max_size=2),
)
def test_any_cgroups_path_containerd_makes_leads_back_to_its_container(
    cid: str, slices: list[str], systemd: bool, v1: bool, tail: list[str]
) -> None:
    if systemd:
        parent = "-".join(["kubepods", *slices]) + ".slice"
        path = usage.cgroup_dir(f"{parent}:cri-containerd:{cid}")
    else:
        path = "/" + "/".join(["kubepods", *slices, cid])
    path = "/".join([path, *tail])  # a sub-cgroup the container made
    text = f"7:memory:{path}\n1:name=systemd:{path}\n" if v1 else f"0::{path}\n"
    assert usage.container_in(usage.cgroup_paths(text), {cid}) == (cid, True)


# -- grants ---------------------------------------------------------------------------------------

GPUS = {0: (GPU0, 80 * GiB), 1: (GPU1, 80 * GiB)}


def _annotations(allocs: list[dict[str, object]], per_container: dict[str, list[int]] | None = None) -> dict[str, str]:
    ann = {DEVICE_ALLOCATED: json.dumps({"gpu": allocs})}
    if per_container is not None:
        ann[CONTAINER_DEVICES] = json.dumps({c: {"gpu": m} for c, m in per_container.items()})
    return ann


def test_grants_whole_shared_and_ratio() -> None:
    whole = _annotations(
        [{"minor": 0, "resources": {"koordinator.sh/gpu-core": 100, "koordinator.sh/gpu-memory-ratio": 100}}]
    )
    assert usage.grants_of(whole, "main", GPUS) == (Grant(GPU0, 100, 80 * GiB),)
    shared = _annotations(
        [{"minor": 1, "id": GPU1, "resources": {"koordinator.sh/gpu-core": "25", "koordinator.sh/gpu-memory": "4Gi"}}]
    )
    assert usage.grants_of(shared, "main", GPUS) == (Grant(GPU1, 25, 4 * GiB),)
    ratio = _annotations(
        [{"minor": 0, "resources": {"koordinator.sh/gpu-core": 50, "koordinator.sh/gpu-memory-ratio": 50}}]
    )
    assert usage.grants_of(ratio, "main", GPUS) == (Grant(GPU0, 50, 40 * GiB),)
    bare = _annotations([{"minor": 1}])  # no figures: a whole GPU
    assert usage.grants_of(bare, "main", GPUS) == (Grant(GPU1, 100, 80 * GiB),)


def test_grants_split_by_container_and_none_without_annotation() -> None:
    ann = _annotations([{"minor": 0}, {"minor": 1}], {"a": [0], "b": [1]})
    assert [g.gpu for g in usage.grants_of(ann, "a", GPUS)] == [GPU0]
    assert [g.gpu for g in usage.grants_of(ann, "b", GPUS)] == [GPU1]
    assert usage.grants_of(ann, "sidecar", GPUS) == ()
    assert usage.grants_of({}, "main", GPUS) == ()
    # a minor this node lacks names no GPU: no grant (the gpu hook refused that container)
    assert usage.grants_of(_annotations([{"minor": 7}]), "main", GPUS) == ()


def test_a_bad_annotation_raises_naming_it() -> None:
    with pytest.raises(AnnotationError, match=DEVICE_ALLOCATED):
        usage.grants_of({DEVICE_ALLOCATED: "{"}, "main", GPUS)


# -- attribution ----------------------------------------------------------------------------------

KNOWN = {
    CID: KnownContainer(CID, "ns", "train", "main", (Grant(GPU0, 50, 10 * GiB),)),
    CID2: KnownContainer(CID2, "ns", "idle", "main", (Grant(GPU1, 100, 80 * GiB),)),
}


def test_attribution_of_each_kind_of_owner() -> None:
    procs = [
        GpuProcess(10, GPU0, GPU0, 6 * GiB, 30.0),
        GpuProcess(11, GPU0, GPU0, 6 * GiB, 20.0),  # same container: adds up
        GpuProcess(20, GPU0, GPU0, 1 * GiB),  # the host
        GpuProcess(30, GPU1, GPU1, 2 * GiB),  # a container the store does not hold
        GpuProcess(40, GPU1, GPU1, 3 * GiB),  # exited before its cgroup was read
    ]
    cgroups = {10: SYSTEMD_V2, 11: NESTED, 20: HOST_V2, 30: f"0::/kubepods/pod{UID}/{'d' * 64}\n", 40: None}
    rows = usage.attribute(procs, cgroups, KNOWN)
    by = {(u.owner.kind, u.owner.pod, u.device): u for u in rows}
    train = by[(CONTAINER, "train", GPU0)]
    assert (train.used_memory, train.sm_util, train.pids) == (12 * GiB, 50.0, (10, 11))
    assert (train.granted_core, train.granted_memory, train.over_grant) == (50, 10 * GiB, True)
    assert by[(HOST, "", GPU0)].used_memory == GiB
    assert by[(UNKNOWN, "", GPU1)].owner.container_id == "d" * 64
    assert by[(EXITED, "", GPU1)].pids == (40,)
    idle = by[(CONTAINER, "idle", GPU1)]  # granted, running nothing: shown with nothing used
    assert (idle.used_memory, idle.sm_util, idle.pids, idle.granted_memory, idle.over_grant) == (
        0,
        None,
        (),
        80 * GiB,
        False,
    )


def test_compute_and_graphics_listings_of_one_process_count_once() -> None:
    procs = [GpuProcess(10, GPU0, GPU0, 4 * GiB), GpuProcess(10, GPU0, GPU0, 4 * GiB, 12.0)]
    (row,) = (u for u in usage.attribute(procs, {10: SYSTEMD_V2}, KNOWN) if u.pids)
    assert (row.used_memory, row.sm_util) == (4 * GiB, 12.0)


def test_mig_devices_are_rows_of_their_own_without_a_grant() -> None:
    procs = [GpuProcess(10, GPU0, MIG, 5 * GiB)]
    rows = usage.attribute(procs, {10: SYSTEMD_V2}, KNOWN)
    mig = next(u for u in rows if u.device == MIG)
    assert (mig.gpu, mig.used_memory, mig.granted_memory) == (GPU0, 5 * GiB, None)


def test_utilisation_is_capped_and_sampled_means() -> None:
    assert usage.sm_by_pid([(1, 10), (1, 30), (2, 5), (0, 99)]) == {1: 20.0, 2: 5.0}
    procs = [GpuProcess(10, GPU0, GPU0, 0, 80.0), GpuProcess(11, GPU0, GPU0, 0, 70.0)]
    (row,) = (u for u in usage.attribute(procs, {10: SYSTEMD_V2, 11: SYSTEMD_V2}, KNOWN) if u.pids)
    assert row.sm_util == 100.0


def test_over_grant_episodes_are_told_once() -> None:
    over = Usage(Owner(CONTAINER, "ns", "p", "c", CID), GPU0, GPU0, 11, None, (1,), 50, 10)
    within = Usage(Owner(CONTAINER, "ns", "p", "c", CID), GPU0, GPU0, 9, None, (1,), 50, 10)
    state, told = usage.newly_over(frozenset(), [over])
    assert told == [over]
    state, told = usage.newly_over(state, [over])
    assert told == []
    state, told = usage.newly_over(state, [within])
    assert state == frozenset() and told == []
    assert usage.newly_over(state, [over])[1] == [over]  # a new episode
    unknown_size = Usage(Owner(CONTAINER, "ns", "p", "c", CID), GPU0, GPU0, 11, None, (1,), 50, 0)
    assert not unknown_size.over_grant


_owners = st.sampled_from([SYSTEMD_V2, CGROUPFS_V1, HOST_V2, None, f"0::/kubepods/{'e' * 64}\n", f"0::/x/{CID2}\n"])


@given(
    st.lists(
        st.tuples(
            st.integers(1, 40),
            st.sampled_from([GPU0, GPU1]),
            st.booleans(),
            st.integers(0, 100 * GiB),
            st.none() | st.integers(0, 100),
        ),
        max_size=30,
    ),
    st.dictionaries(st.integers(1, 40), _owners),
)
def test_nothing_is_dropped_or_counted_twice(
    raw: list[tuple[int, str, bool, int, int | None]], cgroups: dict[int, str | None]
) -> None:
    procs = [
        GpuProcess(pid, gpu, MIG if mig and gpu == GPU0 else gpu, mem, None if sm is None else float(sm))
        for pid, gpu, mig, mem, sm in raw
    ]
    rows = usage.attribute(procs, cgroups, KNOWN)
    # every (pid, device) once, with the largest memory NVML listed it with
    want: dict[tuple[int, str], int] = {}
    for p in procs:
        want[(p.pid, p.device)] = max(want.get((p.pid, p.device), 0), p.used_memory)
    got = [(pid, u.device) for u in rows for pid in u.pids]
    assert sorted(got) == sorted(want)
    assert sum(u.used_memory for u in rows) == sum(want.values())
    # every grant shows, once, whatever runs
    granted = [(u.owner.container_id, u.gpu) for u in rows if u.granted_memory is not None]
    assert sorted(granted) == sorted((c.id, g.gpu) for c in KNOWN.values() for g in c.grants)
    for u in rows:
        assert u.sm_util is None or 0 <= u.sm_util <= 100
        assert u.owner.kind in usage.OWNER_KINDS
        # a process is its container's only when its cgroup names the container
        for pid in u.pids:
            if u.owner.kind == CONTAINER:
                assert u.owner.container_id in (cgroups.get(pid) or "")
            if cgroups.get(pid) is None:
                assert u.owner.kind == EXITED


# -- the state file -------------------------------------------------------------------------------


def test_state_round_trip_and_refusals() -> None:
    rows = usage.attribute([GpuProcess(10, GPU0, GPU0, GiB, 5.0)], {10: SYSTEMD_V2}, KNOWN)
    gpus = [GpuState(GPU0, 0, 80 * GiB, GiB), GpuState(GPU1, 1, 80 * GiB, 0)]
    doc = json.loads(json.dumps(usage.encode(gpus, rows, 1000.0, 10.0)))
    state = usage.decode(doc)
    assert (state.rows, state.gpus, state.taken_at, state.interval, state.reason) == (
        rows,
        tuple(gpus),
        1000.0,
        10.0,
        "",
    )
    for bad in (
        None,
        {},
        {**doc, "version": 2},
        {**doc, "rows": [{}]},
        {**doc, "gpus": [{"uuid": 1}]},
        {**doc, "rows": "x"},
    ):
        with pytest.raises(usage.StateError):
            usage.decode(bad)
    row = dict(doc["rows"][0])
    for key, value in (("kind", "alien"), ("pids", ["1"]), ("used_memory", True), ("sm_util", "5")):
        with pytest.raises(usage.StateError, match=key):
            usage.decode({**doc, "rows": [{**row, key: value}]})


def test_per_container_totals() -> None:
    known = {CID: KnownContainer(CID, "ns", "train", "main", (Grant(GPU0, 100, 80 * GiB), Grant(GPU1, 100, 80 * GiB)))}
    procs = [
        GpuProcess(10, GPU0, GPU0, 90 * GiB, 40.0),
        GpuProcess(10, GPU1, GPU1, GiB, 20.0),
        GpuProcess(9, GPU1, GPU1, GiB),
    ]
    rows = usage.attribute(procs, {10: SYSTEMD_V2, 9: HOST_V2}, known)
    state = usage.State(0.0, 10.0, "", (GpuState(GPU0, 0, 80 * GiB, 0), GpuState(GPU1, 1, 80 * GiB, 0)), rows)
    train, host = usage.per_container(state)
    assert train.owner.pod == "train" and host.owner.kind == HOST
    assert [u.gpu for u in train.devices] == [GPU0, GPU1]
    assert (train.used_memory, train.granted_core, train.granted_memory, train.sm_util, train.over_grant) == (
        91 * GiB,
        200,
        160 * GiB,
        30.0,
        True,
    )
    assert (host.granted_core, host.sm_util) == (None, None)


def test_the_gpus_a_pods_dra_claims_brought_are_named_after_the_claim() -> None:
    from crihook.devices.draclaims import Claim

    gpus = {0: (GPU0, 80 * GiB), 1: (GPU1, 80 * GiB)}
    ours = Claim("c-1", "train-gpus", "ml", frozenset({"p"}), ("gpu.crihook.io/claim=c-1-gpu-1",))
    nvidia = Claim("c-2", "other", "ml", frozenset({"p"}), ("k8s.gpu.nvidia.com/claim=c-2-gpu-0", "x.io/y=z"))
    assert usage.claim_minor("c-1", "gpu.crihook.io/claim=c-1-gpu-1") == 1
    for uid, dev in [
        ("c-1", "gpu.crihook.io/claim=c-2-gpu-1"),
        ("", "a/b=-gpu-1"),
        ("c-1", "a/b=c-1-mig-1"),
        ("c-1", "c-1-gpu-1"),
    ]:
        assert usage.claim_minor(uid, dev) is None
    assert usage.claim_grants([ours, nvidia], gpus) == (
        Grant(GPU1, 0, 0, "ml/train-gpus"),
        Grant(GPU0, 0, 0, "ml/other"),
    )
    gone = Claim("c-3", "x", "ml", frozenset({"p"}), ("gpu.crihook.io/claim=c-3-gpu-7",))  # no such GPU here
    assert usage.claim_grants([gone], gpus) == ()
    # the use is shown against the claim; its share is the allocation's, not known here
    known = {CID: KnownContainer(CID, "ml", "train", "main", usage.claim_grants([ours], gpus))}
    procs = [usage.GpuProcess(10, GPU1, GPU1, 3 * GiB, 40.0)]
    (row,) = usage.attribute(procs, {10: SYSTEMD_V2}, known)
    assert (row.claim, row.granted_core, row.granted_memory, row.over_grant) == ("ml/train-gpus", None, None, False)
    doc = usage.encode([], [row], 0.0, 10.0)
    state = usage.decode(json.loads(json.dumps(doc)))
    assert state.rows == (row,)
    (totals,) = usage.per_container(state)
    assert totals.claims == ("ml/train-gpus",) and totals.granted_core is None
    del doc["rows"][0]["claim"]  # a file written before claims were shown
    assert usage.decode(doc).rows[0].claim == ""
    doc["rows"][0]["claim"] = 3
    with pytest.raises(usage.StateError):
        usage.decode(doc)


def test_a_claim_grant_names_the_request_its_device_serves() -> None:
    from crihook.devices.draclaims import Claim

    dev = "gpu.crihook.io/claim=c-1-gpu-0"
    c = Claim("c-1", "pair", "ml", frozenset({"p"}), (dev,), ((dev, ("main", "side")),))
    assert usage.claim_grants([c], {0: (GPU0, GiB)}) == (Grant(GPU0, 0, 0, "ml/pair/main,side"),)


def test_a_claims_share_recorded_by_crihooks_driver_is_its_grant() -> None:
    """The share crihook dra recorded is the claim's core and memory grant, over which the memory
    used counts as above the grant; a claim with no recorded share (another driver's) has none."""
    from crihook.devices.draclaims import Claim
    from crihook.devices.drashares import ClaimShare

    gpus = {0: (GPU0, 80 * GiB), 1: (GPU1, 80 * GiB)}
    half = Claim("c-1", "half", "ml", frozenset({"p"}), ("gpu.crihook.io/claim=c-1-gpu-1",))
    other = Claim("c-2", "other", "ml", frozenset({"p"}), ("k8s.gpu.nvidia.com/claim=c-2-gpu-0",))
    shares = {"c-1": {1: ClaimShare(50, 8 * GiB)}, "c-9": {0: ClaimShare(10, GiB)}}
    grants = usage.claim_grants([half, other], gpus, shares)
    assert grants == (Grant(GPU1, 50, 8 * GiB, "ml/half"), Grant(GPU0, 0, 0, "ml/other"))
    assert [g.sized for g in grants] == [True, False] and Grant(GPU0, 0, 0).sized
    assert usage.claim_grants([half], gpus, {"c-1": {0: ClaimShare(50, GiB)}}) == (Grant(GPU1, 0, 0, "ml/half"),)
    known = {CID: KnownContainer(CID, "ml", "train", "main", grants)}
    procs = [usage.GpuProcess(10, GPU1, GPU1, 9 * GiB, 40.0), usage.GpuProcess(10, GPU0, GPU0, GiB, None)]
    rows = usage.attribute(procs, {10: SYSTEMD_V2}, known)
    got = {u.gpu: (u.claim, u.granted_core, u.granted_memory, u.over_grant) for u in rows}
    assert got == {GPU1: ("ml/half", 50, 8 * GiB, True), GPU0: ("ml/other", None, None, False)}
    state = usage.decode(json.loads(json.dumps(usage.encode([], rows, 0.0, 10.0))))
    (totals,) = usage.per_container(state)
    assert (totals.granted_core, totals.granted_memory, totals.over_grant) == (50, 8 * GiB, True)
    assert totals.claims == ("ml/half", "ml/other") or totals.claims == ("ml/other", "ml/half")
