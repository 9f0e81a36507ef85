"""Admission webhook: seed 001's mutation, validation through the allocator's own rules, the
protected allocation annotations, and the AdmissionReview v1 wire format."""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crihook.base.allocation import CONTAINER_DEVICES, DEVICE_ALLOCATED, GPU_SHARED
from crihook.scheduler import webhook
from crihook.scheduler.pod import pod_from_json
from crihook.scheduler.request import RequestError, parse_request
from tests.support.extender import FIXTURES
from tests.support.fakekube import json_patch

SA = "system:serviceaccount:kube-system:crihook-scheduler"
CONFIG = webhook.WebhookConfig()


def review(fixture: str = "admission_create.json") -> dict[str, Any]:
    return json.loads((FIXTURES / fixture).read_text())


def with_resources(rv: dict[str, Any], resources: dict[str, str], init: bool = False) -> dict[str, Any]:
    rv = copy.deepcopy(rv)
    c = rv["request"]["object"]["spec"]["containers"][0]
    c["resources"] = {"limits": dict(resources), "requests": dict(resources)}
    if init:
        rv["request"]["object"]["spec"]["initContainers"] = [copy.deepcopy(c) | {"name": "warmup"}]
    return rv


def patched(rv: dict[str, Any], resp: dict[str, Any]) -> dict[str, Any]:
    r = resp["response"]
    if "patch" not in r:
        return rv["request"]["object"]
    assert r["patchType"] == "JSONPatch"
    return json_patch(rv["request"]["object"], json.loads(base64.b64decode(r["patch"])))


def limits(pod: dict[str, Any], i: int = 0) -> dict[str, Any]:
    return pod["spec"]["containers"][i]["resources"]["limits"]


def test_fixture_converts_koordinator_gpu() -> None:
    rv = review()
    resp = webhook.mutate(rv, CONFIG)
    assert resp["apiVersion"] == "admission.k8s.io/v1" and resp["kind"] == "AdmissionReview"
    assert resp["response"]["uid"] == rv["request"]["uid"] and resp["response"]["allowed"] is True
    pod = patched(rv, resp)
    res = pod["spec"]["containers"][0]["resources"]
    want = {"koordinator.sh/gpu-core": "50", "koordinator.sh/gpu-memory-ratio": "50", GPU_SHARED: "1"}
    assert res["limits"] == want and res["requests"] == want
    # the mutated pod is what the validating webhook then sees, and it passes
    rv2 = copy.deepcopy(rv)
    rv2["request"]["object"] = pod
    assert webhook.validate(rv2, CONFIG)["response"]["allowed"] is True
    req = parse_request(pod_from_json(pod))
    assert (req.count, req.core, req.ratio) == (1, 50, 50)


@pytest.mark.parametrize(
    ("resources", "shared"),
    [
        ({"koordinator.sh/gpu-memory-ratio": "200", "koordinator.sh/gpu-core": "200"}, "2"),
        ({"koordinator.sh/gpu-memory-ratio": "100"}, "1"),
        ({"koordinator.sh/gpu-memory-ratio": "30", "koordinator.sh/gpu-core": "30"}, "1"),
        ({"koordinator.sh/gpu-memory-ratio": "150"}, "1"),  # not a multiple: one GPU (validation then refuses)
        ({"koordinator.sh/gpu-memory": "8Gi", "koordinator.sh/gpu-core": "20"}, "1"),
        ({"koordinator.sh/gpu": "300"}, "3"),
    ],
)
def test_gpu_shared_injection(resources: dict[str, str], shared: str) -> None:
    rv = with_resources(review(), resources)
    pod = patched(rv, webhook.mutate(rv, CONFIG))
    assert limits(pod)[GPU_SHARED] == shared
    assert pod["spec"]["containers"][0]["resources"]["requests"][GPU_SHARED] == shared


@pytest.mark.parametrize(
    "resources",
    [
        {"nvidia.com/gpu": "2"},  # vendor API: the scheduler normalises, the webhook adds nothing
        {"koordinator.sh/gpu-memory-ratio": "50", GPU_SHARED: "1"},  # already there
        {"cpu": "1"},
        {"koordinator.sh/gpu-core": "50"},  # core alone is invalid: left for validation
        {"nvidia.com/gpu": "1", "koordinator.sh/gpu-memory-ratio": "50"},  # both APIs: left for validation
        {"koordinator.sh/gpu": "50", "koordinator.sh/gpu-core": "10"},  # conflicting: left for validation
    ],
)
def test_no_patch(resources: dict[str, str]) -> None:
    rv = with_resources(review(), resources)
    resp = webhook.mutate(rv, CONFIG)
    assert resp["response"] == {"uid": rv["request"]["uid"], "allowed": True}


def test_init_containers_are_mutated_too() -> None:
    rv = with_resources(review(), {"koordinator.sh/gpu-memory-ratio": "100"}, init=True)
    pod = patched(rv, webhook.mutate(rv, CONFIG))
    assert pod["spec"]["initContainers"][0]["resources"]["limits"][GPU_SHARED] == "1"
    assert limits(pod)[GPU_SHARED] == "1"


