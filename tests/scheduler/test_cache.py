"""The cache and the bind path through the real `kubernetes` client against the fake API server:
list+watch, resourceVersion conflicts, 404s, 410s, rollback on failure, restart, and many concurrent
binds to one node with zero double allocation."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from kubernetes import client

from crihook.base import metrics
from crihook.base.allocation import CONTAINER_DEVICES, DEVICE_ALLOCATED, GPU, GPU_CORE, parse_device_allocated
from crihook.scheduler.cache import ClusterCache, Reflector
from crihook.scheduler.extender import ApiFailure
from crihook.scheduler.plugin import DeviceShare
from tests.support.bindrun import Scheduler, start_scheduler
from tests.support.extender import FIXTURES
from tests.support.fakekube import FakeKube

NODE = "gpu-node-1"  # 8 GPUs


def fixture(name: str) -> Any:
    return json.loads((FIXTURES / name).read_text())


def eventually(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    with FakeKube() as k:
        for n in fixture("cluster_nodes.json")["items"]:
            k.create("nodes", n)
        for d in fixture("cluster_devices.json")["items"]:
            k.create("devices", d)
        yield k


@pytest.fixture
def sched(kube: FakeKube) -> Iterator[Scheduler]:
    s = start_scheduler(kube)
    yield s
    s.stop()


def make_pod(kube: FakeKube, name: str, resources: dict[str, str], ns: str = "team-a") -> dict[str, Any]:
    return kube.create(
        "pods",
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": ns},
            "spec": {
                "containers": [
                    {"name": "main", "image": "x", "resources": {"limits": resources, "requests": resources}}
                ]
            },
        },
    )


WHOLE = {"nvidia.com/gpu": "1"}
HALF = {"koordinator.sh/gpu-core": "50", "koordinator.sh/gpu-memory-ratio": "50", "koordinator.sh/gpu.shared": "1"}


def bind_args(pod: dict[str, Any], node: str = NODE) -> dict[str, str]:
    m = pod["metadata"]
    return {"PodName": m["name"], "PodNamespace": m["namespace"], "PodUID": m["uid"], "Node": node}


def filter_args(pod: dict[str, Any], nodes: list[str]) -> dict[str, Any]:
    return {"Pod": pod, "Nodes": None, "NodeNames": nodes}


def gpus_of(kube: FakeKube, ns: str, name: str) -> list[int]:
    anns = kube.get("pods", name, ns)["metadata"].get("annotations") or {}
    return [a.minor for a in parse_device_allocated(anns[DEVICE_ALLOCATED]).get(GPU, ())]


def test_cache_loads_nodes_devices_and_pods(sched: Scheduler) -> None:
    assert set(sched.plugin.st.rows) == {"gpu-node-1", "gpu-node-2"}
    assert len(sched.plugin.st.nodes[sched.plugin.st.rows[NODE]].gpus) == 8


def test_bind_writes_annotations_then_binding(kube: FakeKube, sched: Scheduler) -> None:
    pod = make_pod(kube, "p0", {"nvidia.com/gpu": "2"})
    assert sched.ext.filter(filter_args(pod, [NODE]))["NodeNames"] == [NODE]
    kube.requests.clear()
    assert sched.ext.bind(bind_args(pod)) == {"Error": ""}
    got = kube.get("pods", "p0", "team-a")
    assert got["spec"]["nodeName"] == NODE
    allocs = parse_device_allocated(got["metadata"]["annotations"][DEVICE_ALLOCATED])
    assert len(allocs[GPU]) == 2 and all(a.id.startswith("GPU-") and a.resources[GPU_CORE] == 100 for a in allocs[GPU])
    assert json.loads(got["metadata"]["annotations"][CONTAINER_DEVICES]) == {
        "main": {"gpu": [a.minor for a in allocs[GPU]]}
    }
    writes = [(r.method, r.path.rsplit("/", 1)[-1]) for r in kube.requests if r.method != "GET"]
    assert writes == [("PATCH", "p0"), ("POST", "binding")]
    # the watch brings the bound pod back: it stays charged exactly once
    eventually(lambda: sched.cache.pods.get(got["metadata"]["uid"]) == NODE)
    assert sched.plugin.held[got["metadata"]["uid"]].node == NODE


def test_bind_retry_is_idempotent(kube: FakeKube, sched: Scheduler) -> None:
    pod = make_pod(kube, "p0", WHOLE)
    assert sched.ext.bind(bind_args(pod)) == {"Error": ""}
    first = kube.get("pods", "p0", "team-a")["metadata"]["annotations"]
    kube.requests.clear()
    assert sched.ext.bind(bind_args(pod)) == {"Error": ""}
    assert [r.method for r in kube.requests] == ["GET"]  # nothing written twice
    assert kube.get("pods", "p0", "team-a")["metadata"]["annotations"] == first
    other = bind_args(pod, "gpu-node-2")
    assert "already bound to node gpu-node-1" in sched.ext.bind(other)["Error"]


def test_bind_of_a_missing_pod(sched: Scheduler) -> None:
    err = sched.ext.bind({"PodName": "gone", "PodNamespace": "team-a", "PodUID": "u", "Node": NODE})["Error"]
    assert "404" in err and "not found" in err
    assert sched.plugin.held == {}


def test_bind_of_a_recreated_pod(kube: FakeKube, sched: Scheduler) -> None:
    pod = make_pod(kube, "p0", WHOLE)
    args = bind_args(pod)
    kube.delete("pods", "p0", "team-a")
    make_pod(kube, "p0", WHOLE)
    assert "created again" in sched.ext.bind(args)["Error"]
    assert kube.get("pods", "p0", "team-a")["spec"].get("nodeName") is None


@pytest.mark.parametrize(("code", "path"), [(500, "/binding"), (409, "/binding"), (409, "/pods/p0"), (500, "/pods/p0")])
def test_failed_bind_rolls_back(kube: FakeKube, sched: Scheduler, code: int, path: str) -> None:
    pod = make_pod(kube, "p0", {"nvidia.com/gpu": "8"})
    kube.fail_next(1, code, method="POST" if path == "/binding" else "PATCH", path=path)
    err = sched.ext.bind(bind_args(pod))["Error"]
    assert str(code) in err and "injected fault" in err
    assert pod["metadata"]["uid"] not in sched.plugin.held
    # every GPU is free again: the same pod binds on the retry
    assert sched.ext.bind(bind_args(pod)) == {"Error": ""}
    assert sorted(gpus_of(kube, "team-a", "p0")) == list(range(8))


def test_unschedulable_bind_writes_nothing(kube: FakeKube, sched: Scheduler) -> None:
    big = make_pod(kube, "big", {"nvidia.com/gpu": "8"})
    assert sched.ext.bind(bind_args(big)) == {"Error": ""}
    pod = make_pod(kube, "p1", WHOLE)
    kube.requests.clear()
    err = sched.ext.bind(bind_args(pod))["Error"]
    assert "0 of 8 GPUs" in err
    assert [r.method for r in kube.requests] == ["GET"]


def test_pod_deletion_frees_devices(kube: FakeKube, sched: Scheduler) -> None:
    big = make_pod(kube, "big", {"nvidia.com/gpu": "8"})
    assert sched.ext.bind(bind_args(big)) == {"Error": ""}
    small = make_pod(kube, "small", WHOLE)
    assert sched.ext.filter(filter_args(small, [NODE]))["NodeNames"] == []
    kube.delete("pods", "big", "team-a")
    eventually(lambda: sched.ext.filter(filter_args(small, [NODE]))["NodeNames"] == [NODE])


def test_finished_pod_frees_devices(kube: FakeKube, sched: Scheduler) -> None:
    big = make_pod(kube, "big", {"nvidia.com/gpu": "8"})
    assert sched.ext.bind(bind_args(big)) == {"Error": ""}
    eventually(lambda: big["metadata"]["uid"] in sched.cache.pods)
    kube.patch("pods", "big", {"status": {"phase": "Succeeded"}}, "team-a", subresource="status")
    eventually(lambda: big["metadata"]["uid"] not in sched.plugin.held)


def test_device_changes_reach_the_allocator(kube: FakeKube, sched: Scheduler) -> None:
    dev = kube.get("devices", NODE)
    for d in dev["spec"]["devices"]:
        d["health"] = False
    kube.put("devices", dev)
    pod = make_pod(kube, "p0", WHOLE)
    eventually(lambda: sched.ext.filter(filter_args(pod, [NODE]))["NodeNames"] == [])
    assert "unhealthy" in sched.ext.filter(filter_args(pod, [NODE]))["FailedAndUnresolvableNodes"][NODE]
    kube.delete("devices", NODE)
    eventually(lambda: NODE not in sched.plugin.st.rows)
    kube.delete("devices", "gpu-node-2")
    kube.delete("nodes", "gpu-node-2")
    eventually(lambda: sched.plugin.st.rows == {})


def test_restart_loses_nothing(kube: FakeKube, sched: Scheduler) -> None:
    pods = [make_pod(kube, f"p{i}", HALF) for i in range(5)] + [make_pod(kube, "w", {"nvidia.com/gpu": "4"})]
    for p in pods:
        assert sched.ext.bind(bind_args(p)) == {"Error": ""}
    before = {uid: (h.node, sorted(h.gpus)) for uid, h in sched.plugin.held.items()}
    free_before = sched.plugin.st.core_free.copy()
    sched.stop()
    fresh = start_scheduler(kube)
    try:
        after = {uid: (h.node, sorted(h.gpus)) for uid, h in fresh.plugin.held.items()}
        assert after == before
        row_old, row_new = sched.plugin.st.rows[NODE], fresh.plugin.st.rows[NODE]
        assert (fresh.plugin.st.core_free[row_new][:8] == free_before[row_old][:8]).all()
    finally:
        fresh.stop()


def test_watch_expiry_relists(kube: FakeKube, sched: Scheduler) -> None:
    big = make_pod(kube, "big", {"nvidia.com/gpu": "8"})
    assert sched.ext.bind(bind_args(big)) == {"Error": ""}
    eventually(lambda: big["metadata"]["uid"] in sched.cache.pods)
    lists = sum(1 for r in kube.requests if r.method == "GET" and "watch=" not in r.query)
    # the deletion never reaches the open watches, and etcd compacts past it: each watch ends with
    # 410 Expired, and only a fresh list can tell the cache the pod is gone
    kube.pause_watches()
    kube.delete("pods", "big", "team-a")
    kube.compact()
    eventually(
        lambda: (
            sum(1 for r in kube.requests if r.method == "GET" and "watch=" not in r.query)
            == lists + len(sched.cache.reflectors)
        )
    )
    eventually(lambda: big["metadata"]["uid"] not in sched.plugin.held)
    kube.pause_watches(False)
    # and the cache goes on watching from the new lists
    kube.create("devices", {**kube.get("devices", NODE), "metadata": {"name": "gpu-node-3"}})
    kube.create("nodes", {"metadata": {"name": "gpu-node-3"}})
    eventually(lambda: "gpu-node-3" in sched.plugin.st.rows)


def test_not_ready_until_listed(kube: FakeKube) -> None:
    kube.fail_next(3, 500, method="GET", path="/devices")
    api_client = kube.api_client()
    plugin = DeviceShare()
    cache = ClusterCache(api_client, plugin, threading.Lock())
    cache.start()
    try:
        assert not cache.ready()
        assert cache.wait_ready(15)
        assert NODE in plugin.st.rows
    finally:
        cache.stop()


@pytest.mark.parametrize(("resources", "fits"), [(WHOLE, 8), (HALF, 16)])
def test_concurrent_binds_never_share_a_gpu(
    kube: FakeKube, sched: Scheduler, resources: dict[str, str], fits: int
) -> None:
    pods = [make_pod(kube, f"race-{i}", resources) for i in range(fits + 12)]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda p: sched.ext.bind(bind_args(p)), pods))
    ok = [p for p, r in zip(pods, results, strict=True) if not r["Error"]]
    assert len(ok) == fits
    core_on: dict[int, int] = {}
    for p in pods:
        got = kube.get("pods", p["metadata"]["name"], "team-a")
        anns = got["metadata"].get("annotations") or {}
        if p in ok:
            assert got["spec"]["nodeName"] == NODE
            for a in parse_device_allocated(anns[DEVICE_ALLOCATED])[GPU]:
                core_on[a.minor] = core_on.get(a.minor, 0) + a.resources[GPU_CORE]
        else:
            assert not got["spec"].get("nodeName")
    assert sorted(core_on) == list(range(8)) and all(v == 100 for v in core_on.values())
    # the failed binds left nothing reserved
    eventually(lambda: set(sched.plugin.held) == {p["metadata"]["uid"] for p in ok})


# --- the tentative hold from prioritize to bind -------------------------------------------------------

BOTH = ["gpu-node-1", "gpu-node-2"]


def test_prioritize_holds_the_top_node_until_the_bind(kube: FakeKube, sched: Scheduler) -> None:
    """kube-scheduler assumes a pod at Reserve, before its bind reaches us: the cycles in between
    must not be handed the GPUs prioritize ranked it first on."""
    big = make_pod(kube, "big", {"nvidia.com/gpu": "8"})  # fits gpu-node-1 only
    top = [p["Host"] for p in sched.ext.prioritize(filter_args(big, BOTH)) if p["Score"] == 10]
    assert top == [NODE] and sched.plugin.held[big["metadata"]["uid"]].node == NODE
    small = make_pod(kube, "small", WHOLE)
    assert sched.ext.filter(filter_args(small, [NODE]))["NodeNames"] == []
    assert sched.ext.bind(bind_args(big)) == {"Error": ""}
    assert sorted(gpus_of(kube, "team-a", "big")) == list(range(8))


def claims_pod(kube: FakeKube, name: str, request: dict[str, Any]) -> dict[str, Any]:
    """A claim of crihook's DeviceClass asking `request`, and a pod using it, in team-a."""
    exactly = {"deviceClassName": "gpu.crihook.io", **request}
    spec = {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}
    kube.create("resourceclaims", {"metadata": {"name": name, "namespace": "team-a"}, "spec": spec})
    container = {"name": "main", "image": "x", "resources": {"claims": [{"name": "gpu"}]}}
    pod_spec = {"resourceClaims": [{"name": "gpu", "resourceClaimName": name}], "containers": [container]}
    return kube.create("pods", {"metadata": {"name": name, "namespace": "team-a"}, "spec": pod_spec})


