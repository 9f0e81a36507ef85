"""The scheduler's device choice for one container, as the node hooks read it: an annotation
problem becomes the hook error kubelet sees, naming the annotation and the field."""

from __future__ import annotations

import grpc

from crihook.base import allocation as al
from crihook.hooks.base import ContainerInfo, HookError, PodInfo

_Answer = tuple[al.DeviceAllocation, ...] | None | str  # str: the annotation error
_answers: dict[tuple[str | None, str | None, str, str], _Answer] = {}
_MAX_ANSWERS = 4096


def scheduled(pod: PodInfo, container: ContainerInfo, dtype: str) -> tuple[al.DeviceAllocation, ...] | None:
    """See allocation.allocated_to; raises HookError(INVALID_ARGUMENT) for a malformed annotation.
    Answers are kept by annotation text: every hook of a CreateContainer asks, and the same pod's
    containers carry the same text (DeviceAllocation is frozen, so sharing it is safe)."""
    key = (pod.annotations.get(al.DEVICE_ALLOCATED), pod.annotations.get(al.CONTAINER_DEVICES), container.name, dtype)
    if key in _answers:
        answer = _answers[key]
    else:
        try:
            answer = al.allocated_to(pod.annotations, container.name, dtype)
        except al.AnnotationError as e:
            answer = str(e)
        if len(_answers) >= _MAX_ANSWERS:
            _answers.clear()
        _answers[key] = answer
    if isinstance(answer, str):
        raise HookError(grpc.StatusCode.INVALID_ARGUMENT, answer)
    return answer


def refuse(code: grpc.StatusCode, cause: str) -> HookError:
    """A refusal about what the allocation annotation asks for."""
    return HookError(code, f"annotation {al.DEVICE_ALLOCATED}: {cause}")
