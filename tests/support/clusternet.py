"""Service addresses and names for the test cluster, with no kube-proxy, iptables or CoreDNS:

    python -m tests.support.clusternet --kubeconfig K --bridge BR --dns IP

run by tests/support/cluster.py as one of the cluster's components. Every second it reads the
Services and EndpointSlices and, for each TCP port of a Service with a ClusterIP, puts the ClusterIP
on the cluster's bridge and relays connections to it to a ready endpoint (what kube-proxy's
userspace mode did); and it answers DNS queries on `IP:53` for `<service>.<namespace>.svc.cluster.local`
with the ClusterIP (what CoreDNS does for a ClusterIP Service), NXDOMAIN for anything else. The
`kubernetes` Service is left alone: kube-apiserver listens on its ClusterIP itself.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import struct
import subprocess
import threading
import time
from dataclasses import dataclass, field

from kubernetes.client import CoreV1Api, DiscoveryV1Api
from kubernetes.config import new_client_from_config

DOMAIN = "svc.cluster.local"
TYPE_A = 1
RCODE_NXDOMAIN = 3


Backends = dict[tuple[str, int], list[tuple[str, int]]]  # (ClusterIP, port) -> ready (address, port)


@dataclass
class Table:
    """What the Services say now: name -> ClusterIP, and (ClusterIP, port) -> ready endpoints."""

    names: dict[str, str] = field(default_factory=dict)
    backends: Backends = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def address(self, name: str) -> str | None:
        with self.lock:
            return self.names.get(name.rstrip(".").lower())

    def backend(self, ip: str, port: int) -> tuple[str, int] | None:
        with self.lock:
            ready = self.backends.get((ip, port), [])
        return ready[0] if ready else None


def read_table(core: CoreV1Api, discovery: DiscoveryV1Api) -> tuple[dict[str, str], Backends]:
    names: dict[str, str] = {}
    backends: Backends = {}
    slices: dict[tuple[str, str], list[object]] = {}
    for s in discovery.list_endpoint_slice_for_all_namespaces().items:
        owner = (s.metadata.labels or {}).get("kubernetes.io/service-name")
        if owner:
            slices.setdefault((s.metadata.namespace, owner), []).append(s)
    for svc in core.list_service_for_all_namespaces().items:
        ns, name, ip = svc.metadata.namespace, svc.metadata.name, svc.spec.cluster_ip
        if not ip or ip == "None" or (ns, name) == ("default", "kubernetes"):
            continue
        names[f"{name}.{ns}.{DOMAIN}"] = ip
        for port in svc.spec.ports or []:
            if port.protocol != "TCP":
                continue
            ready = []
            for s in slices.get((ns, name), []):
                target = next((p.port for p in s.ports or [] if p.name == port.name), None)  # type: ignore[attr-defined]
                for ep in s.endpoints or []:  # type: ignore[attr-defined]
                    if target is not None and (ep.conditions is None or ep.conditions.ready is not False):
                        ready += [(a, target) for a in ep.addresses]
            backends[(ip, port.port)] = ready
    return names, backends


# ---------------------------------------------------------------- DNS


def dns_answer(query: bytes, table: Table) -> bytes | None:
    """The reply to one DNS query (RFC 1035): the A record of a known Service name, an empty answer
    for its other types, NXDOMAIN otherwise; None for what is not a query."""
    if len(query) < 12:
        return None
    ident, flags, qdcount = struct.unpack("!HHH", query[:6])
    if flags & 0x8000 or qdcount != 1:
        return None
    labels, at = [], 12
    while at < len(query) and query[at] != 0:
        length = query[at]
        labels.append(query[at + 1 : at + 1 + length].decode(errors="replace"))
        at += 1 + length
    question_end = at + 5
    if question_end > len(query):
        return None
    qtype = struct.unpack("!H", query[at + 1 : at + 3])[0]
    question = query[12:question_end]
    ip = table.address(".".join(labels))
    rcode = 0 if ip is not None else RCODE_NXDOMAIN
    answers = b""
    if ip is not None and qtype == TYPE_A:
        # a pointer to the question's name, type A, class IN, TTL 5, the address
        answers = struct.pack("!HHHIH", 0xC00C, TYPE_A, 1, 5, 4) + socket.inet_aton(ip)
    header = struct.pack("!HHHHHH", ident, 0x8180 | rcode, 1, 1 if answers else 0, 0, 0)
    return header + question + answers


def serve_dns(ip: str, table: Table) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((ip, 53))
    while True:
        query, peer = sock.recvfrom(512)
        reply = dns_answer(query, table)
        if reply is not None:
            sock.sendto(reply, peer)


# ---------------------------------------------------------------- relays


def _pump(src: socket.socket, dst: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := src.recv(65536):
            dst.sendall(data)
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)


def relay(listener: socket.socket, ip: str, port: int, table: Table) -> None:
    while True:
        client, _ = listener.accept()
        target = table.backend(ip, port)
        if target is None:
            client.close()
            continue
        try:
            upstream = socket.create_connection(target, timeout=5)
        except OSError:
            client.close()
            continue
        upstream.settimeout(None)
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=_pump, args=(a, b), daemon=True).start()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kubeconfig", required=True)
    p.add_argument("--bridge", required=True)
    p.add_argument("--dns", required=True, help="the address to answer DNS on (port 53)")
    args = p.parse_args()
    api = new_client_from_config(args.kubeconfig)
    core, discovery = CoreV1Api(api), DiscoveryV1Api(api)
    table = Table()
    threading.Thread(target=serve_dns, args=(args.dns, table), daemon=True).start()
    listening: set[tuple[str, int]] = set()
    while True:
        try:
            names, backends = read_table(core, discovery)
        except Exception as e:  # the API server restarting: keep the last table
            print(f"clusternet: reading Services failed: {e}", flush=True)
            time.sleep(1)
            continue
        with table.lock:
            table.names, table.backends = names, backends
        for ip, port in set(backends) - listening:
            subprocess.run(["ip", "addr", "replace", f"{ip}/32", "dev", args.bridge], check=True)
            listener = socket.socket()
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((ip, port))
            listener.listen(64)
            threading.Thread(target=relay, args=(listener, ip, port, table), daemon=True).start()
            listening.add((ip, port))
            print(f"clusternet: relaying {ip}:{port}", flush=True)
        time.sleep(1)


if __name__ == "__main__":
    main()
