"""Several `crihook scheduler` replicas, one in charge (docs/scheduler.md, "Leadership").

The replica holding the Lease (scheduler/leader.py) serves: each time it becomes leader it starts
a term with a fresh allocator and cluster cache, listed from the API server, and answers /readyz
ready only once those lists are in. Then it labels its own pod (`LEADER_LABEL`) and takes the label
off any other: the leader's Service selects on it, so kube-scheduler's calls go to the leader alone
while every replica that serves is Ready; the webhooks, which keep no state, have a Service of their
own selecting every Ready replica. (Readiness tied to leadership left
one Ready pod, and a PodDisruptionBudget that can never let the leader's node drain.) The others'
verbs refuse (filter and bind answer an Error, kube-scheduler retries the pod). A leader that loses
the Lease ends its term, takes its label off and forgets its reservations; if it leads again it
rebuilds from the API server like any new leader.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable
from typing import Any

from kubernetes import client

from crihook.base import metrics
from crihook.scheduler.cache import ClusterCache, json_body
from crihook.scheduler.extender import Extender
from crihook.scheduler.leader import Elector, KubeLeaseApi, LeaseTiming
from crihook.scheduler.plugin import DeviceShare

log = logging.getLogger("crihook.scheduler")

DEFAULT_LEASE = "crihook-scheduler"
LEADER_LABEL = "scheduler.crihook.io/leader"  # on the leader's pod; the leader's Service selects it
LABEL_TIMEOUT = 5.0  # seconds for each label call: a term's end, SIGTERM's among them, waits on it
LABEL_RETRY = 1.0  # seconds before a leader tries again to label its pod


class LeaderLabel:
    """The label on the pod of the replica in charge (the way Patroni marks its primary). The
    scheduler already patches pods (its claims), so this asks for no new permission. Failures are
    logged, not raised: a leader whose label did not stick tries again (`Replica`), and the next
    leader's `claim` takes a stale label off."""

    def __init__(self, api_client: Any, namespace: str, name: str) -> None:
        self.core = client.CoreV1Api(api_client)
        self.namespace = namespace
        self.name = name

    def claim(self) -> bool:
        """Label this pod, then take the label off every other pod that still has it (a leader that
        died or lost the API server before it could). False: this pod's label was not written."""
        if not self._set(self.name, "true"):
            return False
        log.info("leader label on this pod", extra={"pod": f"{self.namespace}/{self.name}"})
        try:
            answer = self.core.list_namespaced_pod(
                self.namespace, label_selector=LEADER_LABEL, _preload_content=False, _request_timeout=LABEL_TIMEOUT
            )
            others = [p["metadata"]["name"] for p in json_body(answer).get("items") or []]
        except Exception as e:
            log.warning("could not list the pods labelled leader", extra={"error": str(e)})
            return True
        for name in others:
            if name != self.name:
                self._set(name, None)
        return True

    def drop(self) -> None:
        self._set(self.name, None)

    def _set(self, pod: str, value: str | None) -> bool:
        try:
            body = {"metadata": {"labels": {LEADER_LABEL: value}}}
            self.core.patch_namespaced_pod(
                pod, self.namespace, body, _preload_content=False, _request_timeout=LABEL_TIMEOUT
            )
        except Exception as e:
            log.warning(
                "leader label not written", extra={"pod": f"{self.namespace}/{pod}", "value": value, "error": str(e)}
            )
            return False
        return True


