"""Today's request forms turned into a ResourceClaimTemplate and a pod patch: every form, what is
left alone, and for random pods the patched pod (applied as the API server applies a JSON patch)
asking the same GPUs through its claim and nothing through extended resources."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crihook.scheduler.draconvert import CLAIM, SHARES, ConvertConfig, convert_pod, selectors, template_for
from crihook.scheduler.pod import pod_from_json
from crihook.scheduler.request import Selectors, parse_request
from tests.support.fakekube import json_patch

GIB = 1 << 30
CONFIG = ConvertConfig(gpu_memory=16 * GIB)


def pod(*containers: dict[str, Any], annotations: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "p", "namespace": "team", "annotations": annotations or {}},
        "spec": {"containers": list(containers), **spec},
    }


def ctr(name: str, limits: dict[str, str] | None = None, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"name": name, "image": "x", **extra}
    if limits is not None:
        out["resources"] = {"limits": dict(limits), "requests": dict(limits)}
    return out


def apply(p: dict[str, Any], config: ConvertConfig = CONFIG) -> tuple[dict[str, Any], dict[str, Any]]:
    conv = convert_pod(p, config)
    assert conv is not None
    return json_patch(copy.deepcopy(p), conv.ops), conv.template


def test_whole_gpus_in_one_container_ask_for_one_nvlink_partition_first() -> None:
    got, tpl = apply(pod(ctr("main", {"nvidia.com/gpu": "2", "cpu": "4"})))
    assert tpl["apiVersion"] == "resource.k8s.io/v1" and tpl["kind"] == "ResourceClaimTemplate"
    assert tpl["metadata"]["namespace"] == "team" and tpl["metadata"]["name"].startswith("crihook-gpu-")
    devices = tpl["spec"]["spec"]["devices"]
    ((req,),) = [devices["requests"]]
    assert req["name"] == "main" and [s["name"] for s in req["firstAvailable"]] == ["nvlink", "numa", "any"]
    assert all(s["count"] == 2 and s["deviceClassName"] == "gpu.crihook.io" for s in req["firstAvailable"])
    assert devices["constraints"] == [
        {"requests": ["main/nvlink"], "matchAttribute": "gpu.crihook.io/nvlinkPartition2"},
        {"requests": ["main/numa"], "matchAttribute": "gpu.crihook.io/numaNode"},
    ]
    assert got["spec"]["resourceClaims"] == [{"name": CLAIM, "resourceClaimTemplateName": tpl["metadata"]["name"]}]
    res = got["spec"]["containers"][0]["resources"]
    assert res == {"limits": {"cpu": "4"}, "requests": {"cpu": "4"}, "claims": [{"name": CLAIM, "request": "main"}]}
    assert not parse_request(pod_from_json(got)).wants_devices  # the extender leaves it to DRA


def test_whole_gpus_per_container_are_split_and_other_containers_untouched() -> None:
    p = pod(
        ctr("a", {"nvidia.com/gpu": "1"}), ctr("b", {"nvidia.com/gpu": "1"}), ctr("side", {"cpu": "1"}), ctr("bare")
    )
    got, tpl = apply(p)
    assert [r["name"] for r in tpl["spec"]["spec"]["devices"]["requests"]] == ["a", "b"]
    assert tpl["spec"]["spec"]["devices"]["requests"][0]["exactly"]["count"] == 1
    assert "constraints" not in tpl["spec"]["spec"]["devices"]
    assert [c.get("resources", {}).get("claims") for c in got["spec"]["containers"]] == [
        [{"name": CLAIM, "request": "a"}],
        [{"name": CLAIM, "request": "b"}],
        None,
        None,
    ]
    assert got["spec"]["containers"][2:] == p["spec"]["containers"][2:]


def test_shares_become_capacity_that_every_share_container_uses() -> None:
    half = {"koordinator.sh/gpu-core": "50", "koordinator.sh/gpu-memory-ratio": "50", "koordinator.sh/gpu.shared": "1"}
    # the pod's shares add up, as the allocator counts them: two halves, each on a GPU of its own
    got, tpl = apply(pod(ctr("main", half), ctr("helper", half)))
    ((req,),) = [tpl["spec"]["spec"]["devices"]["requests"]]
    assert req == {
        "name": SHARES,
        "exactly": {
            "deviceClassName": "gpu.crihook.io",
            "allocationMode": "ExactCount",
            "count": 2,
            "capacity": {"requests": {"cores": "50", "memory": str(8 * GIB)}},
        },
    }
    assert [c["resources"]["claims"] for c in got["spec"]["containers"]] == [[{"name": CLAIM, "request": SHARES}]] * 2
    # a ratio needs the pool's GPU memory; bytes do not; gpu.shared splits the request evenly
    assert convert_pod(pod(ctr("main", half)), ConvertConfig()) is None
    by_bytes = {"koordinator.sh/gpu-core": "30", "koordinator.sh/gpu-memory": "4Gi", "koordinator.sh/gpu.shared": "2"}
    _, tpl = apply(pod(ctr("main", by_bytes)), ConvertConfig())
    exact = tpl["spec"]["spec"]["devices"]["requests"][0]["exactly"]
    assert exact["count"] == 2 and exact["capacity"]["requests"] == {"cores": "15", "memory": str(2 * GIB)}


def test_koordinator_whole_gpus_are_one_request_for_the_pod() -> None:
    got, tpl = apply(
        pod(
            ctr(
                "main",
                {
                    "koordinator.sh/gpu-core": "200",
                    "koordinator.sh/gpu-memory-ratio": "200",
                    "koordinator.sh/gpu.shared": "2",
                },
            )
        )
    )
    ((req,),) = [tpl["spec"]["spec"]["devices"]["requests"]]
    assert req["name"] == SHARES and req["firstAvailable"][0]["count"] == 2
    assert got["spec"]["containers"][0]["resources"]["claims"] == [{"name": CLAIM, "request": SHARES}]
    assert "koordinator.sh/gpu-core" not in got["spec"]["containers"][0]["resources"]["limits"]


def test_model_and_uuid_annotations_become_cel_selectors() -> None:
    sel = Selectors(("V100", "A100"), ("T4",), frozenset({"GPU-1", "GPU-2"}), frozenset({"GPU-3"}))
    model = 'device.attributes["gpu.crihook.io"].model.upperAscii()'
    uuid = 'device.attributes["gpu.crihook.io"].uuid'
    assert [s["cel"]["expression"] for s in selectors(sel)] == [
        f'{model}.contains("V100") || {model}.contains("A100")',
        f'!{model}.contains("T4")',
        f'{uuid} in ["GPU-1", "GPU-2"]',
        f'!({uuid} in ["GPU-3"])',
    ]
    ann = {"nvidia.com/use-gputype": "v100", "nvidia.com/use-gpuuuid": "GPU-9"}
    _, tpl = apply(pod(ctr("main", {"nvidia.com/gpu": "1"}), annotations=ann))
    exprs = [s["cel"]["expression"] for s in tpl["spec"]["spec"]["devices"]["requests"][0]["exactly"]["selectors"]]
    assert exprs == [f'{model}.contains("V100")', f'{uuid} in ["GPU-9"]']


def test_selectors_match_devices_as_the_annotation_path_does() -> None:
    celpy = pytest.importorskip("celpy")
    sel = Selectors(("V100",), ("M32",), frozenset(), frozenset({"GPU-3"}))
    env = celpy.Environment()
    for model, uuid in [
        ("Tesla-V100-SXM2-16GB", "GPU-1"),
        ("Tesla-V100-SXM2-32GB-M32", "GPU-1"),
        ("T4", "GPU-2"),
        ("V100", "GPU-3"),
    ]:
        device = celpy.json_to_cel({"attributes": {"gpu.crihook.io": {"model": model.upper(), "uuid": uuid}}})
        # cel-python lacks the strings extension's upperAscii(); the model is given upper-cased instead
        ok = all(
            bool(
                env.program(env.compile(s["cel"]["expression"].replace(".upperAscii()", ""))).evaluate(
                    {"device": device}
                )
            )
            for s in selectors(sel)
        )
        assert ok == (sel.refuses(model, uuid) is None), (model, uuid)


def test_what_is_left_alone() -> None:
    assert convert_pod(pod(ctr("main", {"cpu": "1"})), CONFIG) is None
    assert convert_pod(pod(ctr("main", {"nvidia.com/gpu": "1", "koordinator.sh/rdma": "100"})), CONFIG) is None
    claimed = pod(ctr("main", {"nvidia.com/gpu": "1"}), resourceClaims=[{"name": "x", "resourceClaimName": "y"}])
    assert convert_pod(claimed, CONFIG) is None
    assert convert_pod(pod(ctr("main", {"nvidia.com/gpu": "1", "koordinator.sh/gpu-core": "50"})), CONFIG) is None
    assert convert_pod({"spec": "x"}, CONFIG) is None
    assert convert_pod({"metadata": {"name": 3}, "spec": {}}, CONFIG) is None


def test_claims_a_container_has_are_kept_and_templates_named_by_content() -> None:
    c = ctr("main", {"nvidia.com/gpu": "1"})
    c["resources"]["claims"] = [{"name": "other"}]
    got, tpl = apply(pod(c))
    assert got["spec"]["containers"][0]["resources"]["claims"] == [
        {"name": "other"},
        {"name": CLAIM, "request": "main"},
    ]
    _, again = apply(pod(ctr("main", {"nvidia.com/gpu": "1"})))
    assert again == tpl
    spec = tpl["spec"]["spec"]
    assert template_for("elsewhere", spec)["metadata"]["name"] == tpl["metadata"]["name"]
    assert template_for("team", {"devices": {"requests": []}})["metadata"]["name"] != tpl["metadata"]["name"]


FORMS = st.one_of(
    st.integers(1, 4).map(lambda n: {"nvidia.com/gpu": str(n)}),
    st.sampled_from([10, 25, 50, 75]).map(
        lambda p: {
            "koordinator.sh/gpu-core": str(p),
            "koordinator.sh/gpu-memory-ratio": str(p),
            "koordinator.sh/gpu.shared": "1",
        }
    ),
    st.sampled_from([100, 200]).map(lambda p: {"koordinator.sh/gpu": str(p)}),
    st.none(),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(FORMS, min_size=1, max_size=4), st.booleans())
def test_a_converted_pod_asks_the_same_gpus_through_its_claim(forms: list[dict[str, str] | None], init: bool) -> None:
    containers = [ctr(f"c{i}", f) for i, f in enumerate(forms)]
    p = pod(*containers, initContainers=[ctr("setup", {"cpu": "1"})] if init else [])
    try:
        before = parse_request(pod_from_json(p))
    except Exception:
        assert convert_pod(p, CONFIG) is None
        return
    conv = convert_pod(p, CONFIG)
    if not before.count:
        assert conv is None
        return
    assert conv is not None
    got = json_patch(copy.deepcopy(p), conv.ops)
    assert not parse_request(pod_from_json(got)).wants_devices
    requests = {r["name"]: r for r in conv.template["spec"]["spec"]["devices"]["requests"]}
    asked = 0
    for name, r in requests.items():
        sub = r.get("exactly") or r["firstAvailable"][0]
        asked += sub["count"]
        if before.shared:
            assert sub["capacity"]["requests"]["cores"] == str(before.core)
        assert any(
            name == c["request"] for x in got["spec"]["containers"] for c in x.get("resources", {}).get("claims", [])
        )
    assert asked == before.count
    for old, new in zip(p["spec"]["containers"], got["spec"]["containers"], strict=True):
        uses = new.get("resources", {}).get("claims", [])
        assert bool(uses) == any(
            k in (old.get("resources") or {}).get("limits", {})
            for k in ("nvidia.com/gpu", "koordinator.sh/gpu", "koordinator.sh/gpu-core")
        )
        assert all(u["request"] in requests for u in uses)


def test_bound_for_the_pool_by_node_selector() -> None:
    from crihook.scheduler.draconvert import bound_for

    p = pod(ctr("main"), nodeSelector={"pool": "dra", "zone": "a"})
    assert bound_for(p, "pool=dra") and bound_for(p, "pool") and bound_for(p, "zone=a")
    assert not bound_for(p, "pool=other") and not bound_for(p, "gpu") and not bound_for(p, "")
    assert not bound_for(pod(ctr("main")), "pool=dra") and not bound_for({"spec": []}, "pool")
