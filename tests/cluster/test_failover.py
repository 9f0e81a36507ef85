"""The scheduler's failover on the one-node cluster, with two replicas: the release upgraded to
`scheduler.replicas: 2`, beside the suite's `scheduler.antiAffinity: preferred`, as a user of a
one-node cluster sets them (docs/helm.md). The leader's pod deleted, as a drain or `kubectl delete`
does, while pods are created without a pause: every create is answered as the webhooks answer it (a
GPU pod admitted and converted, an invalid one refused, a pod without GPUs admitted), none fails on
a webhook that does not answer, and the other replica takes the lead. The leader's pod force-deleted
in the middle of a burst of 50 GPU-share pods: every pod is bound, once, no GPU is given out beyond
its whole (the allocation annotations of the bound pods, read back from the API server, against the
Device's 8 GPUs), and the pods created after the kill are admitted as before."""

from __future__ import annotations

import itertools
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from kubernetes.client import CoordinationV1Api
from kubernetes.client.exceptions import ApiException

from crihook.base.allocation import DEVICE_ALLOCATED, GPU, GPU_CORE, GPU_MEMORY_RATIO, KOORD_GPU, parse_device_allocated
from tests.support.cluster import NODE_NAME, Cluster, ClusterError, eventually
from tests.support.clusterchart import NAMESPACE, RELEASE, upgrade, user_values
from tests.support.containerd import BUSYBOX_IMAGE

pytestmark = pytest.mark.cluster

NS = "default"
SCHEDULER = "app.kubernetes.io/component=scheduler"
LEADER_LABEL = "scheduler.crihook.io/leader"
TEST_LABEL = "crihook-test"
TAKEOVER = 90.0  # seconds: lease duration, state rebuild and a replacement pod, on a loaded machine


def pod(name: str, limits: dict[str, str], group: str, scheduler: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": 0,
        "containers": [
            {
                "name": "main",
                "image": BUSYBOX_IMAGE,
                "imagePullPolicy": "Never",
                "command": ["sleep", "3600"],
                "resources": {"limits": limits},
            }
        ],
    }
    if scheduler is not None:
        spec["schedulerName"] = scheduler
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {TEST_LABEL: group}}, "spec": spec}


def ready(p: Any) -> bool:
    statuses = p.status.container_statuses or []
    return p.metadata.deletion_timestamp is None and bool(statuses) and all(s.ready for s in statuses)


def replicas(cluster: Cluster) -> tuple[list[str], str | None]:
    """The Ready scheduler pods (not terminating), and the one that carries the leader label among
    them (None unless exactly one does)."""
    pods = [p for p in cluster.core().list_namespaced_pod(NAMESPACE, label_selector=SCHEDULER).items if ready(p)]
    leaders = [p.metadata.name for p in pods if (p.metadata.labels or {}).get(LEADER_LABEL) == "true"]
    return sorted(p.metadata.name for p in pods), leaders[0] if len(leaders) == 1 else None


def exists(cluster: Cluster, name: str) -> bool:
    return bool(cluster.core().list_namespaced_pod(NAMESPACE, field_selector=f"metadata.name={name}").items)


def wait_replicas(cluster: Cluster, count: int, not_leading: str = "") -> tuple[list[str], str]:
    """Until `count` replicas are Ready and one of them, not `not_leading`, leads."""
    got = eventually(
        lambda: replicas(cluster),
        count,
        TAKEOVER,
        compare=lambda got, want: len(got[0]) == want and got[1] is not None and got[1] != not_leading,
    )
    names, leader = got
    if len(names) != count or leader is None or leader == not_leading:
        raise ClusterError(f"wanted {count} Ready scheduler replicas and a new leader, got {got}\n{said(cluster)}")
    return names, leader


