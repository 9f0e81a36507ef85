"""The scheduler's device choice for one container, as the node hooks read it: an annotation
problem becomes the hook error kubelet sees, naming the annotation and the field."""

from __future__ import annotations

import grpc

from crihook import allocation as al
from crihook.hooks.base import ContainerInfo, HookError, PodInfo


def scheduled(pod: PodInfo, container: ContainerInfo, dtype: str) -> tuple[al.DeviceAllocation, ...] | None:
    """See allocation.allocated_to; raises HookError(INVALID_ARGUMENT) for a malformed annotation."""
    try:
        return al.allocated_to(pod.annotations, container.name, dtype)
    except al.AnnotationError as e:
        raise HookError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None


def refuse(code: grpc.StatusCode, cause: str) -> HookError:
    """A refusal about what the allocation annotation asks for."""
    return HookError(code, f"annotation {al.DEVICE_ALLOCATED}: {cause}")
