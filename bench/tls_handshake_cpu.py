"""Server CPU per mutual-TLS handshake with `crihook scheduler`'s TLS context, and what each part costs.

    taskset -c 0 .venv/bin/python bench/tls_handshake_cpu.py [--key ec|rsa] [--handshakes 500]

A server thread accepts, handshakes, reads one byte and answers one; a client in another process
connects as Go's clients do (TCP_NODELAY, no TLS session reused). Run it pinned to one core: two
processes running at once on two cores inflate each other's CPU time, and the handshake's client half
is not what is measured. Variants, each taking turns over three rounds (median shown):

- crihook: server.TlsFiles.context(), client certificates required, no session tickets;
- tickets: the same with OpenSSL's default two TLS 1.3 tickets per handshake (the server before);
- tls1.2: crihook's context with the client held to TLS 1.2;
- no client cert: no client certificate asked for or verified (a reference, not an option).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import ssl
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from crihook.scheduler import server
from tests.support.tlsburst import Certs, make_certs


def contexts(c: Certs) -> dict[str, tuple[Callable[[], ssl.SSLContext], ssl.TLSVersion]]:
    files = server.TlsFiles(c.server_cert, c.server_key, c.ca)

    def tickets() -> ssl.SSLContext:
        ctx = files.context()
        ctx.num_tickets = 2
        ctx.options &= ~ssl.OP_NO_TICKET
        return ctx

    def no_client_cert() -> ssl.SSLContext:
        return server.TlsFiles(c.server_cert, c.server_key).context()

    v13, v12 = ssl.TLSVersion.TLSv1_3, ssl.TLSVersion.TLSv1_2
    return {
        "crihook": (files.context, v13),
        "tickets": (tickets, v13),
        "tls1.2": (files.context, v12),
        "no client cert": (no_client_cert, v13),
    }


def client(port: int, certs: Certs, version: ssl.TLSVersion, n: int, out: multiprocessing.Queue[float]) -> None:
    ctx = certs.client_context()
    ctx.maximum_version = version
    t0 = time.process_time()
    for _ in range(n):
        raw = socket.create_connection(("127.0.0.1", port))
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
            s.sendall(b"x")
            s.recv(1)
    out.put(time.process_time() - t0)


def measure(ctx: ssl.SSLContext, certs: Certs, version: ssl.TLSVersion, n: int) -> tuple[float, float]:
    """(server, client) CPU milliseconds per handshake."""
    with socket.socket() as ls:
        ls.bind(("127.0.0.1", 0))
        ls.listen(128)
        q: multiprocessing.Queue[float] = multiprocessing.Queue()
        proc = multiprocessing.Process(target=client, args=(ls.getsockname()[1], certs, version, n, q))
        proc.start()
        cpu = 0.0
        for _ in range(n):
            sock, _ = ls.accept()
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t0 = time.thread_time()
            with ctx.wrap_socket(sock, server_side=True) as s:
                s.recv(1)
                s.sendall(b"y")
                cpu += time.thread_time() - t0
        client_cpu = q.get()
        proc.join()
    return cpu / n * 1000, client_cpu / n * 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--key", choices=("rsa", "ec"), default="ec")
    ap.add_argument("--handshakes", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        certs = make_certs(Path(d), args.key)
        variants = contexts(certs)
        got: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
        for _ in range(args.rounds):
            for name, (make, version) in variants.items():
                got[name].append(measure(make(), certs, version, args.handshakes))
    cores = len(os.sched_getaffinity(0))
    print(f"{args.key} keys, {args.handshakes} handshakes x {args.rounds} rounds on {cores} core(s)", end="")
    print(f", load average {os.getloadavg()[0]:.1f}")
    print(f"{'variant':<15} {'server ms':>9} {'client ms':>9}   CPU per handshake, median of rounds")
    for name, runs in got.items():
        srv, cli = (statistics.median(r[i] for r in runs) for i in (0, 1))
        print(f"{name:<15} {srv:9.3f} {cli:9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