@pytest.mark.parametrize(
    "resources",
    [
        {"nvidia.com/gpu": "1", "koordinator.sh/gpu-memory-ratio": "50", GPU_SHARED: "1"},
        {"koordinator.sh/gpu-memory": "1Gi", "koordinator.sh/gpu-memory-ratio": "50", GPU_SHARED: "1"},
        {"koordinator.sh/gpu-core": "50"},
        {"koordinator.sh/gpu-memory-ratio": "50"},
        {"koordinator.sh/gpu-memory-ratio": "150", GPU_SHARED: "1"},
    ],
)
def test_validation_uses_the_allocators_reasons(resources: dict[str, str]) -> None:
    rv = with_resources(review(), resources)
    resp = webhook.validate(rv, CONFIG)["response"]
    assert resp["allowed"] is False and resp["uid"] == rv["request"]["uid"]
    with pytest.raises(RequestError) as e:
        parse_request(
            pod_from_json(rv["request"]["object"] | {"metadata": {"name": "notebook", "namespace": "team-a"}})
        )
    assert resp["status"] == {"code": 400, "reason": "BadRequest", "message": str(e.value)}
    assert "team-a/notebook" in resp["status"]["message"]


@pytest.mark.parametrize("key", [DEVICE_ALLOCATED, CONTAINER_DEVICES])
def test_only_the_scheduler_writes_allocation_annotations(key: str) -> None:
    rv = with_resources(review(), {"nvidia.com/gpu": "1"})
    rv["request"]["object"]["metadata"]["annotations"] = {key: '{"gpu":[{"minor":0}]}'}
    resp = webhook.validate(rv, CONFIG)["response"]
    assert resp["allowed"] is False and resp["status"]["code"] == 403 and key in resp["status"]["message"]
    rv["request"]["userInfo"]["username"] = SA
    assert webhook.validate(rv, CONFIG)["response"]["allowed"] is True
    # UPDATE: a user may not change it either, but may leave it as it is
    upd = copy.deepcopy(rv)
    upd["request"]["operation"] = "UPDATE"
    upd["request"]["userInfo"]["username"] = "alice@example.com"
    upd["request"]["oldObject"] = copy.deepcopy(rv["request"]["object"])
    upd["request"]["object"]["metadata"]["labels"] = {"new": "label"}
    assert webhook.validate(upd, CONFIG)["response"]["allowed"] is True
    upd["request"]["object"]["metadata"]["annotations"][key] = '{"gpu":[{"minor":1}]}'
    assert webhook.validate(upd, CONFIG)["response"]["allowed"] is False
    del upd["request"]["object"]["metadata"]["annotations"][key]
    assert webhook.validate(upd, CONFIG)["response"]["allowed"] is False


def test_scheduler_name_switch() -> None:
    config = webhook.WebhookConfig(scheduler_name="crihook-scheduler")
    rv = review()
    pod = patched(rv, webhook.mutate(rv, config))
    assert pod["spec"]["schedulerName"] == "crihook-scheduler"
    cpu = with_resources(review(), {"cpu": "1"})
    assert "patch" not in webhook.mutate(cpu, config)["response"]
    other = review()
    other["request"]["object"]["spec"]["schedulerName"] = "volcano"
    assert patched(other, webhook.mutate(other, config))["spec"]["schedulerName"] == "volcano"


def test_other_requests_pass() -> None:
    rv = review()
    rv["request"]["resource"] = {"group": "", "version": "v1", "resource": "pods"}
    rv["request"]["subResource"] = "status"
    assert webhook.mutate(rv, CONFIG)["response"] == {"uid": rv["request"]["uid"], "allowed": True}
    rv = review()
    rv["request"]["operation"] = "DELETE"
    assert webhook.validate(rv, CONFIG)["response"]["allowed"] is True


@pytest.mark.parametrize(
    "bad",
    [
        [],
        {"kind": "AdmissionReview", "apiVersion": "admission.k8s.io/v1beta1", "request": {"uid": "x"}},
        {"kind": "AdmissionReview", "apiVersion": "admission.k8s.io/v1"},
        {"kind": "AdmissionReview", "apiVersion": "admission.k8s.io/v1", "request": {"uid": ""}},
        {
            "kind": "AdmissionReview",
            "apiVersion": "admission.k8s.io/v1",
            "request": {"uid": "u", "operation": "CREATE", "resource": {"resource": "pods"}},
        },
    ],
)
def test_malformed_reviews(bad: Any) -> None:
    with pytest.raises(webhook.ReviewError):
        webhook.mutate(bad, CONFIG)


quantities = st.one_of(st.integers(0, 900).map(str), st.sampled_from(["1Gi", "500Mi", "abc", "-5", "1.5", "0"]))
names = st.sampled_from(
    [
        "nvidia.com/gpu",
        "koordinator.sh/gpu",
        "koordinator.sh/gpu-core",
        "koordinator.sh/gpu-memory",
        "koordinator.sh/gpu-memory-ratio",
        GPU_SHARED,
        "cpu",
    ]
)


