"""Prometheus metrics without a client library: the proxy counts every CRI call, so an update is a
dict lookup and an add, and everything costly (label validation, formatting) happens once per new
label set or at scrape time.

Updates are meant to come from the event loop thread. Scrapes copy each series table before
formatting, so an update from another thread never breaks a scrape; two threads adding to the same
series at the same instant may lose one increment, which a monitoring counter can afford.

Every metric crihook exposes is defined at the bottom of this module so that all components
update the same objects.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
import re
import ssl
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping, Sequence
from itertools import pairwise

from crihook import __version__
from crihook.base.kubeauth import Verdict

log = logging.getLogger("crihook.metrics")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# 50 µs (a pass-through call on an idle node) to 10 s (a hook or backend close to its timeout).
DEFAULT_BUCKETS: tuple[float, ...] = (
    0.00005, 0.0001, 0.00025, 0.0005,
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")


def format_value(value: float) -> str:
    """A sample value as Prometheus' parser reads it (Go's ParseFloat plus +Inf/-Inf/NaN)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


def escape_label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _label_text(names: Sequence[str], values: Sequence[str], const: str = "") -> str:
    """`{a="1",b="2"}`, with `const` (the registry's own labels, already rendered) first."""
    if not names:
        return "{" + const + "}" if const else ""
    pairs = ",".join(f'{n}="{escape_label_value(v)}"' for n, v in zip(names, values, strict=True))
    return "{" + (const + "," if const else "") + pairs + "}"


class Registry:
    """The metrics one endpoint serves, in registration order."""

    def __init__(self) -> None:
        self._metrics: dict[str, _Metric] = {}
        # labels on every series this registry renders, e.g. {"node": ...} on a node daemon's, so two
        # nodes' series never collide whoever scrapes them; set once, before the first scrape
        self.const_labels: dict[str, str] = {}

    def register(self, metric: _Metric) -> None:
        if metric.name in self._metrics:
            raise ValueError(f"metric {metric.name} is already registered")
        self._metrics[metric.name] = metric

    def __iter__(self) -> Iterator[_Metric]:
        return iter(self._metrics.values())

    def render(self) -> bytes:
        """The text exposition format 0.0.4 of every registered metric."""
        lines: list[str] = []
        const = ",".join(f'{k}="{escape_label_value(v)}"' for k, v in self.const_labels.items())
        for metric in self:
            lines.append(f"# HELP {metric.name} {escape_help(metric.help)}")
            lines.append(f"# TYPE {metric.name} {metric.kind}")
            lines.extend(metric.samples(const))
        return ("\n".join(lines) + "\n").encode()


REGISTRY = Registry()


class _Metric:
    kind = ""

    def __init__(self, name: str, help: str, labels: Sequence[str] = (), registry: Registry | None = REGISTRY) -> None:
        if not _METRIC_NAME.match(name):
            raise ValueError(f"invalid metric name {name!r}")
        for label in labels:
            if not _LABEL_NAME.match(label) or label.startswith("__"):
                raise ValueError(f"metric {name}: invalid label name {label!r}")
        if len(set(labels)) != len(labels):
            raise ValueError(f"metric {name}: duplicate label names in {labels!r}")
        self.name = name
        self.help = help
        self.labels = tuple(labels)
        if registry is not None:
            registry.register(self)

    def _check(self, labels: tuple[str, ...]) -> None:
        """Validate a label set the first time it is seen, so the hot path never has to."""
        if len(labels) != len(self.labels):
            raise ValueError(f"metric {self.name} takes labels {self.labels}, got {len(labels)} value(s) {labels!r}")
        for value in labels:
            if not isinstance(value, str):
                # str() at scrape time could render two different keys as one series.
                raise TypeError(f"metric {self.name}: label values must be str, got {value!r}")

    def samples(self, const: str = "") -> Iterator[str]:
        raise NotImplementedError


class _Scalar(_Metric):
    """A counter or gauge: one number per label set."""

    def __init__(self, name: str, help: str, labels: Sequence[str] = (), registry: Registry | None = REGISTRY) -> None:
        super().__init__(name, help, labels, registry)
        self._values: dict[tuple[str, ...], float] = {}
        if not self.labels:
            self._values[()] = 0  # an unlabelled series exists from the start

    def _add(self, labels: tuple[str, ...], amount: float) -> None:
        values = self._values
        try:
            values[labels] += amount
        except KeyError:
            self._check(labels)
            values[labels] = amount

    def value(self, *labels: str) -> float:
        """The current value of one series (0 when never touched)."""
        return self._values.get(labels, 0)

    def samples(self, const: str = "") -> Iterator[str]:
        for labels, value in sorted(self._values.copy().items()):
            yield f"{self.name}{_label_text(self.labels, labels, const)} {format_value(value)}"


