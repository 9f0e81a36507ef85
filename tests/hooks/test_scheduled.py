"""The scheduler's choice as the node hooks read it: parsed once per pod, errors per container."""

from __future__ import annotations

import grpc
import pytest

from crihook.base import allocation as al
from crihook.hooks import scheduled as sched
from crihook.hooks.base import ContainerInfo, HookError, PodInfo


def pod(allocated: str, per_container: str | None = None) -> PodInfo:
    annotations = {al.DEVICE_ALLOCATED: allocated}
    if per_container is not None:
        annotations[al.CONTAINER_DEVICES] = per_container
    return PodInfo(name="p", namespace="ns", uid="u", annotations=annotations)


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The annotation texts parsed, in order (the module's answers start empty)."""
    seen: list[str] = []
    real = al.pod_devices

    def counting(annotations: dict[str, str], dtype: str) -> al.PodDevices:
        seen.append(annotations[al.DEVICE_ALLOCATED])
        return real(annotations, dtype)

    monkeypatch.setattr(sched, "_pods", {})
    monkeypatch.setattr(al, "pod_devices", counting)
    return seen


def test_a_pods_containers_share_one_parse_and_prime_does_it_first(parses: list[str]) -> None:
    text = '{"gpu":[{"minor":0},{"minor":1}]}'
    p = pod(text, '{"a":{"gpu":[0]},"b":{"gpu":[1]}}')
    sched.prime(p, al.GPU)
    assert parses == [text]
    assert [a.minor for a in sched.scheduled(p, ContainerInfo(name="a"), al.GPU) or ()] == [0]
    assert [a.minor for a in sched.scheduled(p, ContainerInfo(name="b"), al.GPU) or ()] == [1]
    assert sched.scheduled(p, ContainerInfo(name="c"), al.GPU) == ()  # listed nowhere: none of them
    assert parses == [text]


def test_a_malformed_annotation_fails_every_container_naming_the_field(parses: list[str]) -> None:
    p = pod('{"gpu":[{"minor":"zero"}]}')
    sched.prime(p, al.GPU)  # kept, not raised: there is no call to refuse yet
    for name in ("a", "b"):
        with pytest.raises(HookError) as err:
            sched.scheduled(p, ContainerInfo(name=name), al.GPU)
        assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT and "gpu[0].minor" in err.value.reason
    assert len(parses) == 1


def test_a_minor_the_pod_was_not_given_fails_only_the_container_listing_it(parses: list[str]) -> None:
    p = pod('{"gpu":[{"minor":0}]}', '{"a":{"gpu":[0]},"b":{"gpu":[3]}}')
    assert [a.minor for a in sched.scheduled(p, ContainerInfo(name="a"), al.GPU) or ()] == [0]
    with pytest.raises(HookError, match=r"b\.gpu\[0\].*minor 3 is not among"):
        sched.scheduled(p, ContainerInfo(name="b"), al.GPU)
