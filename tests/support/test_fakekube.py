"""The fake API server, checked through the real `kubernetes` client: what the cache, the binder and the
device reporter rely on must behave as on a real API server."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from tests.support.fakekube import (
    DEVICE_GROUP,
    DEVICE_VERSION,
    FakeKube,
    json_patch,
    merge_patch,
    strategic_merge_patch,
)


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    with FakeKube() as k:
        yield k


@pytest.fixture
def core(kube: FakeKube) -> client.CoreV1Api:
    return client.CoreV1Api(kube.api_client())


@pytest.fixture
def custom(kube: FakeKube) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(kube.api_client())


def pod(name: str, ns: str = "default", **labels: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {"containers": [{"name": "main", "image": "busybox"}]},
    }


def device(name: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{DEVICE_GROUP}/{DEVICE_VERSION}",
        "kind": "Device",
        "metadata": {"name": name},
        "spec": {"devices": [{"type": "gpu", "minor": 0, "id": "GPU-0", "health": True}]},
    }


def status_of(e: ApiException) -> dict[str, Any]:
    return json.loads(e.body)


def test_node_crud_and_404(core: client.CoreV1Api) -> None:
    core.create_node({"metadata": {"name": "n1", "labels": {"gpu": "yes"}}})
    n = core.read_node("n1")
    assert n.metadata.name == "n1" and n.metadata.uid and int(n.metadata.resource_version) > 0
    with pytest.raises(ApiException) as e:
        core.read_node("nope")
    assert e.value.status == 404
    body = status_of(e.value)
    assert body["kind"] == "Status" and body["reason"] == "NotFound" and body["code"] == 404
    assert body["details"] == {"name": "nope", "kind": "nodes"}
    with pytest.raises(ApiException) as e:
        core.create_node({"metadata": {"name": "n1"}})
    assert e.value.status == 409 and status_of(e.value)["reason"] == "AlreadyExists"
    core.delete_node("n1")
    assert core.list_node().items == []


def test_stale_put_conflicts_like_the_api_server(core: client.CoreV1Api) -> None:
    created = core.create_namespaced_pod("default", pod("p"))
    first = core.read_namespaced_pod("p", "default")
    first.metadata.labels = {"a": "1"}
    updated = core.replace_namespaced_pod("p", "default", first)
    assert int(updated.metadata.resource_version) > int(created.metadata.resource_version)
    stale = core.read_namespaced_pod("p", "default")
    stale.metadata.resource_version = created.metadata.resource_version
    stale.metadata.labels = {"a": "2"}
    with pytest.raises(ApiException) as e:
        core.replace_namespaced_pod("p", "default", stale)
    assert e.value.status == 409
    body = status_of(e.value)
    assert body["reason"] == "Conflict" and "the object has been modified" in body["message"]
    assert body["details"] == {"name": "p", "kind": "pods"}
    assert core.read_namespaced_pod("p", "default").metadata.labels == {"a": "1"}


def test_patch_kinds(core: client.CoreV1Api, kube: FakeKube) -> None:
    core.create_namespaced_pod("ns1", pod("p", "ns1"))
    # the client sends a dict as a strategic merge patch
    core.patch_namespaced_pod("p", "ns1", {"metadata": {"annotations": {"a": "1", "b": "2"}}})
    assert kube.requests[-1].content_type.startswith("application/strategic-merge-patch+json")
    core.patch_namespaced_pod("p", "ns1", {"metadata": {"annotations": {"a": None}}})
    assert core.read_namespaced_pod("p", "ns1").metadata.annotations == {"b": "2"}
    # and a list as a JSON patch
    core.patch_namespaced_pod("p", "ns1", [{"op": "add", "path": "/metadata/annotations/c~1d", "value": "3"}])
    assert kube.requests[-1].content_type.startswith("application/json-patch+json")
    assert core.read_namespaced_pod("p", "ns1").metadata.annotations == {"b": "2", "c/d": "3"}
    # a resourceVersion inside a patch is a precondition
    with pytest.raises(ApiException) as e:
        core.patch_namespaced_pod("p", "ns1", {"metadata": {"resourceVersion": "1", "labels": {"x": "y"}}})
    assert e.value.status == 409
    with pytest.raises(ApiException) as e:
        core.patch_namespaced_pod("missing", "ns1", {"metadata": {"labels": {"x": "y"}}})
    assert e.value.status == 404


def test_patch_functions() -> None:
    assert merge_patch({"a": {"b": 1, "c": 2}, "l": [1]}, {"a": {"b": None}, "l": [2]}) == {"a": {"c": 2}, "l": [2]}
    doc = {"spec": {"containers": [{"name": "a", "image": "x"}, {"name": "b", "image": "y"}]}}
    out = strategic_merge_patch(doc, {"spec": {"containers": [{"name": "b", "image": "z"}, {"name": "c"}]}})
    assert out["spec"]["containers"] == [{"name": "a", "image": "x"}, {"name": "b", "image": "z"}, {"name": "c"}]
    out = strategic_merge_patch(doc, {"spec": {"containers": [{"name": "a", "$patch": "delete"}]}})
    assert [c["name"] for c in out["spec"]["containers"]] == ["b"]
    assert json_patch(
        {"a": [1, 3]}, [{"op": "add", "path": "/a/1", "value": 2}, {"op": "test", "path": "/a/2", "value": 3}]
    ) == {"a": [1, 2, 3]}
    assert json_patch({"a": 1}, [{"op": "move", "from": "/a", "path": "/b"}]) == {"b": 1}


def test_status_subresource(core: client.CoreV1Api) -> None:
    core.create_node({"metadata": {"name": "n"}, "status": {"capacity": {"cpu": "4"}}})
    # create ignores nothing, but an update of the object keeps the stored status
    n = core.read_node("n")
    n.status.capacity = {"cpu": "99"}
    n.metadata.labels = {"x": "y"}
    core.replace_node("n", n)
    assert core.read_node("n").status.capacity == {"cpu": "4"}
    core.patch_node_status("n", {"status": {"allocatable": {"koordinator.sh/gpu-core": "800"}}})
    n = core.read_node("n")
    assert n.status.allocatable == {"koordinator.sh/gpu-core": "800"} and n.metadata.labels == {"x": "y"}


def test_binding(core: client.CoreV1Api, kube: FakeKube) -> None:
    created = core.create_namespaced_pod("default", pod("p"))
    binding = client.V1Binding(
        metadata=client.V1ObjectMeta(name="p", uid=created.metadata.uid),
        target=client.V1ObjectReference(kind="Node", name="n1", api_version="v1"),
    )
    # the API server answers a Status, which the generated client can not decode as a V1Binding
    resp = core.create_namespaced_pod_binding("p", "default", binding, _preload_content=False)
    assert resp.status == 201 and json.loads(resp.data)["status"] == "Success"
    assert kube.get("pods", "p", "default")["spec"]["nodeName"] == "n1"
    with pytest.raises(ApiException) as e:
        core.create_namespaced_pod_binding("p", "default", binding, _preload_content=False)
    assert e.value.status == 409 and "already assigned" in status_of(e.value)["message"]
    core.create_namespaced_pod("default", pod("q"))
    wrong_uid = client.V1Binding(
        metadata=client.V1ObjectMeta(name="q", uid="not-the-uid"), target=client.V1ObjectReference(name="n1")
    )
    with pytest.raises(ApiException) as e:
        core.create_namespaced_pod_binding("q", "default", wrong_uid, _preload_content=False)
    assert e.value.status == 409
    with pytest.raises(ApiException) as e:
        core.create_namespaced_pod_binding("gone", "default", binding, _preload_content=False)
    assert e.value.status == 404
    # pod spec.nodeName can not be set by an update
    q = kube.get("pods", "q", "default")
    q["spec"]["nodeName"] = "n2"
    with pytest.raises(ApiException) as e:
        core.replace_namespaced_pod("q", "default", q)
    assert e.value.status == 422


def test_binding_resource_version_is_a_precondition(core: client.CoreV1Api, kube: FakeKube) -> None:
    # BindingREST.setPodHostAndAnnotations checks metadata.uid and metadata.resourceVersion of the
    # Binding against the pod, and merges the Binding's annotations into it
    created = core.create_namespaced_pod("default", pod("p"))
    read_rv = created.metadata.resource_version
    kube.patch("pods", "p", {"metadata": {"labels": {"changed": "yes"}}}, "default")
    target = client.V1ObjectReference(kind="Node", name="n1", api_version="v1")
    stale = client.V1Binding(
        metadata=client.V1ObjectMeta(name="p", uid=created.metadata.uid, resource_version=read_rv), target=target
    )
    with pytest.raises(ApiException) as e:
        core.create_namespaced_pod_binding("p", "default", stale, _preload_content=False)
    assert e.value.status == 409
    assert "Precondition failed: ResourceVersion in precondition" in status_of(e.value)["message"]
    assert not kube.get("pods", "p", "default")["spec"].get("nodeName")
    fresh = client.V1Binding(
        metadata=client.V1ObjectMeta(
            name="p",
            uid=created.metadata.uid,
            resource_version=kube.get("pods", "p", "default")["metadata"]["resourceVersion"],
            annotations={"a": "1"},
        ),
        target=target,
    )
    core.create_namespaced_pod_binding("p", "default", fresh, _preload_content=False)
    bound = kube.get("pods", "p", "default")
    assert bound["spec"]["nodeName"] == "n1" and bound["metadata"]["annotations"] == {"a": "1"}


def test_watch_resumes_after_the_version_it_saw(core: client.CoreV1Api, kube: FakeKube) -> None:
    """A watcher whose stream broke resumes from the last resourceVersion it saw and gets exactly
    what came after (the watch cache's getAllEventsSinceLocked); once that is out of the history it
    gets 410 (test_watch_too_old_gets_410)."""
    core.create_namespaced_pod("default", pod("p"))
    seen = core.patch_namespaced_pod("p", "default", {"metadata": {"labels": {"step": "1"}}}).metadata.resource_version
    core.patch_namespaced_pod("p", "default", {"metadata": {"labels": {"step": "2"}}})
    core.delete_namespaced_pod("p", "default")
    resp = core.list_pod_for_all_namespaces(
        watch=True, resource_version=seen, timeout_seconds=1, _preload_content=False
    )
    events = [json.loads(line) for line in resp.data.splitlines() if line.strip()]
    assert [(e["type"], e["object"]["metadata"].get("labels")) for e in events] == [
        ("MODIFIED", {"step": "2"}),
        ("DELETED", {"step": "2"}),
    ]


def test_selectors(core: client.CoreV1Api) -> None:
    core.create_namespaced_pod("a", pod("p1", "a", app="x", tier="web"))
    core.create_namespaced_pod("b", pod("p2", "b", app="y"))
    core.create_namespaced_pod("b", pod("p3", "b"))
    names = lambda lst: sorted(p.metadata.name for p in lst.items)  # noqa: E731
    assert names(core.list_pod_for_all_namespaces(label_selector="app=x")) == ["p1"]
    assert names(core.list_pod_for_all_namespaces(label_selector="app in (x,y)")) == ["p1", "p2"]
    assert names(core.list_pod_for_all_namespaces(label_selector="!app")) == ["p3"]
    assert names(core.list_pod_for_all_namespaces(label_selector="app,app!=x")) == ["p2"]
    assert names(core.list_namespaced_pod("b")) == ["p2", "p3"]
    assert names(core.list_pod_for_all_namespaces(field_selector="metadata.namespace=a")) == ["p1"]
    with pytest.raises(ApiException) as e:
        core.list_pod_for_all_namespaces(field_selector="spec.bogus=1")
    assert e.value.status == 400


def test_node_name_lists_follow_binds_and_deletes(core: client.CoreV1Api, kube: FakeKube) -> None:
    """A LIST pinned to one spec.nodeName reads the fake's index (as the API server's watch cache
    does): the index must follow every way a pod's node changes, and agree with a full scan."""
    for i in range(4):
        core.create_namespaced_pod("a" if i % 2 else "b", pod(f"p{i}", "a" if i % 2 else "b", app="x"))

    def on(node: str, ns: str | None = None, more: str = "") -> list[str]:
        fields = f"spec.nodeName={node}{more}"
        lst = (
            core.list_namespaced_pod(ns, field_selector=fields)
            if ns
            else core.list_pod_for_all_namespaces(field_selector=fields)
        )
        return [p.metadata.name for p in lst.items]

    assert on("") == ["p1", "p3", "p0", "p2"]  # unbound pods are the index's "" entry; sorted by namespace, name
    for name, ns, node in (("p0", "b", "n1"), ("p1", "a", "n1"), ("p2", "b", "n2")):
        target = client.V1ObjectReference(kind="Node", name=node, api_version="v1")
        binding = client.V1Binding(metadata=client.V1ObjectMeta(name=name), target=target)
        core.create_namespaced_pod_binding(name, ns, binding, _preload_content=False)
    assert on("n1") == ["p1", "p0"] and on("n2") == ["p2"] and on("") == ["p3"]
    assert on("n1", "b") == ["p0"] and on("n1", more=",metadata.namespace=a") == ["p1"]
    assert on("n1", more=",spec.nodeName=n2") == []  # every term still applies
    kube.patch("pods", "p0", {"metadata": {"labels": {"app": "y"}}}, "b")
    assert on("n1") == ["p1", "p0"]  # an update that keeps the node keeps its entry
    core.delete_namespaced_pod("p1", "a")
    assert on("n1") == ["p0"] and on("n9") == []
    everyone = {p.metadata.name: p.spec.node_name or "" for p in core.list_pod_for_all_namespaces().items}
    assert everyone == {"p0": "n1", "p2": "n2", "p3": ""}
    assert sorted(on("")) == sorted(n for n, node in everyone.items() if node == "")


