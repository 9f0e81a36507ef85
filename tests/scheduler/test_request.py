"""Request normalisation and validation (seeds 000, 001), HAMi selectors, partition and joint specs."""

from __future__ import annotations

import json

import pytest

from crihook.scheduler.pod import PodError, pod_from_json
from crihook.scheduler.request import RequestError, Selectors, parse_request


def pod(requests: dict, annotations: dict | None = None, limits: dict | None = None, name: str = "p"):
    res: dict = {"requests": requests}
    if limits:
        res["limits"] = limits
    return pod_from_json(
        {
            "metadata": {"name": name, "namespace": "ns", "uid": "u1", "annotations": annotations or {}},
            "spec": {"containers": [{"name": "main", "resources": res}]},
        }
    )


def req(requests: dict, annotations: dict | None = None):
    return parse_request(pod(requests, annotations))


@pytest.mark.parametrize(
    ("requests", "count", "core", "ratio", "memory"),
    [
        ({"nvidia.com/gpu": "2"}, 2, 100, 100, 0),
        ({"koordinator.sh/gpu": "50"}, 1, 50, 50, 0),
        ({"koordinator.sh/gpu": "200"}, 2, 100, 100, 0),
        (
            {
                "koordinator.sh/gpu-core": "50",
                "koordinator.sh/gpu-memory-ratio": "60",
                "koordinator.sh/gpu.shared": "1",
            },
            1,
            50,
            60,
            0,
        ),
        (
            {"koordinator.sh/gpu-core": "60", "koordinator.sh/gpu-memory": "4Gi", "koordinator.sh/gpu.shared": "1"},
            1,
            60,
            0,
            4 << 30,
        ),
        (
            {"koordinator.sh/gpu-core": "100", "koordinator.sh/gpu-memory": "4Gi", "koordinator.sh/gpu.shared": "2"},
            2,
            50,
            0,
            2 << 30,
        ),
        ({"koordinator.sh/gpu-memory-ratio": "200", "koordinator.sh/gpu.shared": "4"}, 4, 0, 50, 0),
        ({"cpu": "4"}, 0, 0, 0, 0),
    ],
)
def test_accepted_forms_normalise(requests: dict, count: int, core: int, ratio: int, memory: int) -> None:
    r = req(requests)
    assert (r.count, r.core, r.ratio, r.memory) == (count, core, ratio, memory)
    assert r.wants_devices == (count > 0)


@pytest.mark.parametrize(
    ("requests", "words"),
    [
        ({"nvidia.com/gpu": "1", "koordinator.sh/gpu-memory-ratio": "50"}, "can not be combined"),
        (
            {
                "koordinator.sh/gpu-memory": "1Gi",
                "koordinator.sh/gpu-memory-ratio": "50",
                "koordinator.sh/gpu.shared": "1",
            },
            "not both",
        ),
        ({"koordinator.sh/gpu-core": "50"}, "needs koordinator.sh/gpu-memory"),
        ({"koordinator.sh/gpu-core": "50", "koordinator.sh/gpu.shared": "1"}, "needs koordinator.sh/gpu-memory"),
        ({"koordinator.sh/gpu-memory-ratio": "50"}, "need koordinator.sh/gpu.shared"),
        ({"koordinator.sh/gpu.shared": "1"}, "needs koordinator.sh/gpu-memory"),
        ({"koordinator.sh/gpu": "150"}, "multiple of 100"),
        ({"koordinator.sh/gpu-memory-ratio": "150", "koordinator.sh/gpu.shared": "1"}, "multiple of 100"),
        ({"koordinator.sh/gpu-memory-ratio": "200", "koordinator.sh/gpu.shared": "1"}, "one GPU has 100"),
        ({"koordinator.sh/gpu-memory-ratio": "50", "koordinator.sh/gpu.shared": "3"}, "split evenly"),
        ({"koordinator.sh/gpu-memory": "3", "koordinator.sh/gpu.shared": "2"}, "split evenly"),
        ({"koordinator.sh/gpu": "50", "koordinator.sh/gpu-core": "50"}, "already sets core"),
        ({"nvidia.com/gpu": "1.5"}, "whole number"),
        ({"nvidia.com/gpu": "-1"}, "negative"),
        ({"nvidia.com/gpu": "lots"}, "not a Kubernetes quantity"),
        ({"koordinator.sh/rdma": "150"}, "multiple of 100"),
    ],
)
def test_invalid_combinations_are_rejected_with_a_reason(requests: dict, words: str) -> None:
    with pytest.raises(RequestError) as e:
        req(requests)
    assert words in str(e.value)
    assert "ns/p" in str(e.value)


def test_limits_count_when_requests_are_absent_and_init_containers_take_the_max() -> None:
    p = pod_from_json(
        {
            "metadata": {"name": "p", "uid": "u"},
            "spec": {
                "initContainers": [{"name": "init", "resources": {"limits": {"nvidia.com/gpu": 3}}}],
                "containers": [
                    {"name": "a", "resources": {"limits": {"nvidia.com/gpu": 1}}},
                    {"name": "b", "resources": {"limits": {"nvidia.com/gpu": 1}}},
                ],
            },
        }
    )
    r = parse_request(p)
    assert r.count == 3
    assert r.gpu_containers == (("a", 1), ("b", 1), ("init", 3))


def test_selectors_match_type_case_insensitively_as_substring_and_uuid_exactly() -> None:
    r = req(
        {"nvidia.com/gpu": "1"},
        {"nvidia.com/use-gputype": "a100, v100", "nvidia.com/nouse-gpuuuid": "GPU-bad"},
    )
    s = r.selectors
    assert s.refuses("NVIDIA-A100-SXM4", "GPU-1") is None
    assert s.refuses("Tesla V100-SXM2", "GPU-1") is None
    assert "use-gputype" in (s.refuses("T4", "GPU-1") or "")
    assert "nouse-gpuuuid" in (s.refuses("A100", "GPU-bad") or "")
    assert s.refuses("A100", "GPU-bad2") is None  # exact, not substring
    assert Selectors(nouse_types=("T4",)).refuses("nvidia t4", "x")
    assert Selectors(use_uuids=frozenset({"GPU-a"})).refuses("A100", "GPU-ab")


def test_partition_and_joint_specs() -> None:
    r = req(
        {"nvidia.com/gpu": "2"},
        {
            "scheduling.koordinator.sh/gpu-partition-spec": json.dumps(
                {"allocatePolicy": "Restricted", "ringBusBandwidth": "200Gi"}
            ),
            "scheduling.koordinator.sh/device-joint-allocate": '{"deviceTypes":["gpu","rdma"]}',
        },
    )
    assert r.partition is not None and r.partition.restricted and r.partition.bandwidth == 200 << 30
    assert r.joint
    for ann, words in [
        ({"scheduling.koordinator.sh/gpu-partition-spec": '{"allocatePolicy":"Always"}'}, "allocatePolicy"),
        ({"scheduling.koordinator.sh/gpu-partition-spec": "{"}, "not valid JSON"),
        ({"scheduling.koordinator.sh/device-joint-allocate": '{"requiredScope":"SameNUMA"}'}, "requiredScope"),
        ({"gpu.crihook.io/allocate-strategy": "random"}, "allocate-strategy"),
    ]:
        with pytest.raises(RequestError, match=words):
            req({"nvidia.com/gpu": "1"}, ann)


def test_pod_json_errors_name_the_field() -> None:
    with pytest.raises(PodError, match=r"spec.containers\[0\].name"):
        pod_from_json({"metadata": {"name": "x"}, "spec": {"containers": [{}]}})