class Counter(_Scalar):
    kind = "counter"

    def __init__(self, name: str, help: str, labels: Sequence[str] = (), registry: Registry | None = REGISTRY) -> None:
        if not name.endswith("_total"):
            raise ValueError(f"counter {name} must end in _total")
        super().__init__(name, help, labels, registry)

    def inc(self, *labels: str, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError(f"counter {self.name} can only go up, not by {amount}")
        self._add(labels, amount)


class Gauge(_Scalar):
    kind = "gauge"

    def set(self, value: float, *labels: str) -> None:
        values = self._values
        if labels not in values:
            self._check(labels)
        values[labels] = value

    def inc(self, *labels: str, amount: float = 1) -> None:
        self._add(labels, amount)

    def replace(self, values: Mapping[tuple[str, ...], float]) -> None:
        """Every series at once: those not in `values` are gone (a container that went away). The
        table is swapped whole, so a scrape sees the old set or the new one."""
        known = self._values
        for labels in values:
            if labels not in known:
                self._check(labels)
        self._values = dict(values)

    def dec(self, *labels: str, amount: float = 1) -> None:
        self._add(labels, -amount)


class Histogram(_Metric):
    kind = "histogram"

    def __init__(
        self,
        name: str,
        help: str,
        labels: Sequence[str] = (),
        buckets: Sequence[float] = DEFAULT_BUCKETS,
        registry: Registry | None = REGISTRY,
    ) -> None:
        if "le" in labels:
            raise ValueError(f"histogram {name}: 'le' is reserved for buckets")
        bounds = tuple(float(b) for b in buckets if not math.isinf(b))
        if not bounds or any(a >= b for a, b in pairwise(bounds)) or any(map(math.isnan, bounds)):
            raise ValueError(f"histogram {name}: buckets must be finite and strictly increasing, got {buckets!r}")
        super().__init__(name, help, labels, registry)
        self.bounds = bounds
        self._le = [format_value(b) for b in bounds] + ["+Inf"]
        # label set -> [count in bucket 0, ..., count above the last bound, sum of observations]
        self._series: dict[tuple[str, ...], list[float]] = {}

    def observe(self, seconds: float, *labels: str) -> None:
        series = self._series.get(labels)
        if series is None:
            self._check(labels)
            series = self._series[labels] = [0] * (len(self.bounds) + 2)
        series[bisect_left(self.bounds, seconds)] += 1  # le is inclusive: value == bound counts in it
        series[-1] += seconds

    def count(self, *labels: str) -> int:
        series = self._series.get(labels)
        return int(sum(series[:-1])) if series else 0

    def samples(self, const: str = "") -> Iterator[str]:
        for labels, series in sorted((k, list(v)) for k, v in self._series.copy().items()):
            cumulative = 0.0
            for le, n in zip(self._le, series[:-1], strict=True):
                cumulative += n
                lt = _label_text((*self.labels, "le"), (*labels, le), const)
                yield f"{self.name}_bucket{lt} {format_value(int(cumulative))}"
            lt = _label_text(self.labels, labels, const)
            yield f"{self.name}_sum{lt} {format_value(series[-1])}"
            yield f"{self.name}_count{lt} {format_value(int(cumulative))}"


# -- the HTTP endpoint ----------------------------------------------------------------------------

REQUEST_LIMIT = 8192  # bytes of request line and headers; a scrape sends a few hundred
REQUEST_TIMEOUT = 5.0


def parse_listen(listen: str) -> tuple[str, int]:
    """'127.0.0.1:9317', '[::1]:9317' or 'localhost:9317' -> (host, port)."""
    host, sep, port_text = listen.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"metrics listen address {listen!r} is not HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"metrics listen address {listen!r}: write IPv6 hosts in brackets, e.g. [::1]:9317")
    return host, int(port_text)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _response(status: str, body: bytes, content_type: str, head_only: bool = False) -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    return head if head_only else head + body


Authorize = Callable[[str], Verdict]  # bearer token -> verdict; blocking (run on a thread)
_REFUSED = {401: "401 Unauthorized", 403: "403 Forbidden", 503: "503 Service Unavailable"}


def _bearer(head: bytes) -> str:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer":
                return token.strip().decode("latin-1")
    return ""


async def _answer(head: bytes, registry: Registry, authorize: Authorize | None) -> bytes:
    parts = head.split(b"\r\n", 1)[0].decode("latin-1").split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        return _response("400 Bad Request", b"bad request\n", "text/plain")
    method, target, _ = parts
    path = target.split("?", 1)[0]
    if path not in ("/metrics", "/healthz"):
        return _response("404 Not Found", b"not found: crihook serves /metrics and /healthz\n", "text/plain")
    if method not in ("GET", "HEAD"):
        return _response("405 Method Not Allowed", b"use GET\n", "text/plain")
    if path == "/healthz":  # kubelet's probes, which carry no token; it says nothing about the node
        return _response("200 OK", b"ok\n", "text/plain", head_only=method == "HEAD")
    if authorize is not None:
        verdict = await asyncio.to_thread(authorize, _bearer(head))
        if verdict.code != 200:
            log.info("metrics scrape refused", extra={"code": verdict.code, "why": verdict.why})
            return _response(_REFUSED.get(verdict.code, "403 Forbidden"), f"{verdict.why}\n".encode(), "text/plain")
    return _response("200 OK", registry.render(), CONTENT_TYPE, head_only=method == "HEAD")


async def _handle(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, registry: Registry, authorize: Authorize | None
) -> None:
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT):
            head = await reader.readuntil(b"\r\n\r\n")
        reply = await _answer(head, registry, authorize)
    except asyncio.LimitOverrunError:
        reply = _response("431 Request Header Fields Too Large", b"request too large\n", "text/plain")
    except (asyncio.IncompleteReadError, OSError):  # a reset, a timeout, a broken TLS record
        writer.close()
        return
    try:
        writer.write(reply)
        await writer.drain()
    except OSError:
        pass
    finally:
        writer.close()


