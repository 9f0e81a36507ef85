"""Server CPU per mutual-TLS connection with `crihook scheduler`'s TLS context, and what each part costs.

    taskset -c 0 .venv/bin/python bench/tls_handshake_cpu.py [--key ec|rsa] [--handshakes 500]

A client in another process connects as Go's clients do (TCP_NODELAY, no TLS session reused), sends
GET /healthz, reads the answer and closes; the server's process CPU is counted. Run it pinned to one
core: two processes running at once on two cores inflate each other's CPU time. Variants, taking
turns over three rounds (median shown); all but the last answer from a bare loop on one thread:

- crihook: server.TlsFiles.context(), client certificates required, no session tickets;
- tickets: the same with OpenSSL's default two TLS 1.3 tickets per handshake (the server before);
- tls1.2: crihook's context with the client held to TLS 1.2;
- no client cert: no client certificate asked for or verified (a reference, not an option);
- server: crihook's context in scheduler/server.py's Server (selector, worker pool, HTTP parsing);
- pyopenssl: crihook's settings through pyOpenSSL, on the OpenSSL the `cryptography` wheel bundles
  (newer than the system's, which the stdlib uses); only when pyOpenSSL is installed
  (`.venv/bin/pip install pyopenssl`). It cannot turn TLS 1.3 tickets off, only OP_NO_TICKET.
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
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from crihook.scheduler import server, webhook
from crihook.scheduler.extender import Extender
from crihook.scheduler.plugin import DeviceShare
from tests.support.tlsburst import Certs, make_certs

GET = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


# a server-side TLS connection: the object to talk through, and how to close it
Wrap = Callable[[socket.socket], tuple[Any, Callable[[], None]]]


def stdlib(ctx: ssl.SSLContext) -> Wrap:
    def wrap(sock: socket.socket) -> tuple[Any, Callable[[], None]]:
        s = ctx.wrap_socket(sock, server_side=True)
        return s, s.close

    return wrap


def pyopenssl(c: Certs) -> Wrap | None:
    """crihook's TLS settings through pyOpenSSL, or None without it."""
    try:
        from OpenSSL import SSL
    except ImportError:
        return None
    ctx = SSL.Context(SSL.TLS_SERVER_METHOD)
    ctx.use_certificate_chain_file(c.server_cert)
    ctx.use_privatekey_file(c.server_key)
    ctx.load_verify_locations(c.ca)
    ctx.set_verify(SSL.VERIFY_PEER | SSL.VERIFY_FAIL_IF_NO_PEER_CERT)
    ctx.set_options(SSL.OP_NO_TICKET)

    def wrap(sock: socket.socket) -> tuple[Any, Callable[[], None]]:
        conn = SSL.Connection(ctx, sock)
        conn.set_accept_state()
        conn.do_handshake()
        return conn, sock.close

    return wrap


def contexts(c: Certs) -> dict[str, tuple[Callable[[], Wrap], ssl.TLSVersion]]:
    files = server.TlsFiles(c.server_cert, c.server_key, c.ca)

    def tickets() -> ssl.SSLContext:
        ctx = files.context()
        ctx.num_tickets = 2
        ctx.options &= ~ssl.OP_NO_TICKET
        return ctx

    def no_client_cert() -> ssl.SSLContext:
        return server.TlsFiles(c.server_cert, c.server_key).context()

    v13, v12 = ssl.TLSVersion.TLSv1_3, ssl.TLSVersion.TLSv1_2
    out: dict[str, tuple[Callable[[], Wrap], ssl.TLSVersion]] = {
        "crihook": (lambda: stdlib(files.context()), v13),
        "tickets": (lambda: stdlib(tickets()), v13),
        "tls1.2": (lambda: stdlib(files.context()), v12),
        "no client cert": (lambda: stdlib(no_client_cert()), v13),
    }
    other = pyopenssl(c)
    if other is not None:
        out["pyopenssl"] = (lambda: other, v13)
    return out


def client(port: int, certs: Certs, version: ssl.TLSVersion, n: int, out: multiprocessing.Queue[float]) -> None:
    ctx = certs.client_context()
    ctx.maximum_version = version
    t0 = time.process_time()
    for _ in range(n):
        raw = socket.create_connection(("127.0.0.1", port))
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
            s.sendall(GET)
            buf = b""
            while not buf.endswith(b"ok\n"):
                buf += s.recv(4096)
    out.put(time.process_time() - t0)


def clients(port: int, certs: Certs, version: ssl.TLSVersion, n: int) -> Callable[[], float]:
    """Starts the client process; the returned call waits for it and gives its CPU seconds."""
    q: multiprocessing.Queue[float] = multiprocessing.Queue()
    proc = multiprocessing.Process(target=client, args=(port, certs, version, n, q))
    proc.start()

    def done() -> float:
        cpu = q.get()
        proc.join()
        return cpu

    return done


def measure(wrap: Wrap, certs: Certs, version: ssl.TLSVersion, n: int) -> tuple[float, float]:
    """(server, client) CPU milliseconds per connection, the server a bare loop on this thread."""
    answer = server.response(200, b"ok\n", server.TEXT, True)
    with socket.socket() as ls:
        ls.bind(("127.0.0.1", 0))
        ls.listen(128)
        done = clients(ls.getsockname()[1], certs, version, n)
        t0 = time.process_time()
        for _ in range(n):
            sock, _ = ls.accept()
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s, close = wrap(sock)
            try:
                buf = b""
                while b"\r\n\r\n" not in buf:
                    buf += s.recv(4096)
                s.sendall(answer)
                s.recv(1)  # the client closes
            except Exception as e:  # pyOpenSSL reports the client's close as an error
                if "OpenSSL" not in type(e).__module__:
                    raise
            finally:
                close()
        cpu = time.process_time() - t0
        return cpu / n * 1000, done() / n * 1000


def measure_server(files: server.TlsFiles, certs: Certs, n: int) -> tuple[float, float]:
    """(server, client) CPU milliseconds per connection with scheduler/server.py's Server."""
    app = server.App(Extender(DeviceShare()), webhook.WebhookConfig(), lambda: True)
    srv = server.make_server(app, "127.0.0.1", 0, files)
    threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True).start()
    t0 = time.process_time()
    client_cpu = clients(srv.server_address[1], certs, ssl.TLSVersion.TLSv1_3, n)()
    time.sleep(0.2)  # the last connections' close
    cpu = time.process_time() - t0
    srv.shutdown()
    srv.server_close()
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
        got: dict[str, list[tuple[float, float]]] = {k: [] for k in [*variants, "server"]}
        for _ in range(args.rounds):
            for name, (make, version) in variants.items():
                got[name].append(measure(make(), certs, version, args.handshakes))
            files = server.TlsFiles(certs.server_cert, certs.server_key, certs.ca)
            got["server"].append(measure_server(files, certs, args.handshakes))
    cores = len(os.sched_getaffinity(0))
    print(f"{args.key} keys, {args.handshakes} handshakes x {args.rounds} rounds on {cores} core(s)", end="")
    print(f", load average {os.getloadavg()[0]:.1f}")
    print(f"{'variant':<15} {'server ms':>9} {'client ms':>9}   CPU per connection, median of rounds")
    for name, runs in got.items():
        srv, cli = (statistics.median(r[i] for r in runs) for i in (0, 1))
        print(f"{name:<15} {srv:9.3f} {cli:9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
