"""Today's GPU requests as a DRA claim: what the webhook does to a pod bound for crihook's DRA driver.

A pod asks for GPUs the way it always has (`nvidia.com/gpu`, `koordinator.sh/gpu`, `gpu-core` with
`gpu-memory` or `gpu-memory-ratio` and `gpu.shared`, the `nvidia.com/use-gputype`/`use-gpuuuid`
annotations). Bound for a node pool served by crihook's DRA driver (`gpu.crihook.io`), it gets,
without its author rewriting it:
- a ResourceClaimTemplate in its namespace, named after its content (pods asking alike share one):
  one request per container with whole GPUs (the GPUs split per container, as `container-devices`
  does today), or one request for the pod's shares that every share container uses; several whole
  GPUs as crihook's template: `firstAvailable` of one NVLink partition of that size
  (`matchAttribute` on `nvlinkPartition<N>`), one NUMA node, then any; a share as capacity
  (`cores`, `memory`); the model and UUID lists as CEL selectors (the model a case-insensitive
  substring, as HAMi has it);
- `spec.resourceClaims` naming the template, each GPU container's `resources.claims` naming its
  request, and the converted extended resources removed (from limits and requests alike).

A memory ratio becomes bytes of `gpu_memory` (the pool's GPU memory, configured): a claim asks
absolute amounts. Not converted (the pod keeps the annotation path): pods that ask for no GPU, ask
RDMA too, already have claims, ask a memory ratio with no `gpu_memory` configured, or whose request
is invalid (validation then says why). Pure: dicts in, dicts out.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from crihook.base import dra
from crihook.base.allocation import GPU_CORE, GPU_MEMORY, GPU_MEMORY_RATIO, GPU_SHARED, KOORD_GPU, NVIDIA_GPU
from crihook.scheduler.pod import PodError, pod_from_json
from crihook.scheduler.request import PodRequest, RequestError, Selectors, parse_request

API_VERSION = "resource.k8s.io/v1"
CLAIM = "crihook-gpu"  # the pod's name for its claim
SHARES = "gpus"  # the request every share container uses
CONVERTED = (NVIDIA_GPU, KOORD_GPU, GPU_CORE, GPU_MEMORY, GPU_MEMORY_RATIO, GPU_SHARED)
MANAGED_BY = {"app.kubernetes.io/managed-by": "crihook"}


@dataclass(frozen=True, slots=True)
class ConvertConfig:
    device_class: str = dra.DEVICE_CLASS
    gpu_memory: int = 0  # bytes of one GPU of the pool, for memory ratios; 0: ratios are not converted


@dataclass(frozen=True, slots=True)
class Converted:
    template: dict[str, Any]  # the ResourceClaimTemplate, with its namespace and name
    ops: list[dict[str, Any]]  # the JSON patch of the pod


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _quote(text: str) -> str:
    return json.dumps(text)  # a CEL string literal: JSON's escapes are CEL's


def selectors(sel: Selectors, driver: str = dra.DRIVER) -> list[dict[str, Any]]:
    """The pod's model and UUID lists as CEL selectors on the driver's attributes."""
    attrs = f"device.attributes[{_quote(driver)}]"
    model = f"{attrs}.{dra.ATTR_MODEL}.upperAscii()"
    exprs = []
    if sel.use_types:
        exprs.append(" || ".join(f"{model}.contains({_quote(t)})" for t in sel.use_types))
    exprs += [f"!{model}.contains({_quote(t)})" for t in sel.nouse_types]
    uuid = f"{attrs}.{dra.ATTR_UUID}"
    if sel.use_uuids:
        exprs.append(f"{uuid} in [{', '.join(_quote(u) for u in sorted(sel.use_uuids))}]")
    if sel.nouse_uuids:
        exprs.append(f"!({uuid} in [{', '.join(_quote(u) for u in sorted(sel.nouse_uuids))}])")
    return [{"cel": {"expression": e}} for e in exprs]


def _exact(config: ConvertConfig, count: int, sel: list[dict[str, Any]], capacity: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {"deviceClassName": config.device_class, "allocationMode": "ExactCount", "count": count}
    if sel:
        out["selectors"] = sel
    if capacity:
        out["capacity"] = {"requests": dict(capacity)}
    return out


def claim_spec(req: PodRequest, config: ConvertConfig) -> tuple[dict[str, Any], dict[str, str]] | None:
    """The claim's `spec` and, per GPU container, the request it uses; None when not converted."""
    sel = selectors(req.selectors)
    requests: list[dict[str, Any]] = []
    constraints: list[dict[str, Any]] = []
    per: list[tuple[str, int]]
    capacity: dict[str, str] = {}
    if req.shared:
        memory = req.memory or req.ratio * config.gpu_memory // 100
        if not memory:
            return None
        capacity = {dra.CAPACITY_CORES: str(req.core), dra.CAPACITY_MEMORY: str(memory)}
    # whole GPUs asked per container are split per container; otherwise every GPU container sees
    # all of the pod's GPUs (as the annotation path's container-devices has it)
    if not req.shared and all(n > 0 for _, n in req.gpu_containers):
        per = list(req.gpu_containers)
        uses = {name: name for name, _ in per}
    else:
        per = [(SHARES, req.count)]
        uses = {name: SHARES for name, _ in req.gpu_containers}
    for name, n in per:
        if n == 1 or req.shared:
            requests.append({"name": name, "exactly": _exact(config, n, sel, capacity)})
            continue
        subs = [{"name": sub, **_exact(config, n, sel, {})} for sub in ("nvlink", "numa", "any")]
        requests.append({"name": name, "firstAvailable": subs})
        part = f"{dra.DRIVER}/{dra.partition_attribute(n)}"
        constraints.append({"requests": [f"{name}/nvlink"], "matchAttribute": part})
        constraints.append({"requests": [f"{name}/numa"], "matchAttribute": f"{dra.DRIVER}/{dra.ATTR_NUMA_NODE}"})
    devices: dict[str, Any] = {"requests": requests}
    if constraints:
        devices["constraints"] = constraints
    return {"devices": devices}, uses