async def serve(
    listen: str,
    *,
    allow_remote: bool = False,
    registry: Registry = REGISTRY,
    authorize: Authorize | None = None,
    tls: ssl.SSLContext | None = None,
) -> asyncio.Server:
    """Serve `registry` at http(s)://<listen>/metrics, and /healthz; HTTPS with `tls` (crihook.base.tls),
    which must be given with `authorize`, since a bearer token must not cross the network in the
    clear. Metrics name pods and namespaces, so a non-loopback address is refused unless each
    scrape is authorized (`authorize`, the caller's bearer token: crihook.base.kubeauth) or
    `allow_remote` says the operator wants that. "::" listens on both families."""
    host, port = parse_listen(listen)
    if not allow_remote and authorize is None and not is_loopback(host):
        raise ValueError(
            f"metrics listen address {listen!r} is not a loopback address; refusing to expose it without "
            "authorization ([proxy] metrics_auth_kubeconfig)"
        )
    if authorize is not None and tls is None:
        raise ValueError(f"metrics on {listen!r} check bearer tokens, so they are served over TLS only")
    # "::" is every address of both families: asyncio binds "::" IPv6-only, and None to each family's
    # any-address (only IPv4's on a kernel without IPv6)
    bind: str | None = None if host == "::" else host
    server = await asyncio.start_server(
        lambda r, w: _handle(r, w, registry, authorize),
        bind,
        port,
        limit=REQUEST_LIMIT,
        reuse_address=True,
        ssl=tls,
        ssl_handshake_timeout=REQUEST_TIMEOUT if tls is not None else None,
    )
    log.info(
        "metrics endpoint listening",
        extra={"listen": listen, "authorized": authorize is not None, "tls": tls is not None},
    )
    return server


# -- what crihook exposes -------------------------------------------------------------------------

BUILD_INFO = Gauge("crihook_build_info", "Always 1; the version label says which crihook is running.", ("version",))
BUILD_INFO.set(1, __version__)