@given(st.dictionaries(names, quantities, max_size=4))
def test_mutation_is_idempotent_and_never_invents_an_invalid_pod(resources: dict[str, str]) -> None:
    """Mutating twice adds nothing the second time; a pod the allocator accepts before mutation is
    accepted after it, with the same normalised request."""
    rv = with_resources(review(), resources)
    pod = patched(rv, webhook.mutate(rv, CONFIG))
    again = copy.deepcopy(rv)
    again["request"]["object"] = pod
    assert "patch" not in webhook.mutate(again, CONFIG)["response"]
    try:
        before = parse_request(pod_from_json(rv["request"]["object"]))
    except RequestError:
        return
    after = parse_request(pod_from_json(pod))
    assert (after.count, after.core, after.ratio, after.memory) == (
        before.count,
        before.core,
        before.ratio,
        before.memory,
    )


@given(st.dictionaries(names, quantities, max_size=4), st.dictionaries(names, quantities, max_size=4), st.booleans())
def test_mutate_pod_leaves_its_input_alone_and_returns_what_its_patch_makes(
    limits_: dict[str, str], requests: dict[str, str], init: bool
) -> None:
    """The mutated pod shares what it does not change with the input, so a change made in place
    would show here: the input stays equal to a deep copy of itself, and the pod returned is the
    input with the returned patch applied."""
    pod = with_resources(review(), limits_, init)["request"]["object"]
    pod["spec"]["containers"][0]["resources"]["requests"] = dict(requests)
    before = copy.deepcopy(pod)
    out, ops = webhook.mutate_pod(pod, webhook.WebhookConfig(scheduler_name="crihook"))
    assert pod == before
    assert out == json_patch(before, ops)


def test_pods_bound_for_the_dra_pool_get_a_claim_and_their_template_is_written() -> None:
    from crihook.scheduler.draconvert import CLAIM, ConvertConfig

    written: list[dict[str, Any]] = []
    config = webhook.WebhookConfig(
        dra=ConvertConfig(gpu_memory=16 << 30), dra_pool="pool=dra", templates=written.append
    )
    rv = review()  # koordinator.sh/gpu: 50, converted to a share first, then to a claim
    assert "resourceClaims" not in patched(rv, webhook.mutate(rv, config))["spec"]  # not bound for the pool
    rv["request"]["object"]["spec"]["nodeSelector"] = {"pool": "dra"}
    pod = patched(rv, webhook.mutate(rv, config))
    ((tpl,),) = [written]
    assert pod["spec"]["resourceClaims"] == [{"name": CLAIM, "resourceClaimTemplateName": tpl["metadata"]["name"]}]
    assert tpl["spec"]["spec"]["devices"]["requests"][0]["exactly"]["capacity"]["requests"]["cores"] == "50"
    assert not parse_request(pod_from_json(pod)).wants_devices
    # the opt-in path converts whatever namespace the API server sent it from
    del rv["request"]["object"]["spec"]["nodeSelector"]
    assert "resourceClaims" in patched(rv, webhook.mutate(rv, config, dra_all=True))["spec"]
    # a dry run writes no template
    rv["request"]["dryRun"] = True
    webhook.mutate(rv, config, dra_all=True)
    assert len(written) == 2


def test_a_pod_turned_into_a_claim_stays_with_its_scheduler_and_one_left_as_it_is_moves() -> None:
    """A converted pod is placed by kube-scheduler's DRA allocator: handed to crihook's second
    kube-scheduler it would be allocated by two schedulers' DRA allocators at once."""
    from crihook.scheduler.draconvert import ConvertConfig

    config = webhook.WebhookConfig(
        scheduler_name="crihook-scheduler", dra=ConvertConfig(gpu_memory=16 << 30), templates=lambda _: None
    )
    rv = review()
    before = rv["request"]["object"]["spec"].get("schedulerName", "default-scheduler")
    pod = patched(rv, webhook.mutate(rv, config, dra_all=True))
    assert "resourceClaims" in pod["spec"] and pod["spec"].get("schedulerName", "default-scheduler") == before
    rv["request"]["object"]["spec"]["containers"][0]["resources"]["limits"]["koordinator.sh/rdma"] = (
        "100"  # RDMA: not converted
    )
    pod = patched(rv, webhook.mutate(rv, config, dra_all=True))
    assert "resourceClaims" not in pod["spec"] and pod["spec"]["schedulerName"] == "crihook-scheduler"


def test_a_template_that_can_not_be_written_leaves_the_pod_on_the_annotation_path() -> None:
    from crihook.scheduler.draconvert import ConvertConfig

    def fail(_: dict[str, Any]) -> None:
        raise OSError("API server down")

    config = webhook.WebhookConfig(dra=ConvertConfig(gpu_memory=16 << 30), templates=fail)
    rv = review()
    pod = patched(rv, webhook.mutate(rv, config, dra_all=True))
    assert "resourceClaims" not in pod["spec"] and parse_request(pod_from_json(pod)).wants_devices
    # without DRA conversion configured, the opt-in path only does the usual mutation
    assert patched(rv, webhook.mutate(rv, CONFIG, dra_all=True)) == patched(rv, webhook.mutate(rv, CONFIG))