def test_a_pod_with_claims_is_scored_as_the_same_ask_by_annotation(kube: FakeKube, sched: Scheduler) -> None:
    """kube-scheduler asks prioritize about pods with claims too: the nodes are scored for the GPUs
    the claims ask, as for a pod asking them by annotation. Nothing is held: the DRA allocator picks
    the GPUs."""

    def scores(pod: dict[str, Any]) -> list[tuple[str, int]]:
        out = [(h["Host"], h["Score"]) for h in sched.ext.prioritize(filter_args(pod, BOTH))]
        sched.ext.filter(filter_args(pod, BOTH))  # a new cycle: an annotation pod's hold is let go
        return out

    eight = claims_pod(kube, "eight", {"count": 8})
    half = claims_pod(kube, "half", {"capacity": {"requests": {"cores": "50", "memory": "8Gi"}}})
    eventually(lambda: {"team-a/eight", "team-a/half"} <= set(sched.cache.claim_asks))
    got = scores(eight), scores(half)
    assert got[0] == [(NODE, 10), ("gpu-node-2", 0)]  # only gpu-node-1 has 8 GPUs
    assert not sched.plugin.held
    share = {"koordinator.sh/gpu-core": "50", "koordinator.sh/gpu-memory": "8Gi", "koordinator.sh/gpu.shared": "1"}
    alike = make_pod(kube, "big", {"nvidia.com/gpu": "8"}), make_pod(kube, "share", share)
    assert got == (scores(alike[0]), scores(alike[1]))