def test_delete_preconditions(core: client.CoreV1Api) -> None:
    core.create_namespaced_pod("default", pod("p"))
    with pytest.raises(ApiException) as e:
        core.delete_namespaced_pod(
            "p", "default", body=client.V1DeleteOptions(preconditions=client.V1Preconditions(uid="other"))
        )
    assert e.value.status == 409
    uid = core.read_namespaced_pod("p", "default").metadata.uid
    core.delete_namespaced_pod(
        "p", "default", body=client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid))
    )
    with pytest.raises(ApiException) as e:
        core.delete_namespaced_pod("p", "default")
    assert e.value.status == 404


def test_custom_resource(custom: client.CustomObjectsApi) -> None:
    args = (DEVICE_GROUP, DEVICE_VERSION, "devices")
    made = custom.create_cluster_custom_object(*args, device("n1"))
    assert made["kind"] == "Device" and made["metadata"]["uid"]
    got = custom.get_cluster_custom_object(*args, "n1")
    got["spec"]["devices"][0]["health"] = False
    custom.replace_cluster_custom_object(*args, "n1", got)
    got["metadata"]["labels"] = {"x": "y"}  # still the old resourceVersion
    with pytest.raises(ApiException) as e:
        custom.replace_cluster_custom_object(*args, "n1", got)
    assert e.value.status == 409
    assert status_of(e.value)["details"] == {"name": "n1", "kind": "devices", "group": DEVICE_GROUP}
    custom.patch_cluster_custom_object(*args, "n1", {"metadata": {"annotations": {"k": "v"}}})
    custom.patch_cluster_custom_object_status(*args, "n1", {"status": {"ok": True}})
    lst = custom.list_cluster_custom_object(*args)
    assert lst["kind"] == "DeviceList" and int(lst["metadata"]["resourceVersion"]) > 0
    (item,) = lst["items"]
    assert item["kind"] == "Device" and item["metadata"]["annotations"] == {"k": "v"}
    assert item["status"] == {"ok": True} and item["spec"]["devices"][0]["health"] is False
    custom.delete_cluster_custom_object(*args, "n1")
    with pytest.raises(ApiException) as e:
        custom.get_cluster_custom_object(*args, "n1")
    assert e.value.status == 404 and "devices.scheduling.koordinator.sh" in status_of(e.value)["message"]


