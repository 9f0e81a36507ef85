"""The scheduler's device choice for one container, as the node hooks read it: an annotation
problem becomes the hook error kubelet sees, naming the annotation and the field."""

from __future__ import annotations

from collections.abc import Mapping

import grpc

from crihook.base import allocation as al
from crihook.hooks.base import ContainerInfo, HookError, PodInfo

# parsed by annotation text, for every container of the pod; str: the annotation error
_pods: dict[tuple[str | None, str | None, str], al.PodDevices | str] = {}
_MAX_PODS = 4096


def _pod_devices(annotations: Mapping[str, str], dtype: str) -> al.PodDevices | str:
    key = (annotations.get(al.DEVICE_ALLOCATED), annotations.get(al.CONTAINER_DEVICES), dtype)
    answer = _pods.get(key)
    if answer is None:
        try:
            answer = al.pod_devices(annotations, dtype)
        except al.AnnotationError as e:
            answer = str(e)
        if len(_pods) >= _MAX_PODS:
            _pods.clear()
        _pods[key] = answer
    return answer


def scheduled(pod: PodInfo, container: ContainerInfo, dtype: str) -> tuple[al.DeviceAllocation, ...] | None:
    """See allocation.allocated_to; raises HookError(INVALID_ARGUMENT) for a malformed annotation.
    The annotations are parsed once per text (DeviceAllocation is frozen, so sharing it is safe):
    a pod's containers carry the same text, and `prime` parses it before the first of them."""
    answer = _pod_devices(pod.annotations, dtype)
    if isinstance(answer, str):
        raise HookError(grpc.StatusCode.INVALID_ARGUMENT, answer)
    try:
        return answer.for_container(container.name)
    except al.AnnotationError as e:
        raise HookError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None


def prime(pod: PodInfo, dtype: str) -> al.PodDevices | None:
    """Parse a pod's annotations now, when its sandbox has started, so that its CreateContainers,
    which kubelet sends once the image is pulled, do not wait for it; an error is kept for them
    (and None returned)."""
    answer = _pod_devices(pod.annotations, dtype)
    return None if isinstance(answer, str) else answer


def refuse(code: grpc.StatusCode, cause: str) -> HookError:
    """A refusal about what the allocation annotation asks for."""
    return HookError(code, f"annotation {al.DEVICE_ALLOCATED}: {cause}")
