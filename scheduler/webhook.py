"""Admission webhook for pods (AdmissionReview v1): seed 001's mutating and validating rules.

Mutating, on CREATE: `koordinator.sh/gpu: X` becomes `gpu-core: X` + `gpu-memory-ratio: X`, and a
container using the share API without `koordinator.sh/gpu.shared` gets one (ratio / 100 when the
ratio is a multiple of 100, else 1). Optionally GPU pods of the default scheduler are switched to ours
(seed 000's upgrade path). Validating: the request must pass the allocator's own normalisation
(`request.parse_request`), so the webhook and the scheduler can never disagree, and only the
scheduler may set the allocation annotations the node hooks trust.

With `dra` set, a GPU pod bound for crihook's DRA driver (through `/mutate-dra`, which the
MutatingWebhookConfiguration sends pods of opted-in namespaces, or with a nodeSelector for the
`dra_pool` label) is turned into a ResourceClaim (scheduler/draconvert.py); `templates` writes its
ResourceClaimTemplate, and a pod whose template could not be written stays on the annotation path.

Pure: dicts in, dicts out (the template writer is given); the HTTP server is in server.py.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from crihook.base import quantity
from crihook.base.allocation import (
    CONTAINER_DEVICES,
    DEVICE_ALLOCATED,
    GPU_CORE,
    GPU_MEMORY,
    GPU_MEMORY_RATIO,
    GPU_SHARED,
    KOORD_GPU,
    NVIDIA_GPU,
)
from crihook.scheduler import draconvert
from crihook.scheduler.pod import PodError, pod_from_json
from crihook.scheduler.request import RequestError, parse_request

log = logging.getLogger("crihook.scheduler")

ADMISSION_API = "admission.k8s.io/v1"
PROTECTED = (DEVICE_ALLOCATED, CONTAINER_DEVICES)
DEFAULT_SCHEDULER = "default-scheduler"
SHARE_NAMES = (GPU_CORE, GPU_MEMORY, GPU_MEMORY_RATIO)


@dataclass(frozen=True, slots=True)
class WebhookConfig:
    # Users allowed to write the allocation annotations: the scheduler's service account.
    scheduler_users: Collection[str] = ("system:serviceaccount:kube-system:crihook-scheduler",)
    # When set, GPU pods that name no scheduler or the default one are given this one.
    scheduler_name: str = ""
    # When set, GPU pods bound for crihook's DRA driver get a ResourceClaim instead (draconvert.py):
    # those /mutate-dra receives, and those whose nodeSelector names `dra_pool` (label=value).
    dra: draconvert.ConvertConfig | None = None
    dra_pool: str = ""
    templates: Callable[[dict[str, Any]], None] | None = None  # writes a ResourceClaimTemplate


class ReviewError(ValueError):
    """The AdmissionReview itself is malformed (answered with HTTP 400, not a denial)."""


def _escape(key: str) -> str:
    """A JSON pointer token (RFC 6901)."""
    return key.replace("~", "~0").replace("/", "~1")


def _positive(resources: Mapping[str, Any], name: str) -> bool:
    """Whether a resource is really requested: the allocator ignores zero and unreadable values
    (the latter it reports), so the webhook must see the same request it does."""
    try:
        return name in resources and quantity.parse(resources[name]) > 0
    except quantity.QuantityError:
        return False


def _shared_for(resources: Mapping[str, Any]) -> str | None:
    """The gpu.shared value seed 001 injects for one container's share request, or None when the
    container does not use the share API in a form the rule covers (validation then explains)."""
    if _positive(resources, GPU_SHARED) or _positive(resources, NVIDIA_GPU):
        return None
    if _positive(resources, GPU_MEMORY_RATIO):
        ratio = quantity.parse(resources[GPU_MEMORY_RATIO])
        whole = ratio % 100 == 0 and ratio == ratio.to_integral_value()
        return str(int(ratio / Decimal(100))) if whole else "1"
    if _positive(resources, GPU_MEMORY):
        return "1"
    return None


def mutate_pod(pod: dict[str, Any], config: WebhookConfig) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The mutated pod and the JSON patch from `pod` to it. `pod` is not changed: the dicts and lists
    on the way to the resources are copied, and `out` shares the rest with it (a deep copy of a whole
    pod cost more than the rest of an admission review)."""
    out, ops = _convert_shares(pod)
    return out, ops + _switch_scheduler(out, config)


