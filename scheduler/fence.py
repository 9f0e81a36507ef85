"""The last check of a bind: does the allocation collide with what the API server already holds?

The allocator's state is this replica's memory. After a failover, a pause or a slow watch it can
miss a pod another replica bound, so before writing, a bind lists the node's live pods from the API
server and checks its GPUs against their allocation annotations. Pure: the caller does the listing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from crihook import allocation
from crihook.allocation import DEVICE_ALLOCATED, GPU, GPU_CORE, GPU_MEMORY, GPU_MEMORY_RATIO, DeviceAllocation

FINISHED = ("Succeeded", "Failed")


def _charges(pod: Mapping[str, Any], memory_of: Callable[[int], int]) -> list[tuple[int, int, int]]:
    """(minor, core, memory bytes) of one pod's GPU allocation annotation."""
    text = ((pod.get("metadata") or {}).get("annotations") or {}).get(DEVICE_ALLOCATED)
    if not text:
        return []
    out = []
    for a in allocation.parse_device_allocated(text, (GPU,)).get(GPU, ()):
        mem = a.resources.get(GPU_MEMORY)
        if mem is None:
            mem = a.resources.get(GPU_MEMORY_RATIO, 100) * memory_of(a.minor) // 100
        out.append((a.minor, a.resources.get(GPU_CORE, 100), mem))
    return out


def collision(
    uid: str, gpus: Sequence[DeviceAllocation], node_pods: Iterable[Mapping[str, Any]], memory_of: Callable[[int], int]
) -> str | None:
    """Why `gpus` (the allocation of pod `uid`) can not be added to the node's live pods, or None.
    A GPU's core over 100 % or memory over its size is a collision; so is a whole GPU shared."""
    core: dict[int, int] = {}
    mem: dict[int, int] = {}
    holders: dict[int, list[str]] = {}
    for pod in node_pods:
        meta = pod.get("metadata") or {}
        if meta.get("uid") == uid or (pod.get("status") or {}).get("phase") in FINISHED:
            continue
        try:
            charges = _charges(pod, memory_of)
        except allocation.AnnotationError:
            continue  # the node hook refuses such a pod: it holds nothing
        for minor, c, m in charges:
            core[minor] = core.get(minor, 0) + c
            mem[minor] = mem.get(minor, 0) + m
            holders.setdefault(minor, []).append(f"{meta.get('namespace')}/{meta.get('name')}")
    for g in gpus:
        c, m = g.resources.get(GPU_CORE, 100), g.resources.get(GPU_MEMORY, 0)
        used_c, used_m = core.get(g.minor, 0), mem.get(g.minor, 0)
        if used_c + c > 100 or used_m + m > memory_of(g.minor):
            who = ", ".join(holders.get(g.minor, []))
            return (
                f"GPU {g.minor} is already held by {who} on the API server ({used_c}% core and {used_m} bytes in use)"
            )
    return None