def template_for(namespace: str, spec: Mapping[str, Any]) -> dict[str, Any]:
    """The ResourceClaimTemplate of a claim spec, named after its content."""
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:12]
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": f"{CLAIM}-{digest}", "namespace": namespace, "labels": dict(MANAGED_BY)},
        "spec": {"spec": spec},
    }


def bound_for(pod: Mapping[str, Any], pool: str) -> bool:
    """Whether the pod's nodeSelector picks the DRA node pool `pool` (`label=value`, or `label` for
    any value)."""
    spec = pod.get("spec")
    chosen = spec.get("nodeSelector") if isinstance(spec, Mapping) else None
    key, eq, value = pool.partition("=")
    if not key or not isinstance(chosen, Mapping) or key not in chosen:
        return False
    return not eq or chosen[key] == value


def convert_pod(pod: Mapping[str, Any], config: ConvertConfig) -> Converted | None:
    """The template and the pod's patch, or None when the pod is not converted (see the module)."""
    spec = pod.get("spec")
    if not isinstance(spec, Mapping) or spec.get("resourceClaims"):
        return None
    try:
        parsed = pod_from_json(pod)
        req = parse_request(parsed)
    except (PodError, RequestError):
        return None
    if not req.count or req.rdma or not req.gpu_containers:
        return None
    got = claim_spec(req, config)
    if got is None:
        return None
    claim, uses = got
    template = template_for(parsed.namespace, claim)
    ops: list[dict[str, Any]] = [
        {
            "op": "add",
            "path": "/spec/resourceClaims",
            "value": [{"name": CLAIM, "resourceClaimTemplateName": template["metadata"]["name"]}],
        }
    ]
    for field in ("initContainers", "containers"):
        for i, c in enumerate(spec.get(field) or ()):
            if not isinstance(c, Mapping):
                continue
            res = c.get("resources") if isinstance(c.get("resources"), Mapping) else {}
            base = f"/spec/{field}/{i}/resources"
            request = uses.get(str(c.get("name")))
            if request is not None and not isinstance(c.get("resources"), Mapping):
                ops.append({"op": "add", "path": base, "value": {}})
            for kind in ("limits", "requests"):
                values = res.get(kind) if isinstance(res, Mapping) else None
                present = values if isinstance(values, Mapping) else {}
                ops += [{"op": "remove", "path": f"{base}/{kind}/{_escape(n)}"} for n in CONVERTED if n in present]
            if request is not None:
                entry = {"name": CLAIM, "request": request}
                claims = res.get("claims") if isinstance(res, Mapping) else None
                if isinstance(claims, list):
                    ops.append({"op": "add", "path": f"{base}/claims/-", "value": entry})
                else:
                    ops.append({"op": "add", "path": f"{base}/claims", "value": [entry]})
    return Converted(template, ops)
