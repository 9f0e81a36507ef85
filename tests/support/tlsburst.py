"""Certificates and a burst client for `crihook scheduler`: AdmissionReviews over many new mutual-TLS
connections at once, as the API server sends them when a Deployment scales up.

The API server's webhook client (Go's net/http) opens a connection per concurrent call it has no
idle connection for, reuses no TLS session (full handshake each time) and keeps connections alive
between calls, but dials again after an answer that says `Connection: close` (what a replica that
is not ready sends, scheduler/server.py). Used by tests/scheduler/test_server.py and bench/serving_bench.py.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import ssl
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REVIEW = json.loads((Path(__file__).parent / "fixtures" / "extender" / "admission_create.json").read_text())
TIMEOUT = 5.0  # the webhooks' timeoutSeconds in deploy/scheduler/webhooks.yaml


def openssl(*args: Any) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)


def new_key(key: str) -> list[str]:
    return ["-newkey", "rsa:2048"] if key == "rsa" else ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256"]


def make_ca(d: Path, name: str, key: str = "rsa") -> tuple[Path, Path]:
    crt, k = d / f"{name}.crt", d / f"{name}.key"
    openssl("req", "-x509", *new_key(key), "-nodes", "-keyout", k, "-out", crt, "-days", "1", "-subj", f"/CN={name}")
    return crt, k


def make_cert(d: Path, name: str, ca: tuple[Path, Path], ext: str, key: str = "rsa") -> tuple[Path, Path]:
    """A certificate signed by `ca`; `ext` e.g. 'subjectAltName=IP:127.0.0.1' or 'extendedKeyUsage=clientAuth'."""
    crt, k, csr, extfile = d / f"{name}.crt", d / f"{name}.key", d / f"{name}.csr", d / f"{name}.ext"
    openssl("req", *new_key(key), "-nodes", "-keyout", k, "-out", csr, "-subj", f"/CN={name}")
    extfile.write_text(ext + "\n")
    openssl(
        "x509", "-req", "-in", csr, "-CA", ca[0], "-CAkey", ca[1], "-CAcreateserial", "-out", crt, "-days", "1",
        "-extfile", extfile,
    )  # fmt: skip
    return crt, k


@dataclass(frozen=True)
class Certs:
    ca: str  # signs both the server's and the client's certificate
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str

    def client_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.ca)
        ctx.load_cert_chain(self.client_cert, self.client_key)
        return ctx


def make_certs(d: Path, key: str = "rsa") -> Certs:
    ca = make_ca(d, "ca", key)
    srv = make_cert(d, "server", ca, "subjectAltName=IP:127.0.0.1", key)
    cli = make_cert(d, "client", ca, "extendedKeyUsage=clientAuth", key)
    return Certs(str(ca[0]), str(srv[0]), str(srv[1]), str(cli[0]), str(cli[1]))


def http_request(path: str, body: bytes, method: str = "POST") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    return f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes
    closes: bool  # the server said `Connection: close`: it closes after this answer


def read_answer(sock: socket.socket, buf: bytearray) -> Answer:
    """The next answer; `buf` carries bytes read past it."""
    while (end := buf.find(b"\r\n\r\n")) < 0:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("closed")
        buf += data
    head = bytes(buf[:end]).decode("latin-1").split("\r\n")
    fields = [(k.strip().lower(), v.strip().lower()) for k, _, v in (h.partition(":") for h in head[1:])]
    length = next((int(v) for k, v in fields if k == "content-length"), 0)
    del buf[: end + 4]
    while len(buf) < length:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("closed")
        buf += data
    body = bytes(buf[:length])
    del buf[:length]
    return Answer(int(head[0].split()[1]), body, ("connection", "close") in fields)


def read_response(sock: socket.socket, buf: bytearray) -> tuple[int, bytes]:
    """(status, body) of the next answer; `buf` carries bytes read past it."""
    answer = read_answer(sock, buf)
    return answer.status, answer.body


def connect(port: int, ctx: ssl.SSLContext, timeout: float = TIMEOUT) -> ssl.SSLSocket:
    sock = ctx.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout), server_hostname="127.0.0.1")
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def review(uid: str) -> bytes:
    r = json.loads(json.dumps(REVIEW))
    r["request"]["uid"] = uid
    return json.dumps(r).encode()


def check_review(i: int, code: int, body: bytes) -> str:
    """'' when the answer to review i is right (the pod in the fixture is admitted), else why not."""
    answer = json.loads(body)["response"] if code == 200 else {}
    if answer.get("uid") != f"uid-{i}" or answer.get("allowed") is not True:
        return f"request {i}: HTTP {code} {body[:120]!r}"
    return ""


@dataclass
class BurstResult:
    latencies: list[float] = field(default_factory=list)  # seconds, one per request
    failures: list[str] = field(default_factory=list)
    client_cpu: float = 0.0  # seconds of CPU the client processes spent, handshakes included


def _connections(port: int, certs: Certs, per_conn: list[list[int]], start_at: float) -> BurstResult:
    """One client process: a thread per connection, all starting at wall-clock `start_at`."""
    ctx = certs.client_context()
    out = BurstResult()
    cpu0 = time.process_time()

    def one(ids: list[int]) -> None:
        bodies = [(i, http_request("/mutate" if i % 2 else "/validate", review(f"uid-{i}"))) for i in ids]
        time.sleep(max(0.0, start_at - time.time()))
        ready = time.perf_counter()
        sock: ssl.SSLSocket | None = None
        buf = bytearray()
        for i, raw in bodies:
            try:
                if sock is None:
                    sock = connect(port, ctx)
                sock.sendall(raw)
                answer = read_answer(sock, buf)
                if why := check_review(i, answer.status, answer.body):
                    out.failures.append(why)
                if answer.closes:  # as Go's net/http: the next request dials again
                    sock.close()
                    sock, buf = None, bytearray()
            except (OSError, ValueError) as e:
                out.failures.append(f"request {i}: {e!r}")
                if sock is not None:
                    sock.close()
                sock, buf = None, bytearray()
            now = time.perf_counter()
            out.latencies.append(now - ready)
            ready = now
        if sock is not None:
            sock.close()

    threads = [threading.Thread(target=one, args=(ids,)) for ids in per_conn]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.client_cpu = time.process_time() - cpu0
    return out


def burst(port: int, certs: Certs, requests: int, connections: int, processes: int = 0) -> BurstResult:
    """`requests` AdmissionReviews (validate and mutate in turn) spread over `connections` new
    connections that all start together; client threads spread over `processes` processes (default:
    one per CPU) so the client's own GIL does not set the pace."""
    processes = processes or min(connections, os.cpu_count() or 1)
    per_conn = [list(range(c, requests, connections)) for c in range(connections)]
    start_at = time.time() + 0.5 + 0.002 * connections  # every thread is waiting by then
    jobs = [(port, certs, per_conn[p::processes], start_at) for p in range(processes)]
    if processes == 1:
        return _connections(*jobs[0])
    with multiprocessing.get_context("fork").Pool(processes) as pool:
        parts = pool.starmap(_connections, jobs)
    out = BurstResult()
    for p in parts:
        out.latencies += p.latencies
        out.failures += p.failures
        out.client_cpu += p.client_cpu
    return out
