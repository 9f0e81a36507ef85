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


def claim(name: str, results: Sequence[Mapping[str, Any]] | None, namespace: str = "default") -> dict[str, Any]:
    """A claim with these allocation results (None: not allocated)."""
    doc: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": dra.DEVICE_CLASS}}]}},
    }
    if results is not None:
        doc["status"] = {"allocation": {"devices": {"results": list(results)}}}
    return doc