class Replica:
    """The terms of one replica. Without an elector (`--no-leader-elect`) one term runs from start.

    With `freeze_heap`, what a term has listed is moved out of the garbage collector's sight once
    the lists are in (gc.freeze): a full collection walked every object of it, the parsed Device
    objects of every node among them, and stopped the extender's verbs for it (97-119 ms at 5,000
    nodes, in cluster_bench). JSON has no cycles, so those objects are still freed when the cache
    drops them; the term's end gives the rest back to the collector."""

    def __init__(
        self,
        api_client: Any,
        extender: Extender,
        new_plugin: Callable[[], DeviceShare],
        elector: Elector | None = None,
        freeze_heap: bool = False,
        label: LeaderLabel | None = None,
    ) -> None:
        self.api_client = api_client
        self.extender = extender
        self.new_plugin = new_plugin
        self.elector = elector
        self.freeze_heap = freeze_heap
        self.label = label
        self.cache: ClusterCache | None = None
        self._labelled: ClusterCache | None = None  # the term whose label is on the pod
        self._guard = threading.Lock()
        # label writes one at a time: a term's claim still under way on the cache's thread when the
        # term ends would otherwise land after the end's drop and leave a stopped replica labelled
        self._label_lock = threading.Lock()
        extender.ready = self.ready
        extender.may_write = self.may_write
        extender.resync_claims = self._resync_claims
        if elector is not None:
            elector.on_start, elector.on_stop = self._begin, self._end

    def may_write(self) -> bool:
        return self.elector is None or self.elector.may_write()

    def ready(self) -> bool:
        cache = self.cache
        return cache is not None and cache.ready() and self.may_write()

    def _resync_claims(self) -> None:
        cache = self.cache
        if cache is not None:
            cache.resync_claims()

    def start(self) -> None:
        if self.elector is None:
            self._begin()
        else:
            self.elector.start()

    def stop(self) -> None:
        if self.elector is None:
            self._end()
        else:
            self.elector.stop()  # ends the term, then releases the Lease

    def _begin(self) -> None:
        plugin = self.new_plugin()
        cache = ClusterCache(self.api_client, plugin, self.extender.lock)
        cache.settled = lambda: self._settled(cache)
        with self.extender.lock:
            self.extender.plugin = plugin
            self.extender.priorities = cache.priorities
            self.extender.claim_asks = cache.claim_asks
        with self._guard:
            self.cache = cache
        cache.start()
        metrics.SCHEDULER_LEADER.set(1)
        log.info("term started: rebuilding the cluster state from the API server")

    def _end(self) -> None:
        with self._guard:
            cache, self.cache = self.cache, None
        metrics.SCHEDULER_LEADER.set(0)
        if cache is not None:
            cache.stop()
            log.info("term ended")
        if self.label is not None and cache is not None:  # also after a claim that failed late
            with self._label_lock:
                self._labelled = None
                self.label.drop()
        if self.freeze_heap:
            gc.unfreeze()

    def _settled(self, cache: ClusterCache) -> None:
        """The term's lists are in (called again after each relist): ready to serve."""
        if self.freeze_heap:
            gc.collect()  # what is garbage now is not kept frozen
            gc.freeze()
            log.info(
                "cluster state listed: its objects frozen out of garbage collection",
                extra={"objects": gc.get_freeze_count()},
            )
        self._label(cache)

    def _label(self, cache: ClusterCache) -> None:
        """Label the pod once per term, while the term is still on and the Lease still held; tried
        again every LABEL_RETRY until it is written (the Service reaches no one until then). A
        renewal running late when the lists come in holds the label back, not for the whole term:
        the term goes on unless the elector ends it, and the next try writes it."""
        if self.label is None:
            return
        with self._label_lock:
            if self._labelled is cache or self.cache is not cache:
                return
            claimed = False
            if self.may_write():
                self._labelled = cache
                claimed = self.label.claim()
                if not claimed:
                    self._labelled = None
        if not claimed:
            retry = threading.Timer(LABEL_RETRY, self._label, (cache,))
            retry.daemon = True
            retry.start()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = LeaseTiming()
    parser.add_argument(
        "--leader-elect",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run as one of several replicas: only the holder of the Lease serves (default on)",
    )
    parser.add_argument("--lease-name", default=DEFAULT_LEASE, help="Lease object (default %(default)s)")
    parser.add_argument(
        "--lease-namespace",
        default=os.environ.get("POD_NAMESPACE") or "kube-system",
        help="namespace of the Lease (default $POD_NAMESPACE, else kube-system)",
    )
    parser.add_argument("--lease-identity", default="", help="holder identity (default: hostname and a random suffix)")
    parser.add_argument(
        "--pod-name",
        default=os.environ.get("POD_NAME", ""),
        help=f"this replica's pod, labelled {LEADER_LABEL} while it leads, in the Lease's namespace"
        " (default $POD_NAME; empty: no label)",
    )
    parser.add_argument("--lease-duration", type=int, default=d.duration, help="seconds (default %(default)s)")
    parser.add_argument("--renew-deadline", type=float, default=d.renew_deadline, help="seconds (default %(default)s)")
    parser.add_argument("--retry-period", type=float, default=d.retry_period, help="seconds (default %(default)s)")


def build(
    args: argparse.Namespace,
    api_client: Any,
    extender: Extender,
    new_plugin: Callable[[], DeviceShare],
    freeze_heap: bool = False,
) -> Replica:
    """The replica the command line asks for; raises ValueError on inconsistent lease timing."""
    label = LeaderLabel(api_client, args.lease_namespace, args.pod_name) if args.pod_name else None
    if label is None:
        log.warning(
            "no pod name (--pod-name, $POD_NAME): this replica does not label its pod", extra={"label": LEADER_LABEL}
        )
    if not args.leader_elect:
        return Replica(api_client, extender, new_plugin, freeze_heap=freeze_heap, label=label)
    timing = LeaseTiming(args.lease_duration, args.renew_deadline, args.retry_period)
    identity = args.lease_identity or f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"
    api = KubeLeaseApi(api_client, args.lease_name, args.lease_namespace)
    elector = Elector(api, identity, timing, args.lease_name, args.lease_namespace)
    log.info("leader election", extra={"identity": identity, "lease": f"{args.lease_namespace}/{args.lease_name}"})
    return Replica(api_client, extender, new_plugin, elector, freeze_heap, label)
