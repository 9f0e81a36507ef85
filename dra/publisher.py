"""Publishes this node's pool of the DRA driver: NVML discovery and the node's pods -> ResourceSlices
(devices/slices.py), written only when they change, the pool's generation one higher each time.

A round every `interval` seconds (2 by default, so a GPU that turns unhealthy, or one crihook's
allocator gives out, is republished well within 5 s): NVML's identity and health (the topology only
when the set of GPUs changes: the partition table depends on it), the pods on this node (their
`device-allocated` annotations), the slices the API server holds for this driver and node. Runs on
its own thread (every call blocks). A failed round is logged and retried at the next; a node whose
NVML is not usable keeps what was published rather than withdrawing its GPUs.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from crihook.base import dra
from crihook.devices import partitions, slices
from crihook.devices.nvml import GpuIndex, NodeGpus, Nvml

log = logging.getLogger("crihook.dra.publisher")

REQUEST_TIMEOUT = 10.0


@dataclass
class Round:
    """What one round did."""

    writes: list[str] = field(default_factory=list)  # "create <slice>", "update <slice>", "delete <slice>"
    generation: int = 0
    devices: int = 0
    reason: str = ""  # why nothing was published


def features_for(version: Mapping[str, Any]) -> slices.Features:
    """What a cluster serves by default, from its /version: consumable capacity and device taints are
    beta, on by default, from Kubernetes 1.36."""
    minor = re.match(r"\d+", str(version.get("minor", "")))
    recent = str(version.get("major")) == "1" and minor is not None and int(minor.group()) >= 36
    return slices.Features(consumable_capacity=recent, device_taints=recent)


class Publisher:
    def __init__(
        self,
        node: str,
        api_client: Any,
        nvml: Nvml,
        index: GpuIndex | None = None,
        partition_table: partitions.PartitionTable | None = None,
        features: slices.Features | None = None,
        interval: float = 2.0,
        force: Mapping[str, bool] | None = None,
    ) -> None:
        """`features`: what the cluster serves (None: from its version); `force`: Features fields set
        whatever the version says."""
        from kubernetes.client import CoreV1Api, ResourceV1Api, VersionApi

        self.node = node
        self.nvml = nvml
        self.index = index
        self.partition_table = partition_table
        self.features = features
        self.interval = interval
        self.force = dict(force or {})
        self._core = CoreV1Api(api_client)
        self._resource: Any = ResourceV1Api(api_client)  # typed for model objects; plain JSON bodies are what it sends
        self._version = VersionApi(api_client)
        self._node_uid = ""
        self._gpus_seen: tuple[str, ...] | None = None  # UUIDs of the last topology read
        self._table: partitions.PartitionTable | None = None
        self._said: tuple[tuple[str, str], ...] = ()
        self._sent: dict[str, tuple[Any, Any]] = {}  # slice name -> (resourceVersion written, comparable spec sent)
        self.taken: frozenset[int] = frozenset()  # minors crihook's allocator gave out, at the last round
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def given_out(self) -> frozenset[int]:
        """The minors crihook's allocator gave pods of this node, as the last round saw them."""
        return self.taken

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="dra-publisher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=REQUEST_TIMEOUT + 5)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                done = self.run_once()
                if done.writes:
                    log.info(
                        "ResourceSlices published",
                        extra={
                            "generation": done.generation,
                            "devices": done.devices,
                            "writes": ", ".join(done.writes),
                        },
                    )
            except Exception as e:  # an API or NVML failure ends the round only
                status = getattr(e, "status", None)  # the kubernetes client's ApiException
                error = (
                    f"API server answered {status} {getattr(e, 'reason', '')}" if status else f"{type(e).__name__}: {e}"
                )
                log.warning("ResourceSlices not published", extra={"error": error})
            self._stop.wait(self.interval)

    def run_once(self) -> Round:
        gpus = self._discover()
        if gpus.reason:
            return Round(reason=f"NVML: {gpus.reason}")
        if self.features is None:
            detected = features_for(self._json(self._version.get_code(**self._opts())))
            self.features = replace(detected, **self.force)
            log.info("cluster features", extra=asdict(self.features))
        if not self._node_uid:
            self._node_uid = str(self._json(self._core.read_node(self.node, **self._opts()))["metadata"]["uid"])
        pods = self._json(
            self._core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={self.node}", **self._opts())
        )
        taken, problems = slices.taken_minors(pods.get("items") or [])
        self.taken = taken
        for p in problems:
            log.warning("allocation annotation unreadable", extra={"problem": p})
        pool = slices.build(self.node, self._node_uid, gpus, self._table, taken, self.features, 0)
        self._log_left_out(pool)
        return self._write(pool, gpus, taken)

    def _discover(self) -> NodeGpus:
        snap = self.nvml.snapshot(topology=False)
        if snap.reason:
            return snap
        uuids = tuple(g.uuid for g in snap.gpus)
        if uuids != self._gpus_seen:  # new or changed GPUs: the partition table is worked out again
            snap = self.nvml.snapshot(topology=True)
            if snap.reason:
                return snap
            topo = snap.topology
            model = snap.gpus[0].name if snap.gpus else ""
            self._table = partitions.table_for_node(
                self.partition_table, model, [g.minor for g in snap.gpus], bool(topo and topo.nvswitch)
            )
            self._gpus_seen = tuple(g.uuid for g in snap.gpus)
        if self.index is not None:
            self.index.update(snap)
        return snap

    def _write(self, pool: slices.Pool, gpus: NodeGpus, taken: frozenset[int]) -> Round:
        listed = self._json(
            self._resource.list_resource_slice(
                field_selector=f"spec.nodeName={self.node},spec.driver={dra.DRIVER}", **self._opts()
            )
        )
        existing = {
            s["metadata"]["name"]: s for s in listed.get("items") or [] if s["spec"].get("driver") == dra.DRIVER
        }
        want = {s["metadata"]["name"]: s for s in pool.slices}
        devices = sum(len(s["spec"]["devices"]) for s in pool.slices)
        same = set(existing) == set(want) and all(self._unchanged(existing[n], want[n]) for n in want)
        current = max((int(s["spec"]["pool"]["generation"]) for s in existing.values()), default=0)
        if same:
            return Round(generation=current, devices=devices)
        generation = current + 1
        table = self._table
        pool = slices.build(
            self.node, self._node_uid, gpus, table, taken, self.features or slices.Features(), generation
        )
        done = Round(generation=generation, devices=devices)
        for s in pool.slices:
            problems = slices.check(s)
            if problems:  # a bug of the builder: publishing would fail at the API server anyway
                raise ValueError(f"slice {s['metadata']['name']}: {'; '.join(problems)}")
        for name, s in ((s["metadata"]["name"], s) for s in pool.slices):
            if name in existing:
                s["metadata"]["resourceVersion"] = existing[name]["metadata"]["resourceVersion"]
                stored = self._json(self._resource.replace_resource_slice(name, s, **self._opts()))
                done.writes.append(f"update {name}")
            else:
                stored = self._json(self._resource.create_resource_slice(s, **self._opts()))
                done.writes.append(f"create {name}")
            self._stored(s, stored)
        for name in sorted(set(existing) - {s["metadata"]["name"] for s in pool.slices}):
            self._resource.delete_resource_slice(name, **self._opts())
            done.writes.append(f"delete {name}")
        return done

    def _unchanged(self, existing: Mapping[str, Any], want: Mapping[str, Any]) -> bool:
        """The slice the API server holds is the one wanted, or the one this publisher last wrote
        there for the same devices (what the server dropped of it is not written again and again)."""
        mine = slices.comparable(want["spec"])
        if slices.comparable(existing["spec"]) == mine:
            return True
        sent = self._sent.get(existing["metadata"]["name"])
        return sent is not None and sent == (existing["metadata"].get("resourceVersion"), mine)

    def _stored(self, sent: Mapping[str, Any], stored: Mapping[str, Any]) -> None:
        """Remember what was written; a feature whose fields the API server dropped is off from now on."""
        name = sent["metadata"]["name"]
        self._sent[name] = (stored["metadata"].get("resourceVersion"), slices.comparable(sent["spec"]))
        off = slices.dropped(sent["spec"], stored["spec"])
        if off and self.features is not None:
            log.warning(
                "the API server dropped fields of features it does not serve", extra={"off": ",".join(sorted(off))}
            )
            self.features = replace(self.features, **dict.fromkeys(off, False))

    def _log_left_out(self, pool: slices.Pool) -> None:
        said = tuple(pool.left_out)
        if said != self._said:
            for device, reason in pool.left_out:
                log.info("GPU left out of the ResourceSlices", extra={"device": device, "reason": reason})
            for problem in pool.problems:
                log.warning("ResourceSlice published differently", extra={"problem": problem})
            self._said = said

    @staticmethod
    def _opts() -> dict[str, Any]:
        return {"_request_timeout": REQUEST_TIMEOUT, "_preload_content": False}

    @staticmethod
    def _json(response: Any) -> Any:
        return json.loads(response.data)
