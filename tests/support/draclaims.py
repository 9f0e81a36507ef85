"""ResourceClaims as the API server holds them after kube-scheduler allocated them (resource.k8s.io/v1),
for tests and benchmarks of the DRA driver."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from crihook.base import dra


def result(
    device: str,
    request: str = "gpu",
    driver: str = dra.DRIVER,
    pool: str = "node-a",
    consumed: Mapping[str, str] | None = None,
    share_id: str = "",
) -> dict[str, Any]:
    r: dict[str, Any] = {"request": request, "driver": driver, "pool": pool, "device": device}
    if consumed:
        r["consumedCapacity"] = dict(consumed)
    if share_id:
        r["shareID"] = share_id
    return r


def claim(
    name: str,
    results: Sequence[Mapping[str, Any]] | None,
    namespace: str = "default",
    pod: tuple[str, str] | None = None,
) -> dict[str, Any]:
    """A claim with these allocation results (None: not allocated), reserved for `pod` (name, UID)."""
    doc: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": dra.DEVICE_CLASS}}]}},
    }
    if results is not None:
        doc["status"] = {"allocation": {"devices": {"results": list(results)}}}
        if pod is not None:
            doc["status"]["reservedFor"] = [{"resource": "pods", "name": pod[0], "uid": pod[1]}]
    return doc


def pod(
    name: str, containers: Mapping[str, Sequence[str]], claims: Mapping[str, str], namespace: str = "default"
) -> dict[str, Any]:
    """A pod whose containers (name -> the pod's claim names they use) hold claims made from templates:
    `claims` maps the pod's claim name to the ResourceClaim's name, as status.resourceClaimStatuses says."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "resourceClaims": [{"name": n, "resourceClaimTemplateName": "t"} for n in claims],
            "containers": [
                {"name": c, "image": "x", "resources": {"claims": [{"name": n} for n in used]}}
                for c, used in containers.items()
            ],
        },
        "status": {"resourceClaimStatuses": [{"name": n, "resourceClaimName": r} for n, r in claims.items()]},
    }