def said(cluster: Cluster) -> str:
    """The Lease and what each scheduler replica logged last, for a failure's message."""
    core = cluster.core()
    lease = CoordinationV1Api(cluster.api()).read_namespaced_lease(f"{RELEASE}-scheduler", NAMESPACE).spec
    out = [f"lease: {lease}"]
    for p in core.list_namespaced_pod(NAMESPACE, label_selector=SCHEDULER).items:
        log = core.read_namespaced_pod_log(p.metadata.name, NAMESPACE, tail_lines=40)
        out.append(f"--- {p.metadata.name} {p.metadata.labels} {p.metadata.deletion_timestamp}\n{log}")
    return "\n".join(out)


@pytest.fixture
def two_replicas(installed: Cluster) -> Iterator[Cluster]:
    """The release with two scheduler replicas on the one node, then back to the user's values."""
    values = user_values(installed)
    values["scheduler"] = {**values["scheduler"], "replicas": 2}
    upgrade(installed, values)
    try:
        wait_replicas(installed, 2)
        yield installed
    finally:
        core = installed.core()
        core.delete_collection_namespaced_pod(NS, label_selector=TEST_LABEL, grace_period_seconds=0)
        upgrade(installed, user_values(installed))
        installed.wait_pods_gone(NS, TEST_LABEL, timeout=240)
        wait_replicas(installed, 1)


# -- the webhooks answer while the leader goes ----------------------------------------------------


@dataclass(frozen=True)
class Created:
    kind: str
    name: str
    wrong: str  # "" when the API server answered as the webhooks should


def answered_as_expected(kind: str, made: Any, refused: ApiException | None) -> str:
    """What is wrong with the API server's answer to one create of `kind`; "" when nothing."""
    if kind == "invalid":  # gpu-core without memory: the validating webhook refuses it
        if refused is not None and refused.status == 400 and "denied the request" in str(refused.body):
            return ""
        return f"wanted a denial, got {refused.status if refused else 'created'}: {refused.body if refused else ''}"
    if refused is not None:
        return f"refused with {refused.status}: {refused.body}"
    if kind == "shared":  # the mutating webhook turned koordinator.sh/gpu into core and memory
        limits = made.spec.containers[0].resources.limits
        if limits.get(GPU_CORE) != "10" or limits.get(GPU_MEMORY_RATIO) != "10":
            return f"admitted unconverted: {limits}"
    return ""


CHURN = {
    "shared": {KOORD_GPU: "10"},
    "invalid": {GPU_CORE: "10"},
    "plain": {"cpu": "10m"},  # no GPU: the webhooks never see it
}


def churn(cluster: Cluster, stop: threading.Event, log: list[Created]) -> None:
    """Create pods of each kind in turn until `stop`; no scheduler binds them (schedulerName)."""
    core = cluster.core()
    for i in itertools.count():
        if stop.is_set():
            return
        kind = list(CHURN)[i % len(CHURN)]
        name = f"churn-{i}"
        made, refused = None, None
        try:
            made = core.create_namespaced_pod(NS, pod(name, CHURN[kind], "churn", scheduler="nobody"))
        except ApiException as e:
            refused = e
        log.append(Created(kind, name, answered_as_expected(kind, made, refused)))
        stop.wait(0.1)  # a steady rate, not a synchronisation: every answer is checked


def test_the_webhooks_answer_while_the_leader_is_deleted(two_replicas: Cluster) -> None:
    cluster = two_replicas
    (first, second), leader = wait_replicas(cluster, 2)
    standby = second if leader == first else first
    log: list[Created] = []
    stop = threading.Event()
    creator = threading.Thread(target=churn, args=(cluster, stop, log), daemon=True)
    creator.start()
    try:

        def made_at_least(n: int) -> None:
            if eventually(lambda: len(log), n, 60, compare=lambda got, want: got >= want) < n:
                raise ClusterError(f"{len(log)} creates answered in 60 s")

        made_at_least(6)
        cluster.core().delete_namespaced_pod(leader, NAMESPACE)  # graceful, as a drain's eviction
        _, new_leader = wait_replicas(cluster, 2, not_leading=leader)  # a replacement pod joins too
        gone = eventually(lambda: exists(cluster, leader), False, TAKEOVER)  # its process has ended
        assert not gone, f"{leader} still there {TAKEOVER} s after its deletion"
        made_at_least(len(log) + 6)
    finally:
        stop.set()
        creator.join(60)
    assert new_leader == standby
    assert {c.kind for c in log} == set(CHURN)
    wrong = [c for c in log if c.wrong]
    assert not wrong, f"{len(wrong)} of {len(log)} creates answered wrongly: {wrong[:5]}"