def _convert_shares(pod: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """koordinator.sh/gpu and the share API's gpu.shared, as mutate_pod."""
    out = dict(pod)
    ops: list[dict[str, Any]] = []
    spec = out.get("spec")
    if not isinstance(spec, dict):
        return out, ops
    spec = out["spec"] = dict(spec)
    for field in ("initContainers", "containers"):
        containers = spec.get(field)
        if not isinstance(containers, list):
            continue
        containers = spec[field] = list(containers)
        for i, c in enumerate(containers):
            res = c.get("resources") if isinstance(c, dict) else None
            if not isinstance(res, dict):
                continue
            res = dict(res)
            containers[i] = {**c, "resources": res}
            for kind in ("limits", "requests"):
                values = res.get(kind)
                if not isinstance(values, dict):
                    continue
                values = res[kind] = dict(values)
                base = f"/spec/{field}/{i}/resources/{kind}/"
                # koordinator.sh/gpu alone converts; beside core or memory it is left for validation to refuse
                if KOORD_GPU in values and not any(_positive(values, n) for n in SHARE_NAMES):
                    x = values.pop(KOORD_GPU)
                    ops.append({"op": "remove", "path": base + _escape(KOORD_GPU)})
                    for name in (GPU_CORE, GPU_MEMORY_RATIO):
                        values[name] = x
                        ops.append({"op": "add", "path": base + _escape(name), "value": x})
                if KOORD_GPU not in values and (shared := _shared_for(values)) is not None:
                    values[GPU_SHARED] = shared
                    ops.append({"op": "add", "path": base + _escape(GPU_SHARED), "value": shared})
    return out, ops


def _switch_scheduler(pod: dict[str, Any], config: WebhookConfig) -> list[dict[str, Any]]:
    """A GPU pod of the default scheduler handed to `config.scheduler_name` (changes `pod`'s spec,
    which _convert_shares copied)."""
    spec = pod.get("spec")
    if not isinstance(spec, dict) or not config.scheduler_name:
        return []
    if spec.get("schedulerName", DEFAULT_SCHEDULER) not in ("", DEFAULT_SCHEDULER):
        return []
    try:
        wants = parse_request(pod_from_json(pod)).wants_devices
    except (PodError, RequestError):
        wants = False  # validation will say why; do not move an invalid pod to our scheduler
    if not wants:
        return []
    op = "replace" if "schedulerName" in spec else "add"
    spec["schedulerName"] = config.scheduler_name
    return [{"op": op, "path": "/spec/schedulerName", "value": config.scheduler_name}]


def validate_pod(
    operation: str, pod: Mapping[str, Any], old: Mapping[str, Any] | None, user: str, config: WebhookConfig
) -> tuple[int, str] | None:
    """None when allowed, else (HTTP code, message) for the denial."""
    if user not in config.scheduler_users:
        anns = _annotations(pod)
        before = _annotations(old) if old is not None else {}
        for key in PROTECTED:
            if anns.get(key) != before.get(key):
                return 403, (
                    f"annotation {key} is written by the crihook scheduler only; remove it from the pod "
                    f"(user {user or '<unknown>'} may not set or change it)"
                )
    if operation != "CREATE":
        return None  # resource requests are immutable after creation; the annotations were checked above
    try:
        parse_request(pod_from_json(pod))
    except (PodError, RequestError) as e:
        return 400, str(e)
    return None


def _annotations(obj: Mapping[str, Any] | None) -> Mapping[str, Any]:
    meta = (obj or {}).get("metadata") or {}
    anns = meta.get("annotations") if isinstance(meta, dict) else None
    return anns if isinstance(anns, dict) else {}


def _request(review: Any) -> dict[str, Any]:
    if not isinstance(review, dict) or review.get("kind") != "AdmissionReview":
        raise ReviewError("expected an AdmissionReview object")
    if review.get("apiVersion") != ADMISSION_API:
        raise ReviewError(f"AdmissionReview apiVersion {review.get('apiVersion')!r} is not {ADMISSION_API}")
    req = review.get("request")
    if not isinstance(req, dict) or not isinstance(req.get("uid"), str) or not req["uid"]:
        raise ReviewError("AdmissionReview.request.uid is missing")
    return req


def _response(uid: str, allowed: bool, **extra: Any) -> dict[str, Any]:
    return {
        "apiVersion": ADMISSION_API,
        "kind": "AdmissionReview",
        "response": {"uid": uid, "allowed": allowed, **extra},
    }


def _pod_of(req: dict[str, Any], key: str) -> dict[str, Any] | None:
    obj = req.get(key)
    if obj is None:
        return None
    if not isinstance(obj, dict):
        raise ReviewError(f"AdmissionReview.request.{key} is not an object")
    # On CREATE the object may not carry its namespace yet; the request does.
    obj = dict(obj)
    meta = dict(obj.get("metadata") or {})
    if not meta.get("namespace") and req.get("namespace"):
        meta["namespace"] = req["namespace"]
    if not meta.get("name") and req.get("name"):
        meta["name"] = req["name"]
    obj["metadata"] = meta
    return obj


def _is_pod(req: dict[str, Any]) -> bool:
    res = req.get("resource") or {}
    return res.get("group", "") == "" and res.get("resource") == "pods" and not req.get("subResource")


def _to_dra(req: dict[str, Any], pod: dict[str, Any], config: WebhookConfig, dra_all: bool) -> list[dict[str, Any]]:
    """The patch that turns the (mutated) pod's GPUs into a claim, once its template is written."""
    if config.dra is None or not (dra_all or (config.dra_pool and draconvert.bound_for(pod, config.dra_pool))):
        return []
    conv = draconvert.convert_pod(pod, config.dra)
    if conv is None:
        return []
    if config.templates is not None and not req.get("dryRun"):
        try:
            config.templates(conv.template)
        except Exception as e:  # the pod keeps the annotation path rather than wait on a template
            log.warning("ResourceClaimTemplate not written", extra={"pod": req.get("name", ""), "error": str(e)})
            return []
    return conv.ops


def mutate(review: Any, config: WebhookConfig, dra_all: bool = False) -> dict[str, Any]:
    """The AdmissionReview response for the mutating webhook (`dra_all`: the DRA opt-in path)."""
    req = _request(review)
    uid = req["uid"]
    if req.get("operation") != "CREATE" or not _is_pod(req):
        return _response(uid, True)
    pod = _pod_of(req, "object")
    if pod is None:
        raise ReviewError("AdmissionReview.request.object is missing")
    mutated, ops = _convert_shares(pod)
    # a pod turned into a claim asks kube-scheduler's DRA allocator, not crihook's: it stays with its scheduler
    ops += _to_dra(req, mutated, config, dra_all) or _switch_scheduler(mutated, config)
    if not ops:
        return _response(uid, True)
    patch = base64.b64encode(json.dumps(ops, separators=(",", ":")).encode()).decode()
    return _response(uid, True, patchType="JSONPatch", patch=patch)


def validate(review: Any, config: WebhookConfig) -> dict[str, Any]:
    """The AdmissionReview response for the validating webhook."""
    req = _request(review)
    uid = req["uid"]
    op = req.get("operation")
    if op not in ("CREATE", "UPDATE") or not _is_pod(req):
        return _response(uid, True)
    pod = _pod_of(req, "object")
    if pod is None:
        raise ReviewError("AdmissionReview.request.object is missing")
    user = ((req.get("userInfo") or {}).get("username")) or ""
    denial = validate_pod(op, pod, _pod_of(req, "oldObject"), user, config)
    if denial is None:
        return _response(uid, True)
    code, message = denial
    reason = "Forbidden" if code == 403 else "BadRequest"
    return _response(uid, False, status={"code": code, "reason": reason, "message": message})