CRI_CALLS = Counter(
    "crihook_cri_calls_total",
    "CRI calls answered by the proxy, by full gRPC method and status code name (OK, NOT_FOUND, ...).",
    ("method", "code"),
)
BACKEND_SECONDS = Histogram(
    "crihook_backend_duration_seconds",
    "Time the runtime backend (containerd) took to answer, by gRPC method.",
    ("method",),
)
HOOK_SECONDS = Histogram(
    "crihook_hook_duration_seconds",
    "Time each hook took, by hook name and stage (e.g. pre_create_container).",
    ("hook", "stage"),
)
HOOK_FAILURES = Counter(
    "crihook_hook_failures_total",
    "Hook runs that failed or timed out, whatever their failure policy, by hook name.",
    ("hook",),
)
HOOK_SERVER_FILES = Gauge(
    "crihook_hook_server_files",
    "Koordinator hook-server files in [hooks.remote] config_dir, by state: in_use, or skipped (unusable, e.g. "
    "an unknown failure-policy: that server is not called; the log and `crihook doctor` name the file and field).",
    ("state",),
)
STORE_OBJECTS = Gauge(
    "crihook_store_objects",
    "Pods and containers in crihook's store (kind is pods or containers).",
    ("kind",),
)
REPORTER_WRITES = Counter(
    "crihook_reporter_writes_total",
    "Objects the device reporter wrote to the API server, by kind (Device, Node).",
    ("kind",),
)
ORPHAN_TASKS = Counter(
    "crihook_orphan_tasks_total",
    "Tasks containerd kept for containers CRI holds as created or exited, by result (cleared, failed).",
    ("result",),
)
NRI_UNGRANTED = Counter(
    "crihook_nri_ungranted_total",
    "Containers `crihook nri` found reaching a GPU nobody granted them (made while it was away), by action"
    " (evicted, reported; evict_failed counts each failed try).",
    ("action",),
)
NRI_EVICTIONS_PENDING = Gauge(
    "crihook_nri_evictions_pending",
    "Evictions `crihook nri` is still trying (each retried with back-off until done or its container is gone).",
    (),
)
NRI_UNREGISTERED = Counter(
    "crihook_nri_unregistered_total",
    "Connections `crihook nri` gave up because the runtime did not take it as a plugin, by reason"
    " (sync_failed, sync_late, unproven); each is dialled again.",
    ("reason",),
)
SCHEDULER_REQUESTS = Counter(
    "crihook_scheduler_requests_total",
    "Requests `crihook scheduler` answered (extender verbs, admission reviews), by path and HTTP status.",
    ("path", "code"),
)
SCHEDULER_SECONDS = Histogram(
    "crihook_scheduler_request_duration_seconds",
    "Time `crihook scheduler` took to answer an extender verb or admission review, by path.",
    ("path",),
)
SCHEDULER_CPU_SECONDS = Histogram(
    "crihook_scheduler_request_cpu_seconds",
    "CPU time the thread answering an extender verb or admission review spent on it, by path: what the "
    "duration has beyond it was spent waiting (for a core, the GIL, the allocator lock, the API server).",
    ("path",),
)
SCHEDULER_LEADER = Gauge(
    "crihook_scheduler_leader",
    "1 while this `crihook scheduler` replica holds the leader Lease (its term runs), else 0.",
)
SCHEDULER_BINDS_REFUSED = Counter(
    "crihook_scheduler_binds_refused_total",
    "Binds refused for safety, by reason: not_leader (no valid Lease), stale_view (the GPUs are already held "
    "by pods on the API server that this replica's memory did not know).",
    ("reason",),
)
SCHEDULER_TLS_RELOADS = Counter(
    "crihook_scheduler_tls_reloads_total",
    "Times `crihook scheduler` loaded changed certificate files (a rotated Secret) without a restart.",
)

# GPU usage (devices/collector.py): one series per container and device at most, rewritten whole
# every collection, so containers that went away leave no series behind
# gpu and UUID as dcgm-exporter names them, so its series join ours: gpu is the GPU's NVML index,
# UUID the device's (the GPU's own, or a MIG device's)
_USAGE_LABELS = ("namespace", "pod", "container", "gpu", "UUID")
USAGE_MEMORY = Gauge(
    "crihook_gpu_memory_used_bytes",
    "GPU memory held by a container's processes (NVML), by device: gpu is the GPU's NVML index, UUID the "
    "GPU's or MIG device's UUID.",
    _USAGE_LABELS,
)
USAGE_SM = Gauge(
    "crihook_gpu_sm_utilization_ratio",
    "SM utilisation of a container's processes on a GPU (0 to 1), mean of the driver's samples since the "
    "previous collection, summed over the processes (at most 1); absent where the driver keeps none (MIG).",
    _USAGE_LABELS,
)
GRANT_CORE = Gauge(
    "crihook_gpu_granted_core_ratio",
    "Share of a GPU's SMs the scheduler granted the container (0 to 1: koordinator.sh/gpu-core / 100; 1 for a "
    "whole GPU).",
    _USAGE_LABELS,
)
GRANT_MEMORY = Gauge(
    "crihook_gpu_granted_memory_bytes",
    "GPU memory the scheduler granted the container (koordinator.sh/gpu-memory, or its ratio of the GPU's).",
    _USAGE_LABELS,
)
GRANT_CLAIM = Gauge(
    "crihook_gpu_claim_info",
    "1 for each GPU a container reached through a DRA claim (claim: namespace/name, from kubelet's DRA "
    "checkpoint); the claim's share is its allocation's, on the ResourceClaim.",
    (*_USAGE_LABELS, "claim"),
)
USAGE_OTHERS = Gauge(
    "crihook_gpu_unattributed_memory_used_bytes",
    "GPU memory held by processes of no known container, by device and owner: host (no container), "
    "unknown_container (a container crihook's store does not hold), exited (gone before its cgroup was read).",
    ("gpu", "UUID", "owner"),
)
OVER_GRANT = Counter(
    "crihook_gpu_memory_over_grant_total",
    "Times a container was seen holding more GPU memory than granted (each episode once), by namespace. "
    "Reporting only: nothing is stopped.",
    ("namespace",),
)
USAGE_SECONDS = Histogram(
    "crihook_gpu_usage_collection_cpu_seconds",
    "CPU time one usage collection took (NVML, /proc, attribution, metrics, the state file).",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
)