def test_a_new_cycle_or_a_bind_elsewhere_lets_the_hold_go(kube: FakeKube, sched: Scheduler) -> None:
    pod = make_pod(kube, "p0", WHOLE)
    uid = pod["metadata"]["uid"]
    sched.ext.prioritize(filter_args(pod, BOTH))
    held = sched.plugin.held[uid].node
    sched.ext.filter(filter_args(pod, BOTH))  # the pod is tried again: that cycle is over
    assert uid not in sched.plugin.held
    sched.ext.prioritize(filter_args(pod, BOTH))
    other = next(n for n in BOTH if n != held)
    assert sched.ext.bind(bind_args(pod, other)) == {"Error": ""}  # kube-scheduler chose another node
    assert sched.plugin.held[uid].node == other and list(sched.plugin.held) == [uid]


def test_a_hold_whose_bind_never_comes_is_let_go(
    kube: FakeKube, sched: Scheduler, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = make_pod(kube, "p0", WHOLE), make_pod(kube, "p1", WHOLE)
    sched.ext.prioritize(filter_args(first, BOTH))
    monkeypatch.setattr("crihook.scheduler.extender.TENTATIVE_SECONDS", 0.0)
    sched.ext.prioritize(filter_args(second, BOTH))
    assert list(sched.plugin.held) == [second["metadata"]["uid"]]


GPU1 = "GPU-10000001-aaaa-bbbb-cccc-000000000001"


def nvidia_slice(kube: FakeKube, generation: int = 1) -> None:
    """NVIDIA's driver publishing gpu-node-1's GPU 1 by UUID and GPU 3 by PCI bus id only."""
    kube.create(
        "resourceslices",
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": f"{NODE}-gpu.nvidia.com-{generation}"},
            "spec": {
                "driver": "gpu.nvidia.com",
                "nodeName": NODE,
                "pool": {"name": NODE, "generation": generation, "resourceSliceCount": 1},
                "devices": [
                    {"name": "gpu-1", "attributes": {"uuid": {"string": GPU1}, "index": {"int": 1}}},
                    {"name": "gpu-3", "attributes": {"pcieBusID": {"string": "00000000:13:00.0"}}},
                ],
            },
        },
    )


