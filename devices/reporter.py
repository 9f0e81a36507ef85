"""The device reporter: discovery -> Device object, node labels and node resources, written only
when they change.

It runs on its own thread (all its API and NVML calls block), so it never holds up the proxy's event
loop: `crihook serve` calls `Reporter.start()` after it is serving and `Reporter.stop()` on shutdown.
`crihook report --once` runs one round in the foreground and prints what it did.

Failure handling: an API error or an unreachable API server ends the round; the next one comes after
an exponential back-off (1 s doubling up to the interval, with jitter), and the round after a
success comes after the interval. A 409 Conflict re-reads the object and tries again at once, a few
times, since it only means someone else wrote in between.

The Device's status goes through its status subresource, which crihook's CRD declares. Koordinator's
CRD declares none: there `/status` answers 404 and the object's own write carries the status, so on a
404 from `/status` the reporter writes the status with the object from then on (said once).
"""

from __future__ import annotations

import json
import logging
import random
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from crihook.base import config as cfg
from crihook.base.metrics import REPORTER_WRITES
from crihook.devices import partitions, rdma, report
from crihook.devices.checkpoint import CheckpointError, CheckpointReader, PodDeviceEntry
from crihook.devices.nvml import GpuIndex, Nvml

log = logging.getLogger("crihook.devices.reporter")

REQUEST_TIMEOUT = 10.0  # seconds per API call: a hung API server must not hang stop()
CONFLICT_RETRIES = 3
MERGE_PATCH = "application/merge-patch+json"


class ReportError(Exception):
    """A round could not finish; the message says which call failed and why."""


@dataclass
class Round:
    """What one round did."""

    writes: list[str] = field(default_factory=list)  # "Device create", "Node status", ...
    gpus: int = 0
    rdma: int = 0
    reason: str = ""  # why NVML gave no GPUs


def load_partition_table(path: str) -> partitions.PartitionTable | None:
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return partitions.parse_table(f.read(), "[reporter] partition_table")
    except OSError as e:
        raise cfg.ConfigError(path, f"[reporter] partition_table: {e.strerror or e}") from None
    except partitions.PartitionTableError as e:
        raise cfg.ConfigError(path, str(e)) from None


def api_client_from(kubeconfig: str) -> Any:
    """A kubernetes ApiClient from a kubeconfig file, or the pod's service account for "in-cluster".
    urllib3's own retries are off: the loop backs off and says once per failed round what went wrong,
    where urllib3 would add three "Retrying" warnings of its own (and three more connection timeouts)."""
    from kubernetes import client, config

    c = client.Configuration()
    if kubeconfig == "in-cluster":
        config.load_incluster_config(client_configuration=c)
    else:
        config.load_kube_config(config_file=kubeconfig, client_configuration=c)
    c.retries = False
    return client.ApiClient(c)


def _api_reason(e: Exception) -> str:
    status = getattr(e, "status", None)
    if status is not None:
        body = getattr(e, "body", None) or ""
        try:
            message = json.loads(body).get("message", "")
        except (ValueError, AttributeError):
            message = str(body)[:200]
        return f"HTTP {status}{': ' + message if message else ''}"
    return f"{type(e).__name__}: {e}"