def test_watch_from_list_version(core: client.CoreV1Api, kube: FakeKube) -> None:
    core.create_namespaced_pod("default", pod("before"))
    rv = core.list_pod_for_all_namespaces().metadata.resource_version
    seen: list[tuple[str, str]] = []
    ready = threading.Event()

    def watcher() -> None:
        w = watch.Watch()
        ready.set()
        for ev in w.stream(core.list_pod_for_all_namespaces, resource_version=rv, timeout_seconds=5):
            seen.append((ev["type"], ev["object"].metadata.name))
            if ev["type"] == "DELETED":
                w.stop()

    t = threading.Thread(target=watcher)
    t.start()
    ready.wait()
    core.create_namespaced_pod("default", pod("p"))
    core.patch_namespaced_pod("p", "default", {"metadata": {"labels": {"a": "b"}}})
    core.delete_namespaced_pod("p", "default")
    t.join(10)
    assert not t.is_alive()
    assert seen == [("ADDED", "p"), ("MODIFIED", "p"), ("DELETED", "p")]


def test_watch_without_version_starts_with_current_state(custom: client.CustomObjectsApi, kube: FakeKube) -> None:
    kube.create("devices", device("a"))
    kube.create("devices", device("b"))
    w = watch.Watch()
    got = []
    for ev in w.stream(custom.list_cluster_custom_object, DEVICE_GROUP, DEVICE_VERSION, "devices", timeout_seconds=1):
        got.append((ev["type"], ev["object"]["metadata"]["name"]))
        if len(got) == 2:
            w.stop()
    assert sorted(got) == [("ADDED", "a"), ("ADDED", "b")]