def allocated_claim(kube: FakeKube, name: str, *devices: str) -> dict[str, Any]:
    """A claim as kube-scheduler leaves it: created by the user, allocated through /status."""
    obj = kube.create(
        "resourceclaims",
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "team-b"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
        },
    )
    results = [{"request": "gpu", "driver": "gpu.nvidia.com", "pool": NODE, "device": d} for d in devices]
    obj["status"] = {"allocation": {"devices": {"results": results}}}
    return kube.put("resourceclaims", obj, "status")


def test_gpus_allocated_claims_hold_are_never_given_to_an_annotation_pod(kube: FakeKube, sched: Scheduler) -> None:
    nvidia_slice(kube)
    allocated_claim(kube, "train", "gpu-1", "gpu-3")
    eventually(lambda: sched.plugin.claimed.get(NODE) == {1, 3})
    pods = [make_pod(kube, f"w{i}", WHOLE) for i in range(6)]
    got = []
    for p in pods:
        assert sched.ext.bind(bind_args(p)) == {"Error": ""}
        got += gpus_of(kube, "team-a", p["metadata"]["name"])
    assert sorted(got) == [0, 2, 4, 5, 6, 7]
    late = make_pod(kube, "late", HALF)
    assert "2 held by a DRA claim" in sched.ext.filter(filter_args(late, [NODE]))["FailedNodes"][NODE]
    # a restart rebuilds the claims from the API server alone
    sched.stop()
    fresh = start_scheduler(kube)
    try:
        assert fresh.plugin.claimed == {NODE: {1, 3}}
        # the claim deleted (its pod gone): its GPUs are free again
        kube.delete("resourceclaims", "train", "team-b")
        eventually(lambda: NODE not in fresh.plugin.claimed)
        assert fresh.ext.filter(filter_args(late, [NODE]))["NodeNames"] == [NODE]
    finally:
        fresh.stop()


