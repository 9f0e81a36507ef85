"""Pods and what the chart's admission webhooks must do with them: which pods the API server sends
to each webhook (its matchConditions) and, for those it sends, what crihook answers.

The table serves two checks: tests/deploy/test_webhook_match.py evaluates the rendered CEL
expressions on each case with a CEL interpreter, and a test on a real API server can create each
pod and see which webhook was called. `expected` is (sent to the mutating webhook, sent to the
validating one).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from crihook.base.allocation import CONTAINER_DEVICES, DEVICE_ALLOCATED
from crihook.scheduler.request import DEVICE_RESOURCES

OPT_OUT = "gpu.crihook.io/webhook"  # the chart's opt-out label, "off"
SCHEDULER_ALLOCATION = '{"gpu":[{"minor":0,"resources":{"koordinator.sh/gpu-core":"100"}}]}'


def pod(
    name: str,
    limits: dict[str, str] | None = None,
    requests: dict[str, str] | None = None,
    init: dict[str, str] | None = None,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A pod as admission sees it: one container (with these limits and requests), and an init
    container when `init` (its limits) is given."""
    resources: dict[str, Any] = {}
    if limits:
        resources["limits"] = limits
    if requests:
        resources["requests"] = requests
    spec: dict[str, Any] = {"containers": [{"name": "main", "image": "busybox", "resources": resources}]}
    if init is not None:
        spec["initContainers"] = [{"name": "setup", "image": "busybox", "resources": {"limits": init}}]
    meta: dict[str, Any] = {"name": name, "namespace": "team"}
    if labels:
        meta["labels"] = labels
    if annotations:
        meta["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


@dataclass(frozen=True)
class Case:
    name: str
    object: dict[str, Any]
    expected: tuple[bool, bool]  # (mutating called, validating called)
    old: dict[str, Any] | None = None  # an UPDATE's pod before
    operation: str = "CREATE"


def _updated(before: dict[str, Any], **annotations: str | None) -> dict[str, Any]:
    after = copy.deepcopy(before)
    anns = after["metadata"].setdefault("annotations", {})
    for k, v in annotations.items():
        if v is None:
            anns.pop(k, None)
        else:
            anns[k] = v
    return after


def cases() -> list[Case]:
    out = [
        Case("plain", pod("plain", limits={"cpu": "1", "memory": "1Gi"}), (False, False)),
        Case("no-resources", pod("bare"), (False, False)),
        Case("hugepages", pod("huge", limits={"hugepages-2Mi": "2Mi", "example.com/fpga": "1"}), (False, False)),
        Case("gpu-init-only", pod("init", init={"nvidia.com/gpu": "1"}), (True, True)),
        Case("opted-out", pod("out", limits={"nvidia.com/gpu": "1"}, labels={OPT_OUT: "off"}), (False, False)),
        Case("opt-out-other-value", pod("on", limits={"nvidia.com/gpu": "1"}, labels={OPT_OUT: "on"}), (True, True)),
        Case(
            "forged-allocation",
            pod("forged", limits={"cpu": "1"}, annotations={DEVICE_ALLOCATED: SCHEDULER_ALLOCATION}),
            (False, True),
        ),
        Case(
            "forged-container-devices-opted-out",
            pod("forged2", labels={OPT_OUT: "off"}, annotations={CONTAINER_DEVICES: "{}"}),
            (False, True),
        ),
        Case(
            "opted-out-gpu-pod-with-allocation",
            pod("out2", limits={"nvidia.com/gpu": "1"}, labels={OPT_OUT: "off"}, annotations={DEVICE_ALLOCATED: "x"}),
            (False, True),
        ),
    ]
    for r in DEVICE_RESOURCES:
        out.append(Case(f"limits-{r}", pod("dev", limits={r: "1"}), (True, True)))
        out.append(Case(f"requests-{r}", pod("dev", requests={r: "1"}), (True, True)))
    plain = pod("plain", limits={"cpu": "1"}, labels={"app": "web"})
    out.append(Case("update-plain", _updated(plain, note="x"), (False, False), old=plain, operation="UPDATE"))
    gpu = pod("gpu", limits={"nvidia.com/gpu": "1"})
    out.append(Case("update-gpu", _updated(gpu, note="x"), (False, True), old=gpu, operation="UPDATE"))
    allocated = _updated(plain, **{DEVICE_ALLOCATED: SCHEDULER_ALLOCATION})
    # taking an allocation off, or changing it, is the scheduler's alone as well
    out.append(
        Case(
            "update-drops-allocation",
            _updated(allocated, **{DEVICE_ALLOCATED: None}),
            (False, True),
            old=allocated,
            operation="UPDATE",
        )
    )
    out.append(Case("update-adds-allocation", allocated, (False, True), old=plain, operation="UPDATE"))
    return out