def test_watch_too_old_gets_410(core: client.CoreV1Api, kube: FakeKube) -> None:
    core.create_node({"metadata": {"name": "n"}})
    old = core.list_node().metadata.resource_version
    core.patch_node("n", {"metadata": {"labels": {"a": "b"}}})
    kube.compact()
    with pytest.raises(ApiException) as e:
        for _ in watch.Watch().stream(core.list_node, resource_version=old, timeout_seconds=2):
            pass
    assert e.value.status == 410
    # the raw event is the API server's ERROR event with an Expired Status
    resp = core.list_node(watch=True, resource_version=old, _preload_content=False)
    ev = json.loads(resp.readline())
    assert ev["type"] == "ERROR" and ev["object"]["code"] == 410 and ev["object"]["reason"] == "Expired"


def test_watch_selector_exit_is_a_delete(core: client.CoreV1Api) -> None:
    core.create_node({"metadata": {"name": "n", "labels": {"gpu": "true"}}})
    rv = core.list_node().metadata.resource_version
    events = []
    w = watch.Watch()
    t = threading.Thread(
        target=lambda: events.extend(
            (e["type"], e["object"].metadata.name)
            for e in w.stream(core.list_node, label_selector="gpu=true", resource_version=rv, timeout_seconds=2)
        )
    )
    t.start()
    core.patch_node("n", {"metadata": {"labels": {"gpu": None}}})
    t.join(5)
    assert events == [("DELETED", "n")]