def test_a_claim_the_watches_missed_is_refused_at_the_bind_then_listed(kube: FakeKube, sched: Scheduler) -> None:
    """The claim and its pod are in the API server, but this replica's watches are behind (a stalled
    connection is noticed only at its read timeout): the bind reads the claims of the node's pods and
    refuses their GPUs, and the cache lists the claims again, so the next try places the pod right."""
    nvidia_slice(kube)
    eventually(lambda: bool(sched.cache.claims.slices))
    kube.pause_watches()
    try:
        allocated_claim(kube, "train", "gpu-1", "gpu-3")
        spec = {"nodeName": NODE, "resourceClaims": [{"name": "gpu", "resourceClaimName": "train"}], "containers": []}
        kube.create("pods", {"metadata": {"name": "trainer", "namespace": "team-b"}, "spec": spec})
        refused = metrics.SCHEDULER_BINDS_REFUSED.value("stale_view")
        bound: list[int] = []
        errors: list[str] = []
        for p in [make_pod(kube, f"w{i}", WHOLE) for i in range(6)]:
            for _ in range(3):
                error = sched.ext.bind(bind_args(p))["Error"]
                if not error:
                    bound += gpus_of(kube, "team-a", p["metadata"]["name"])
                    break
                errors.append(error)
                eventually(lambda: sched.plugin.claimed.get(NODE) == {1, 3})  # listed again, watches still held
        assert sorted(bound) == [0, 2, 4, 5, 6, 7]
        assert errors and all("held by ResourceClaim team-b/train on the API server" in e for e in errors)
        assert metrics.SCHEDULER_BINDS_REFUSED.value("stale_view") == refused + len(errors)
    finally:
        kube.pause_watches(False)