class Reporter:
    """One node's reporter. `index`, when given, is the gpu hook's GpuIndex: every round's snapshot
    refreshes it, so the hot path rarely has to ask NVML itself."""

    def __init__(
        self,
        config: cfg.Config,
        api_client: Any,
        nvml: Nvml | None = None,
        index: GpuIndex | None = None,
        rdma_links: Callable[[], Mapping[str, str]] = rdma.netns_links,
        clock: Callable[[], float] = time.monotonic,
        plugin_holds: Callable[[str], bool] | None = None,
    ) -> None:
        """`plugin_holds(pod_uid)`: whether a checkpoint holder really uses its device-plugin GPU
        (the gpu hook's rule: kubelet still has the pod and the scheduler did not place it); None
        publishes every entry."""
        from kubernetes import client

        self.config = config
        self.node_name = config.node.name or socket.gethostname()
        self.nvml = nvml or Nvml(config.node.nvml_library, config.node.sys_root)
        self.index = index
        self.partition_table = load_partition_table(config.reporter.partition_table)
        self._core = client.CoreV1Api(api_client)
        self._custom = client.CustomObjectsApi(api_client)
        self._checkpoint = CheckpointReader(config.node.kubelet_checkpoint)
        self._rdma_links = rdma_links
        self._clock = clock
        self.plugin_holds = plugin_holds
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._said_problems: set[str] = set()
        self.failures = 0  # consecutive failed rounds
        self.status_subresource = True  # False once /status answered 404 (a CRD without it)

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Start reporting on a daemon thread; returns at once."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="crihook-reporter", daemon=True)
        self._thread.start()
        log.info(
            "device reporter started", extra={"node": self.node_name, "every_s": self.config.reporter.interval_seconds}
        )

    def stop(self, timeout: float = REQUEST_TIMEOUT + 1) -> None:
        """Stop after the call in flight (at most one request timeout). Blocks: from a coroutine,
        `await asyncio.to_thread(reporter.stop)`."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _loop(self) -> None:
        interval = self.config.reporter.interval_seconds
        while not self._stop.is_set():
            try:
                self.run_once()
            except ReportError as e:
                self.failures += 1
                delay = min(interval, 2 ** min(self.failures - 1, 16))
                delay *= random.uniform(0.8, 1.2)
                if self.failures == 1 or self.failures % 10 == 0:
                    log.warning("device report failed", extra={"error": str(e), "retry_in": round(delay, 1)})
            except Exception:  # a bug must not end reporting for the life of the daemon
                self.failures += 1
                delay = interval
                log.exception("device report crashed")
            else:
                if self.failures:
                    log.info("device report succeeded again", extra={"after_failures": self.failures})
                self.failures = 0
                delay = interval
            self._stop.wait(delay)

    # -- one round -----------------------------------------------------------------------------------

    def observe(self) -> report.Observed:
        snapshot = self.nvml.snapshot(topology=True)
        if self.index is not None:
            self.index.update(snapshot)
        nics = rdma.discover(self.config.node.sys_root, self._rdma_links)
        entries: tuple[PodDeviceEntry, ...] | None
        plugins: frozenset[str] | None
        try:
            checkpoint = self._checkpoint.read()
            entries = checkpoint.entries
            plugins = frozenset(checkpoint.registered)
            if self.plugin_holds is not None:
                entries = tuple(e for e in entries if self.plugin_holds(e.pod_uid))
        except CheckpointError as e:
            self._say(f"kubelet checkpoint unreadable, its annotation and nvidia.com/gpu left as they are: {e}")
            entries = plugins = None
        return report.Observed(snapshot, tuple(nics), entries, self.partition_table, plugins)

    def run_once(self) -> Round:
        """Discover, compare, write what changed. Raises ReportError."""
        obs = self.observe()
        want = report.desired(obs)
        for p in want.problems:
            self._say(p)
        done = Round(gpus=len(obs.gpus.gpus), rdma=len(obs.nics), reason=obs.gpus.reason)
        node = self._call("read Node", lambda: self._raw(self._core.read_node(self.node_name, **self._opts())))
        uid = (node.get("metadata") or {}).get("uid", "")
        self._write_device(uid, want, done)
        label_patch = report.node_label_patch(node, want)
        if label_patch is not None:
            self._call("patch Node labels", lambda: self._core.patch_node(self.node_name, label_patch, **self._patch()))
            self._wrote(done, "Node labels")
        status_patch = report.node_status_patch(node, want)
        if status_patch is not None:
            self._call(
                "patch Node status",
                lambda: self._core.patch_node_status(self.node_name, status_patch, **self._patch()),
            )
            self._wrote(done, "Node status")
        return done

    def _write_device(self, node_uid: str, want: report.Desired, done: Round) -> None:
        for attempt in range(CONFLICT_RETRIES + 1):
            current = self._get_device()
            obj = report.device_object(self.node_name, node_uid, want, current)
            try:
                if obj is not None and current is None:
                    current = self._custom_call("create", obj)
                    self._wrote(done, "Device create")
                elif obj is not None:
                    current = self._custom_call("replace", obj)
                    self._wrote(done, "Device")
                if report.status_changed(current, want):
                    assert current is not None
                    self._write_status({**current, "status": want.status})
                    self._wrote(done, "Device status")
                return
            except _Conflict:
                if attempt == CONFLICT_RETRIES:
                    raise ReportError(f"Device {self.node_name}: still conflicting after {attempt + 1} tries") from None
                log.debug("Device changed under us; reading it again", extra={"attempt": attempt + 1})
                self._stop.wait(0.05 * (attempt + 1))

    def _write_status(self, body: dict[str, Any]) -> None:
        if self.status_subresource:
            try:
                self._custom_call("replace_status", body)
                return
            except _NoStatus:
                self.status_subresource = False
                log.warning(
                    "the Device resource has no status subresource (a CRD that declares none, such as "
                    "Koordinator's): writing the status with the object",
                    extra={"node": self.node_name},
                )
        written = self._custom_call("replace", body)
        if written.get("status") != body["status"]:
            # the object's write dropped the status: the resource has a status subresource after all
            # (the 404 was the object going away in between); the next round writes /status again
            self.status_subresource = True
            raise ReportError(f"Device {self.node_name}: status not written, the resource has a status subresource")

    def _get_device(self) -> dict[str, Any] | None:
        from kubernetes.client.exceptions import ApiException

        try:
            return self._raw(
                self._custom.get_cluster_custom_object(
                    report.GROUP, report.VERSION, report.PLURAL, self.node_name, **self._opts()
                )
            )
        except ApiException as e:
            if e.status == 404:
                return None
            raise ReportError(f"read Device {self.node_name}: {_api_reason(e)}") from None
        except Exception as e:  # connection refused, timeouts, TLS: the API server is away
            raise ReportError(f"read Device {self.node_name}: {_api_reason(e)}") from None

    def _custom_call(self, verb: str, body: dict[str, Any]) -> dict[str, Any]:
        from kubernetes.client.exceptions import ApiException

        g, v, p = report.GROUP, report.VERSION, report.PLURAL
        try:
            if verb == "create":
                resp = self._custom.create_cluster_custom_object(g, v, p, body, **self._opts())
            elif verb == "replace":
                resp = self._custom.replace_cluster_custom_object(g, v, p, self.node_name, body, **self._opts())
            else:
                resp = self._custom.replace_cluster_custom_object_status(g, v, p, self.node_name, body, **self._opts())
        except ApiException as e:
            if e.status == 409:
                raise _Conflict() from None
            if e.status == 404 and verb == "replace_status":
                raise _NoStatus() from None
            raise ReportError(f"{verb} Device {self.node_name}: {_api_reason(e)}") from None
        except Exception as e:
            raise ReportError(f"{verb} Device {self.node_name}: {_api_reason(e)}") from None
        return self._raw(resp)

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as e:  # ApiException, urllib3 errors: the round ends, the loop backs off
            raise ReportError(f"{what} {self.node_name}: {_api_reason(e)}") from None

    # -- small helpers -----------------------------------------------------------------------------

    @staticmethod
    def _opts() -> dict[str, Any]:
        # raw JSON: no model round trip, and the diff sees exactly what the API server holds
        return {"_request_timeout": REQUEST_TIMEOUT, "_preload_content": False}

    @staticmethod
    def _patch() -> dict[str, Any]:
        return {"_request_timeout": REQUEST_TIMEOUT, "_preload_content": False, "_content_type": MERGE_PATCH}

    @staticmethod
    def _raw(resp: Any) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads(resp.data) if hasattr(resp, "data") else resp
        return doc

    def _wrote(self, done: Round, what: str) -> None:
        done.writes.append(what)
        REPORTER_WRITES.inc(what.split()[0])
        log.info("reported", extra={"node": self.node_name, "wrote": what})

    def _say(self, problem: str) -> None:
        if problem not in self._said_problems:
            self._said_problems.add(problem)
            log.warning(problem, extra={"node": self.node_name})


class _Conflict(Exception):
    """409 from a write: the object changed since we read it."""


class _NoStatus(Exception):
    """404 from a write of `/status` of an object just read: the resource has no status subresource."""