def test_close_watches_ends_the_stream(core: client.CoreV1Api, kube: FakeKube) -> None:
    done = threading.Event()

    def run() -> None:
        for _ in watch.Watch().stream(core.list_node, resource_version=str(kube.resource_version), timeout_seconds=30):
            pass
        done.set()

    t = threading.Thread(target=run)
    t.start()
    for _ in range(100):
        if any("watch=true" in r.query for r in kube.requests):
            break
        time.sleep(0.02)
    time.sleep(0.1)
    kube.close_watches()
    t.join(5)
    assert done.is_set()


def test_fault_injection(core: client.CoreV1Api, kube: FakeKube) -> None:
    core.create_node({"metadata": {"name": "n"}})
    kube.fail_next(2, 500, method="GET")
    for _ in range(2):
        with pytest.raises(ApiException) as e:
            core.read_node("n")
        assert e.value.status == 500 and status_of(e.value)["kind"] == "Status"
    assert core.read_node("n").metadata.name == "n"
    kube.fail_next(1, 409, path="/binding")
    core.patch_node("n", {"metadata": {"labels": {"a": "b"}}})  # not matched
    kube.delay = 0.05
    assert core.read_node("n").metadata.labels == {"a": "b"}


def test_unknown_paths(kube: FakeKube) -> None:
    for path in ("/api/v1/configmaps", "/apis/other.io/v1alpha1/devices", "/api/v1/nodes/n/proxy"):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(kube.url + path, timeout=5)
        assert e.value.code == 404 and json.loads(e.value.read())["reason"] == "NotFound"


def test_uid_in_a_patch_is_immutable(core: client.CoreV1Api) -> None:
    uid = core.create_namespaced_pod("default", pod("p")).metadata.uid
    core.patch_namespaced_pod("p", "default", {"metadata": {"uid": uid, "annotations": {"a": "1"}}})
    with pytest.raises(ApiException) as e:
        core.patch_namespaced_pod("p", "default", {"metadata": {"uid": "other", "annotations": {"a": "2"}}})
    assert e.value.status == 422 and "field is immutable" in status_of(e.value)["message"]
    assert core.read_namespaced_pod("p", "default").metadata.annotations == {"a": "1"}


def test_paused_watches_hold_events(core: client.CoreV1Api, kube: FakeKube) -> None:
    rv = core.list_node().metadata.resource_version
    kube.pause_watches()
    events: list[str] = []
    w = watch.Watch()

    def run() -> None:
        for ev in w.stream(core.list_node, resource_version=rv, timeout_seconds=5):
            events.append(ev["object"].metadata.name)
            w.stop()

    t = threading.Thread(target=run)
    t.start()
    core.create_node({"metadata": {"name": "n"}})
    time.sleep(0.3)
    assert events == []
    kube.pause_watches(False)
    t.join(5)
    assert events == ["n"]