def test_a_republished_pool_moves_what_a_claim_holds(kube: FakeKube, sched: Scheduler) -> None:
    nvidia_slice(kube)
    allocated_claim(kube, "c", "gpu-1")
    eventually(lambda: sched.plugin.claimed.get(NODE) == {1})
    kube.delete("resourceslices", f"{NODE}-gpu.nvidia.com-1")
    eventually(lambda: NODE not in sched.plugin.claimed)
    nvidia_slice(kube, generation=2)
    eventually(lambda: sched.plugin.claimed.get(NODE) == {1})


def test_a_cluster_without_dra_is_ready_with_no_claims() -> None:
    with FakeKube(dra=False) as kube:
        for n in fixture("cluster_nodes.json")["items"]:
            kube.create("nodes", n)
        for d in fixture("cluster_devices.json")["items"]:
            kube.create("devices", d)
        s = start_scheduler(kube)
        try:
            assert s.cache.ready() and s.plugin.claimed == {}
            pod = make_pod(kube, "p", WHOLE)
            assert s.ext.bind(bind_args(pod)) == {"Error": ""}
        finally:
            s.stop()


def test_the_webhooks_claim_template_is_written_once_per_content(kube: FakeKube) -> None:
    from crihook.scheduler.cache import KubeApi
    from crihook.scheduler.draconvert import template_for

    api = KubeApi(kube.api_client())
    tpl = template_for("team-a", {"devices": {"requests": [{"name": "gpus", "exactly": {"deviceClassName": "x"}}]}})
    api.create_template(tpl)
    api.create_template(tpl)  # a pod of the same shape: the template is there already
    assert kube.get("resourceclaimtemplates", tpl["metadata"]["name"], "team-a")["spec"] == tpl["spec"]
    with FakeKube(dra=False) as old:  # a cluster without DRA: the webhook keeps the pod as it is
        with pytest.raises(ApiFailure) as e:
            KubeApi(old.api_client()).create_template(tpl)
        assert e.value.code == 404


def test_a_watch_left_as_its_request_was_under_way_holds_up_no_later_request(kube: FakeKube) -> None:
    """stop() between a watch's request and its first read: the API server goes on streaming on that
    connection, so it must not go back to the client's pool open, where the next request (a term's
    last label write, at SIGTERM) would wait behind the stream until its own timeout."""
    core = client.CoreV1Api(kube.api_client())
    reflector: Reflector

    def list_node(**kwargs: Any) -> Any:
        answer = core.list_node(**kwargs)
        if kwargs.get("watch"):
            reflector._stop.set()  # as stop() does, once the watch's request is answered
        return answer

    reflector = Reflector("nodes", list_node, lambda items: None, lambda kind, obj: None)
    reflector.start()
    reflector._thread.join(10)
    assert not reflector._thread.is_alive() and reflector.synced.is_set()
    name = fixture("cluster_nodes.json")["items"][0]["metadata"]["name"]
    # behind an open watch (the fake's last 300 s) this times out; on a connection of its own it is answered
    core.patch_node(name, {"metadata": {"labels": {"leader": "no"}}}, _preload_content=False, _request_timeout=3)
