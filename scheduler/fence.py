"""The last check of a bind: does the allocation collide with what the API server holds?

The allocator's state is this replica's memory. After a failover, a pause or a slow watch it can
miss a pod another replica bound, or one another replica is binding right now. So a bind first
writes its claim on the API server (the allocation annotations and the label CLAIM_LABEL naming the
node, on its own still unbound pod, with the pod's resourceVersion as precondition), then lists
every pod claiming that node, bound or not, and judges: a bound pod on its GPUs refuses the bind; an
unbound claim in the way (another replica's bind in flight, or one that failed) is cleared, which
changes that pod's resourceVersion so its own Binding, made with the claim's resourceVersion as
precondition, fails with 409. Of two binds that claim one GPU, the later claimer's list always sees
the earlier claim, so they can never both be bound, whatever the timing. The GPUs allocated
ResourceClaims hold are re-checked the same way: the claims the node's pods use, read at the bind,
refuse a GPU this replica's watches had not yet seen held (`held_by_claims`). Pure: the caller does
the API calls.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from crihook.base import allocation
from crihook.base.allocation import DEVICE_ALLOCATED, GPU, GPU_CORE, GPU_MEMORY, GPU_MEMORY_RATIO, DeviceAllocation

FINISHED = ("Succeeded", "Failed")
CLAIM_LABEL = "gpu.crihook.io/node"


def claim_value(node: str) -> str:
    """The node name as a label value: label values stop at 63 characters and node names do not,
    so a longer name keeps its head and gains a hash of the whole."""
    if len(node) <= 63:
        return node
    return f"{node[:46].rstrip('.-')}-{hashlib.sha256(node.encode()).hexdigest()[:16]}"


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


def judge(
    uid: str, gpus: Sequence[DeviceAllocation], claims: Sequence[Mapping[str, Any]], memory_of: Callable[[int], int]
) -> tuple[str | None, list[Mapping[str, Any]]]:
    """(why the bind must be refused, or None; the unbound claims to clear first). `claims` are the
    node's pods carrying the claim label, this pod's own claim included."""
    others = [p for p in claims if (p.get("metadata") or {}).get("uid") != uid]
    bound = [p for p in others if (p.get("spec") or {}).get("nodeName")]
    why = collision(uid, gpus, bound, memory_of)
    if why:
        return why, []
    unbound = [p for p in others if not (p.get("spec") or {}).get("nodeName")]
    over = {g.minor for g in gpus if collision(uid, [g], [*bound, *unbound], memory_of)}
    in_way = []
    for p in unbound:
        try:
            minors = {m for m, _, _ in _charges(p, memory_of)}
        except allocation.AnnotationError:
            continue
        if minors & over:
            in_way.append(p)
    return None, in_way


def held_by_claims(gpus: Sequence[DeviceAllocation], held: Mapping[int, Sequence[str]]) -> str | None:
    """Why `gpus` can not be given out: the first that a ResourceClaim holds on the API server
    (`held`: minor -> the claims holding it, claims.held_on), or None."""
    for g in gpus:
        if held.get(g.minor):
            return f"GPU {g.minor} is held by ResourceClaim {', '.join(held[g.minor])} on the API server"
    return None