# -- a burst of GPU pods while the leader is killed -----------------------------------------------

BURST = 50
KILL_AFTER = 20  # pods created before the kill; the rest after it
SHARES = [25 if i % 5 == 0 else 10 for i in range(BURST)]  # 10 pods of 25 % and 40 of 10 %: 6.5 GPUs of 8


def overcommitted(pods: list[Any]) -> list[str]:
    """Per GPU minor, core and memory given to the bound pods beyond 100 %."""
    core: dict[int, int] = defaultdict(int)
    memory: dict[int, int] = defaultdict(int)
    for p in pods:
        for a in parse_device_allocated(p.metadata.annotations[DEVICE_ALLOCATED], [GPU]).get(GPU, ()):
            core[a.minor] += a.resources.get(GPU_CORE, 0)
            memory[a.minor] += a.resources.get(GPU_MEMORY_RATIO, 0)
    return [f"GPU {m}: core {core[m]} %, memory {memory[m]} %" for m in core if core[m] > 100 or memory[m] > 100]


def test_a_burst_of_gpu_pods_survives_the_leaders_kill(two_replicas: Cluster) -> None:
    cluster = two_replicas
    core = cluster.core()
    device = cluster.device(NODE_NAME)
    assert device is not None
    minors = {d["minor"] for d in device["spec"]["devices"] if d["type"] == GPU}
    assert len(minors) == 8
    _, leader = wait_replicas(cluster, 2)
    killed = threading.Event()
    errors: list[str] = []

    def create() -> None:
        for i, share in enumerate(SHARES):
            if i == KILL_AFTER and not killed.wait(TAKEOVER):
                errors.append("the leader was not killed")
                return
            try:
                made = core.create_namespaced_pod(NS, pod(f"burst-{i}", {KOORD_GPU: str(share)}, "burst"))
            except ApiException as e:
                errors.append(f"burst-{i}: {e.status} {e.body}")
                continue
            if made.spec.scheduler_name != "crihook":  # the webhook hands GPU pods to the chart's scheduler
                errors.append(f"burst-{i} left to {made.spec.scheduler_name}")

    def burst() -> list[Any]:
        return list(core.list_namespaced_pod(NS, label_selector=f"{TEST_LABEL}=burst").items)

    def bound() -> int:
        return sum(1 for p in burst() if p.spec.node_name)

    creator = threading.Thread(target=create, daemon=True)
    started = time.monotonic()
    creator.start()
    try:
        if eventually(bound, 5, 120, compare=lambda got, want: got >= want) < 5:
            raise ClusterError(f"{bound()} of the burst bound before the kill\n{cluster.logs()}")
        core.delete_namespaced_pod(leader, NAMESPACE, grace_period_seconds=0)  # kubectl delete --force
        killed.set()
        wait_replicas(cluster, 2, not_leading=leader)
        creator.join(120)
        assert not creator.is_alive() and not errors, errors
        eventually(bound, BURST, 300 - (time.monotonic() - started), compare=lambda got, want: got >= want)
    finally:
        killed.set()
        creator.join(60)
    pods = burst()
    unbound = [p.metadata.name for p in pods if not p.spec.node_name]
    assert len(pods) == BURST and not unbound, f"{len(unbound)} not bound: {unbound[:10]}"
    assert {p.spec.node_name for p in pods} == {NODE_NAME}
    given = [p for p in pods if DEVICE_ALLOCATED in (p.metadata.annotations or {})]
    assert len(given) == BURST, f"{BURST - len(given)} bound without an allocation"
    for p in given:
        (a,) = parse_device_allocated(p.metadata.annotations[DEVICE_ALLOCATED], [GPU])[GPU]
        assert a.minor in minors
    assert not overcommitted(pods)
