"""GPUs held by allocated ResourceClaims: slices and claims as the API server serves them (NVIDIA's,
HAMi's and the standard attribute names), pool generations, admin access, and an index kept
incrementally that always equals one computed from scratch."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from crihook.scheduler.claims import (
    ClaimAsk,
    ClaimIndex,
    DeviceIds,
    claim_ask,
    claim_devices,
    claim_key,
    claim_refs,
    device_ids,
    dra_request,
    held_on,
    normal_bus,
    parse_slice,
)
from crihook.scheduler.devices import Gpu
from crihook.scheduler.request import PodRequest

NVIDIA = "gpu.nvidia.com"
HAMI = "hami-core-gpu.project-hami.io"


def gpus(node: str, n: int) -> tuple[Gpu, ...]:
    return tuple(Gpu(minor=i, uuid=f"GPU-{node}-{i}", bus=f"0000:{0x10 + i:02x}:00.0") for i in range(n))


def s(value: str) -> dict[str, str]:
    return {"string": value}


def rslice(
    node: str,
    driver: str,
    devices: dict[str, dict[str, Any]],
    pool: str = "",
    generation: int = 1,
    beta: bool = False,
) -> dict[str, Any]:
    devs = [
        {"name": name, "basic": {"attributes": attrs}} if beta else {"name": name, "attributes": attrs}
        for name, attrs in devices.items()
    ]
    spec: dict[str, Any] = {"driver": driver, "pool": {"name": pool or node, "generation": generation}}
    if node:
        spec["nodeName"] = node
    spec["devices"] = devs
    return {"metadata": {"name": f"{node}-{driver}-{generation}"}, "spec": spec}


def claim(uid: str, *results: tuple[str, str, str], admin: bool = False) -> dict[str, Any]:
    res = [
        {"request": "gpu", "driver": d, "pool": p, "device": n} | ({"adminAccess": True} if admin else {})
        for d, p, n in results
    ]
    return {
        "metadata": {"uid": uid, "namespace": "ns", "name": uid},
        "status": {"allocation": {"devices": {"results": res}}},
    }


def test_normal_bus_spellings() -> None:
    assert normal_bus("00000000:1B:00.0") == "0000:1b:00.0"
    assert normal_bus("0000:1b:00.0") == "0000:1b:00.0"
    assert normal_bus("0001:AF:1f.7") == "0001:af:1f.7"
    for bad in ("", "1b:00.0", "0000:1b:00", "0000:1b:00.8", "gpu-0", "0000:1b:00.0x"):
        assert normal_bus(bad) == ""


def test_device_ids_from_each_driver() -> None:
    nvidia = {"uuid": s("GPU-AbC"), "pcieBusID": s("00000000:3B:00.0"), "index": {"int": 0}}
    assert device_ids("n", NVIDIA, {"name": "gpu-0", "attributes": nvidia}) == DeviceIds(
        "n", ("gpu-abc",), "0000:3b:00.0"
    )
    qualified = {f"{NVIDIA}/uuid": s("GPU-1"), "resource.kubernetes.io/pciBusID": s("0000:3c:00.0")}
    assert device_ids("n", NVIDIA, {"attributes": qualified}) == DeviceIds("n", ("gpu-1",), "0000:3c:00.0")
    mig = {"uuid": s("MIG-7"), "parentUUID": s("GPU-9")}
    assert device_ids("n", HAMI, {"basic": {"attributes": mig}}) == DeviceIds("n", ("mig-7", "gpu-9"))
    # another driver's domain is another attribute; a non-string value is no id
    assert device_ids("n", HAMI, {"attributes": {f"{NVIDIA}/uuid": s("GPU-1"), "uuid": {"int": 3}}}) == DeviceIds("n")
    assert device_ids("n", HAMI, {"attributes": {"pcieBusID": s("not a bus")}}) == DeviceIds("n")
    assert device_ids("n", HAMI, {"name": "x"}) == DeviceIds("n")


def test_parse_slice_rejects_what_nothing_can_name() -> None:
    assert parse_slice({}) is None
    assert parse_slice({"spec": {"driver": NVIDIA}}) is None
    assert parse_slice({"spec": {"pool": {"name": "p"}}}) is None
    assert parse_slice({"spec": {"driver": NVIDIA, "pool": {"generation": 1}}}) is None
    got = parse_slice(rslice("n", NVIDIA, {"gpu-0": {"uuid": s("GPU-x")}}, generation=4))
    assert got is not None and (got.driver, got.pool, got.generation) == (NVIDIA, "n", 4)
    assert got.devices == {"gpu-0": DeviceIds("n", ("gpu-x",))}
    odd = parse_slice({"spec": {"driver": NVIDIA, "pool": {"name": "p", "generation": True}, "devices": [{}, 3]}})
    assert odd is not None and odd.generation == 0 and odd.devices == {}


def test_claim_devices_allocated_results_only() -> None:
    assert claim_devices({}) == ()
    assert claim_devices({"status": {}}) == ()
    assert claim_devices({"status": {"allocation": {"devices": {"results": "x"}}}}) == ()
    assert claim_devices(claim("u", (NVIDIA, "n", "gpu-0"), (HAMI, "n", "gpu-1"))) == (
        (NVIDIA, "n", "gpu-0"),
        (HAMI, "n", "gpu-1"),
    )
    assert claim_devices(claim("u", (NVIDIA, "n", "gpu-0"), admin=True)) == ()
    assert claim_devices(claim("u", (NVIDIA, "", "gpu-0"))) == ()
    assert claim_key(claim("u1")) == "u1"
    assert claim_key({"metadata": {"namespace": "a", "name": "b"}}) == "a/b"


def test_nvidia_claim_held_by_uuid_hami_by_bus_id() -> None:
    idx = ClaimIndex()
    assert idx.set_gpus("a", gpus("a", 4)) == set()
    idx.set_gpus("b", gpus("b", 4))
    assert idx.set_slice("s1", rslice("a", NVIDIA, {"gpu-2": {"uuid": s("GPU-a-2")}})) == set()
    assert idx.set_slice("s2", rslice("b", HAMI, {"gpu-1": {"pcieBusID": s("00000000:11:00.0")}})) == set()
    assert idx.set_claim("c1", claim("c1", (NVIDIA, "a", "gpu-2"))) == {"a"}
    assert idx.held("a") == {2}
    assert idx.set_claim("c2", claim("c2", (HAMI, "b", "gpu-1"))) == {"b"}
    assert idx.held("b") == {1}
    # two claims share a GPU (consumable capacity): held until both are gone
    assert idx.set_claim("c3", claim("c3", (HAMI, "b", "gpu-1"))) == set()
    assert idx.holders("b", 1) == ["c2", "c3"]
    assert idx.remove_claim("c2") == set()
    assert idx.remove_claim("c3") == {"b"}
    assert idx.held("b") == frozenset()
    # deallocated (status.allocation gone) frees the GPU
    assert idx.set_claim("c1", {"metadata": {"uid": "c1"}, "status": {}}) == {"a"}
    assert idx.held("a") == frozenset()


def test_bus_id_only_on_the_slices_node_uuid_anywhere() -> None:
    idx = ClaimIndex()
    idx.set_gpus("a", gpus("a", 2))
    idx.set_gpus("b", gpus("b", 2))
    # a slice of no node (network-attached pool) names GPUs by UUID only
    idx.set_slice(
        "s", rslice("", NVIDIA, {"x": {"pcieBusID": s("0000:10:00.0")}, "y": {"uuid": s("GPU-b-1")}}, pool="p")
    )
    idx.set_claim("c", claim("c", (NVIDIA, "p", "x"), (NVIDIA, "p", "y")))
    assert (idx.held("a"), idx.held("b")) == (frozenset(), {1})


def test_claims_before_slices_and_devices_are_placed_when_they_come() -> None:
    idx = ClaimIndex()
    assert idx.set_claim("c", claim("c", (NVIDIA, "a", "gpu-0"))) == set()
    assert idx.set_slice("s", rslice("a", NVIDIA, {"gpu-0": {"uuid": s("GPU-a-0")}})) == set()
    assert idx.set_gpus("a", gpus("a", 1)) == {"a"}
    assert idx.held("a") == {0}
    assert idx.set_gpus("a", gpus("a", 1)) == set()  # unchanged Device
    assert idx.remove_slice("s") == {"a"}
    assert idx.remove_slice("s") == set()
    idx.set_slice("s", rslice("a", NVIDIA, {"gpu-0": {"uuid": s("GPU-a-0")}}))
    assert idx.remove_node("a") == {"a"} and idx.remove_node("a") == set()


def test_claim_refs_every_way_a_pod_names_a_claim() -> None:
    pod = {
        "metadata": {"namespace": "team"},
        "spec": {
            "resourceClaims": [
                {"name": "a", "resourceClaimName": "shared"},
                {"name": "b", "resourceClaimTemplateName": "tpl"},
                "junk",
            ]
        },
        "status": {
            "resourceClaimStatuses": [{"name": "b", "resourceClaimName": "p-b-x7"}, {"name": "c"}],
            "extendedResourceClaimStatus": {"resourceClaimName": "p-extended-resources-q2", "requestMappings": []},
        },
    }
    assert claim_refs(pod) == [("team", "p-b-x7"), ("team", "p-extended-resources-q2"), ("team", "shared")]
    assert claim_refs({"metadata": {"namespace": "team"}, "spec": {"containers": []}}) == []
    assert claim_refs({"spec": "junk", "status": None}) == []


def asking(*requests: dict[str, Any]) -> dict[str, Any]:
    return {"spec": {"devices": {"requests": list(requests)}}}


def test_claim_ask_reads_the_gpus_of_gpu_classes_only() -> None:
    whole = {"name": "a", "exactly": {"deviceClassName": "gpu.crihook.io", "count": 2}}
    assert claim_ask(asking(whole)) == ClaimAsk(2)
    share = {
        "name": "b",
        "exactly": {"deviceClassName": NVIDIA, "capacity": {"requests": {"cores": "50", "memory": "8Gi"}}},
    }
    assert claim_ask(asking(share)) == ClaimAsk(1, 50, 8 << 30)
    assert claim_ask(asking(whole, share)) == ClaimAsk(3)  # taken as whole GPUs: the largest ask, for every GPU
    assert claim_ask(asking(share, share)) == ClaimAsk(2, 50, 8 << 30)
    first = {"name": "c", "firstAvailable": [{"name": "x", "deviceClassName": "gpu.crihook.io", "count": 4}, {}]}
    assert claim_ask(asking(first)) == ClaimAsk(4)
    for other in (
        {"name": "d", "exactly": {"deviceClassName": "nic.example.com"}},
        {"name": "e", "exactly": {"deviceClassName": "gpu.crihook.io", "allocationMode": "All"}},
        {"name": "f", "exactly": {"deviceClassName": "gpu.crihook.io", "count": 0}},
        {"name": "g", "exactly": {"deviceClassName": "gpu.crihook.io", "capacity": {"requests": {"cores": "x"}}}},
        {"name": "h", "firstAvailable": []},
    ):
        assert claim_ask(asking(other)) is None, other
    assert claim_ask({}) is None and claim_ask({"spec": {"devices": {"requests": "junk"}}}) is None


def test_dra_request_is_the_annotation_paths_request_for_the_same_gpus() -> None:
    pod = PodRequest("u", "ns/p", cpu_milli=500)
    assert dra_request(pod, []) is pod
    whole = dra_request(pod, [ClaimAsk(2), ClaimAsk(1)])
    assert (whole.count, whole.core, whole.ratio, whole.memory, whole.shared) == (3, 100, 100, 0, False)
    assert whole.cpu_milli == 500 and whole.wants_devices
    share = dra_request(pod, [ClaimAsk(1, 50, 8 << 30)])
    assert (share.count, share.core, share.ratio, share.memory, share.shared) == (1, 50, 0, 8 << 30, True)
    cores_only = dra_request(pod, [ClaimAsk(1, 30)])
    assert (cores_only.core, cores_only.ratio, cores_only.memory, cores_only.shared) == (30, 100, 0, True)


def test_held_on_one_node_from_objects_read_now() -> None:
    sl = [
        rslice("a", NVIDIA, {"gpu-2": {"uuid": s("GPU-a-2")}, "gpu-3": {"pcieBusID": s("0000:13:00.0")}}),
        rslice("b", NVIDIA, {"gpu-0": {"uuid": s("GPU-b-0")}}),
    ]
    cl = [
        claim("x", (NVIDIA, "a", "gpu-2")),
        claim("y", (NVIDIA, "a", "gpu-2"), (NVIDIA, "a", "gpu-3")),
        claim("z", (NVIDIA, "b", "gpu-0")),  # another node's GPU
        claim("w", (NVIDIA, "a", "gpu-9")),  # a device no slice publishes
    ]
    assert held_on("a", gpus("a", 4), sl, cl) == {2: ["ns/x", "ns/y"], 3: ["ns/y"]}
    assert held_on("a", gpus("a", 4), [], cl) == {}
    assert held_on("a", (), sl, cl) == {}


def test_only_the_newest_pool_generation_counts() -> None:
    idx = ClaimIndex()
    idx.set_gpus("a", gpus("a", 2))
    idx.set_slice("old", rslice("a", NVIDIA, {"gpu-0": {"uuid": s("GPU-a-0")}}, generation=1))
    idx.set_claim("c", claim("c", (NVIDIA, "a", "gpu-0")))
    assert idx.held("a") == {0}
    # the driver republished: gpu-0 is now the other GPU; the old slice no longer counts
    assert idx.set_slice("new", rslice("a", NVIDIA, {"gpu-0": {"uuid": s("GPU-a-1")}}, generation=2)) == {"a"}
    assert idx.held("a") == {1}
    assert idx.replace_slices([("old", rslice("a", NVIDIA, {"gpu-0": {"uuid": s("GPU-a-0")}}))]) == {"a"}
    assert idx.held("a") == {0}


def test_admin_access_holds_nothing_and_replace_claims_drops_the_gone() -> None:
    idx = ClaimIndex()
    idx.set_gpus("a", gpus("a", 3))
    idx.set_slice("s", rslice("a", NVIDIA, {f"gpu-{i}": {"uuid": s(f"GPU-a-{i}")} for i in range(3)}, beta=True))
    idx.set_claim("admin", claim("admin", (NVIDIA, "a", "gpu-0"), admin=True))
    assert idx.held("a") == frozenset()
    idx.set_claim("c0", claim("c0", (NVIDIA, "a", "gpu-0")))
    assert idx.replace_claims([("c1", claim("c1", (NVIDIA, "a", "gpu-1"))), ("c2", claim("c2"))]) == {"a"}
    assert idx.held("a") == {1} and set(idx.claims) == {"c1"}


NODES = ("a", "b")
KEYS = [(NVIDIA, n, f"gpu-{i}") for n in NODES for i in range(3)] + [
    (HAMI, n, f"h{i}") for n in NODES for i in range(2)
]


def slices_strategy() -> Any:
    def one(node: str, gen: int, uuid_of: list[int], bus_of: list[int]) -> dict[str, Any]:
        devs = {f"gpu-{i}": {"uuid": s(f"GPU-{node}-{u}")} for i, u in enumerate(uuid_of)}
        devs |= {f"h{i}": {"pcieBusID": s(f"00000000:{0x10 + b:02X}:00.0")} for i, b in enumerate(bus_of)}
        return rslice(node, NVIDIA if gen % 2 else HAMI, devs, generation=gen)

    return st.builds(
        one,
        st.sampled_from(NODES),
        st.integers(1, 3),
        st.lists(st.integers(0, 3), max_size=3),
        st.lists(st.integers(0, 3), max_size=2),
    )


OPS = st.one_of(
    st.tuples(st.just("gpus"), st.sampled_from(NODES), st.integers(0, 4)),
    st.tuples(st.just("rmnode"), st.sampled_from(NODES)),
    st.tuples(st.just("slice"), st.sampled_from(["s1", "s2", "s3"]), slices_strategy()),
    st.tuples(st.just("rmslice"), st.sampled_from(["s1", "s2", "s3"])),
    st.tuples(
        st.just("claim"),
        st.sampled_from(["c1", "c2", "c3"]),
        st.lists(st.sampled_from(KEYS), max_size=3),
        st.booleans(),
    ),
    st.tuples(st.just("rmclaim"), st.sampled_from(["c1", "c2", "c3"])),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(OPS, max_size=25))
def test_incremental_index_equals_one_built_from_scratch(ops: list[tuple[Any, ...]]) -> None:
    idx = ClaimIndex()
    nodes: dict[str, int] = {}
    slices: dict[str, dict[str, Any]] = {}
    claims: dict[str, dict[str, Any]] = {}
    for op in ops:
        before = {n: idx.held(n) for n in NODES}
        if op[0] == "gpus":
            nodes[op[1]] = op[2]
            changed = idx.set_gpus(op[1], gpus(op[1], op[2]))
        elif op[0] == "rmnode":
            nodes.pop(op[1], None)
            changed = idx.remove_node(op[1])
        elif op[0] == "slice":
            slices[op[1]] = op[2]
            changed = idx.set_slice(op[1], op[2])
        elif op[0] == "rmslice":
            slices.pop(op[1], None)
            changed = idx.remove_slice(op[1])
        elif op[0] == "claim":
            claims[op[1]] = claim(op[1], *op[2], admin=op[3])
            changed = idx.set_claim(op[1], claims[op[1]])
        else:
            claims.pop(op[1], None)
            changed = idx.remove_claim(op[1])
        assert changed == {n for n in NODES if idx.held(n) != before[n]}
    fresh = ClaimIndex()
    for n, k in nodes.items():
        fresh.set_gpus(n, gpus(n, k))
    fresh.replace_slices(slices.items())
    fresh.replace_claims(claims.items())
    for n in NODES:
        assert idx.held(n) == fresh.held(n)
        assert idx.held(n) <= set(range(nodes.get(n, 0)))
