"""Two or more `crihook scheduler` processes against the fake API server, and kube-scheduler's side
of the conversation over HTTP. Each replica has a pod object of its own in the fake (kube-system,
named after the replica), which it labels while it leads. The Service sends each call to a live
replica whose pod carries the leader label, as the endpoints controller and kube-proxy do for a
selector with that label (deploy/scheduler/service.yaml; kubelet's readiness is the process being
alive here, and the fake is read every 20 ms), and a pod whose filter or bind answered an Error is
tried again, as kube-scheduler requeues it.

Used by tests/scheduler/test_ha.py and bench/failover_bench.py.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from crihook.scheduler.ha import LEADER_LABEL
from tests.support.fakekube import FakeKube

REPO = Path(__file__).resolve().parents[2]
NAMESPACE = "kube-system"
POD_LABELS = {"app.kubernetes.io/name": "crihook-scheduler"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Timing:
    duration: int = 8
    renew_deadline: float = 5.0
    retry_period: float = 1.0


@dataclass
class Replica:
    """One `crihook scheduler` process on a loopback port."""

    name: str
    kubeconfig: Path
    timing: Timing
    log: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    flags: tuple[str, ...] = ()

    def start(self) -> None:
        cmd = [
            sys.executable,
            "-m",
            "crihook.cli",
            "scheduler",
            f"--listen=127.0.0.1:{self.port}",
            f"--kubeconfig={self.kubeconfig}",
            f"--lease-namespace={NAMESPACE}",
            f"--lease-identity={self.name}",
            f"--pod-name={self.name}",
            f"--lease-duration={self.timing.duration}",
            f"--renew-deadline={self.timing.renew_deadline}",
            f"--retry-period={self.timing.retry_period}",
            *self.flags,
        ]
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)

    def signal(self, sig: int) -> None:
        assert self.process is not None
        os.kill(self.process.pid, sig)

    def stop(self) -> None:
        p = self.process
        if p is None or p.poll() is not None:
            return
        os.kill(p.pid, signal.SIGCONT)  # a stopped process can not act on SIGTERM
        p.terminate()
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def ready(self, timeout: float = 0.5) -> bool:
        try:
            return get(self.port, "/readyz", timeout)[0] == 200
        except OSError:
            return False

    def post(self, path: str, body: Any, timeout: float = 10.0) -> Any:
        code, data = request(self.port, "POST", path, json.dumps(body).encode(), timeout)
        if code != 200:
            raise OSError(f"{path}: HTTP {code}: {data[:200]!r}")
        return json.loads(data)


def request(port: int, method: str, path: str, body: bytes | None, timeout: float) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body, {"Content-Type": "application/json"} if body else {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def get(port: int, path: str, timeout: float) -> tuple[int, bytes]:
    return request(port, "GET", path, None, timeout)


@contextmanager
def replicas(
    kube: FakeKube, work: Path, n: int = 2, timing: Timing = Timing(), flags: tuple[str, ...] = ()
) -> Iterator[list[Replica]]:
    config = kube.write_kubeconfig(work / "kubeconfig")
    procs = [Replica(f"replica-{i}", config, timing, work / f"replica-{i}.log", flags=flags) for i in range(n)]
    for p in procs:
        meta = {"name": p.name, "namespace": NAMESPACE, "labels": POD_LABELS}
        kube.create("pods", {"metadata": meta, "spec": {"containers": [{"name": "scheduler", "image": "crihook"}]}})
    try:
        for p in procs:
            p.start()
        yield procs
    finally:
        for p in procs:
            p.stop()


def wait_leader(procs: list[Replica], timeout: float = 30.0, among: list[Replica] | None = None) -> Replica:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in among or procs:
            if p.alive and p.ready():
                return p
        time.sleep(0.02)
    raise AssertionError("no replica became ready")


def labelled(kube: FakeKube) -> set[str]:
    """The replicas whose pod carries the leader label."""
    return {
        p["metadata"]["name"]
        for p in kube.list("pods")
        if p["metadata"].get("namespace") == NAMESPACE
        and (p["metadata"].get("labels") or {}).get(LEADER_LABEL) == "true"
    }


class Service:
    """Sends each call to a live replica whose pod has the leader label, like the ClusterIP Service
    of deploy/scheduler/service.yaml."""

    def __init__(self, procs: list[Replica], kube: FakeKube) -> None:
        self.procs = procs
        self.kube = kube
        self._ready: list[Replica] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            leaders = labelled(self.kube)
            self._ready = [p for p in self.procs if p.alive and p.name in leaders]
            self._stop.wait(0.02)

    def pick(self) -> Replica | None:
        ready = self._ready
        return ready[0] if ready else None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)


def schedule(rep: Replica, pod: dict[str, Any], nodes: list[str]) -> str:
    """One scheduling cycle through HTTP: 'bound', 'refused' (no node fits) or 'error: ...'."""
    filtered = rep.post("/filter", {"Pod": pod, "Nodes": None, "NodeNames": nodes})
    if filtered.get("Error"):
        return f"error: filter: {filtered['Error']}"
    fit = filtered.get("NodeNames") or []
    if not fit:
        return "refused"
    scores = {h["Host"]: h["Score"] for h in rep.post("/prioritize", {"Pod": pod, "Nodes": None, "NodeNames": fit})}
    best = max(fit, key=lambda n: (scores.get(n, 0), n))
    m = pod["metadata"]
    args = {"PodName": m["name"], "PodNamespace": m["namespace"], "PodUID": m["uid"], "Node": best}
    error = rep.post("/bind", args).get("Error")
    return f"error: bind: {error}" if error else "bound"


@dataclass
class Burst:
    bound: int = 0
    refused: int = 0
    failed: list[str] = field(default_factory=list)  # pods never bound nor refused before the deadline
    retries: int = 0  # cycles that answered an error or hit a dead replica and were tried again
    errors_seen: dict[str, int] = field(default_factory=dict)  # first words of each error, counted
    seconds: float = 0.0


def burst(
    kube: FakeKube, service: Service, pods: list[dict[str, Any]], nodes: list[str], workers: int, deadline: float
) -> Burst:
    """Schedule every pod, retrying through whichever replica is ready, until `deadline` (monotonic).
    Before a retry the pod is looked up: one whose bind went through although its answer was lost
    (the replica died mid-reply) is bound, and kube-scheduler's informer drops it from the queue."""
    out = Burst()
    lock = threading.Lock()
    started = time.monotonic()

    def one(pod: dict[str, Any]) -> None:
        m = pod["metadata"]
        while time.monotonic() < deadline:
            if kube.get("pods", m["name"], m["namespace"])["spec"].get("nodeName"):
                with lock:
                    out.bound += 1
                return
            rep = service.pick()
            if rep is None:
                time.sleep(0.02)
                continue
            try:
                outcome = schedule(rep, pod, nodes)
            except OSError as e:
                outcome = f"error: {type(e).__name__}"
            if outcome in ("bound", "refused"):
                with lock:
                    out.bound += outcome == "bound"
                    out.refused += outcome == "refused"
                return
            with lock:
                out.retries += 1
                key = " ".join(outcome.split()[:4])
                out.errors_seen[key] = out.errors_seen.get(key, 0) + 1
            time.sleep(0.05)
        with lock:
            out.failed.append(pod["metadata"]["name"])

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, pods))
    out.seconds = time.monotonic() - started
    return out


def time_to_ready(procs: list[Replica], since: float, timeout: float) -> float:
    """Seconds from `since` (monotonic) until a live replica answers /readyz 200."""
    while time.monotonic() - since < timeout:
        if any(p.alive and p.ready(0.2) for p in procs):
            return time.monotonic() - since
        time.sleep(0.02)
    raise AssertionError(f"no replica ready {timeout} s after the leader's loss")


def make_pods(kube: FakeKube, count: int, resources: dict[str, str], prefix: str = "p") -> list[dict[str, Any]]:
    return [
        kube.create(
            "pods",
            {
                "metadata": {"name": f"{prefix}{i:04d}", "namespace": "ha"},
                "spec": {
                    "containers": [
                        {"name": "main", "image": "x", "resources": {"limits": resources, "requests": resources}}
                    ]
                },
            },
        )
        for i in range(count)
    ]
