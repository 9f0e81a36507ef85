"""The scheduler's serving stack, side by side in one run: bursts of AdmissionReviews over new mutual-TLS
connections, extender filter+prioritize latency at 1,000 and 5,000 nodes, and memory.

    .venv/bin/python bench/serving_bench.py [--stacks crihook,stdlib-5,aiohttp,uvicorn] [--key rsa|ec]
    (aiohttp comes with the kubernetes client; uvicorn: .venv/bin/pip install uvicorn httptools)

Every stack serves the same `server.App` (the same verbs, JSON handling and /metrics counting) in a
process of its own, with the same TLS context (client certificates required) and a listen backlog
of 4,096, so only the serving differs:

- crihook: scheduler/server.py (selector thread, bounded pool of worker threads);
- stdlib-5: http.server's ThreadingHTTPServer as the scheduler used it before (backlog 5);
- aiohttp and uvicorn (ASGI, uvloop, httptools): one event loop, the verbs run on it.

A burst is what the API server does when a Deployment scales up: many pods created at once, each
an AdmissionReview, spread over connections it opens for the purpose (Go's client reuses no TLS
session, so every connection is a full handshake). All connections start together; a request's
latency runs from the moment its client is ready to send it (for the first one on a connection,
before connect()) to the last byte of the answer. A failure is an error, a timeout (5 s, the
webhooks' timeoutSeconds) or a wrong answer. The client runs in this process on threads, so it
shares the machine's cores with the server: compare stacks within one run, not across machines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from extender_bench import SHAPES, loaded_cluster, pct, pod

from crihook.scheduler import server, webhook
from crihook.scheduler.extender import Extender
from tests.support.tlsburst import Certs, burst, connect, http_request, make_certs, read_response

ROOT = Path(__file__).resolve().parent.parent
BACKLOG = 4096
BURSTS = ((500, 50), (2000, 400))
STACKS = ("crihook", "stdlib-5", "aiohttp", "uvicorn")


# --- the server side: one stack in a child process -------------------------------------------------


def serve_stdlib5(app: server.App, tls: server.TlsFiles, ready: Callable[[int], None]) -> None:
    """The scheduler's server before: ThreadingHTTPServer, backlog 5, handshake on each connection's thread."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = server.IDLE_TIMEOUT

        def log_message(self, *_: Any) -> None:
            pass

        def _send(self, answer: server.Answer) -> None:
            code, body, ctype = answer
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            self._send(app.get(self.path))

        def do_POST(self) -> None:
            self._send(app.post(self.path, self.rfile.read(int(self.headers["Content-Length"]))))

    ctx = tls.context()

    class Server(ThreadingHTTPServer):
        daemon_threads = True

        def finish_request(self, request: Any, client_address: Any) -> None:
            request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            request.settimeout(server.HANDSHAKE_TIMEOUT)
            try:
                request = ctx.wrap_socket(request, server_side=True)
            except OSError:
                return
            super().finish_request(request, client_address)

    srv = Server(("127.0.0.1", 0), Handler)
    ready(srv.server_address[1])
    srv.serve_forever()


def serve_aiohttp(app: server.App, tls: server.TlsFiles, ready: Callable[[int], None]) -> None:
    import uvloop
    from aiohttp import web

    async def handle(request: web.Request) -> web.Response:
        if request.method == "POST":
            code, body, ctype = app.post(request.path, await request.read())
        else:
            code, body, ctype = app.get(request.path)
        return web.Response(status=code, body=body, headers={"Content-Type": ctype})

    async def main() -> None:
        web_app = web.Application(client_max_size=server.MAX_BODY)
        web_app.router.add_route("*", "/{tail:.*}", handle)
        runner = web.AppRunner(web_app, access_log=None, keepalive_timeout=server.IDLE_TIMEOUT)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls.context(), backlog=BACKLOG)
        await site.start()
        ready(runner.addresses[0][1])
        await asyncio.Event().wait()

    uvloop.run(main())


def serve_uvicorn(app: server.App, tls: server.TlsFiles, ready: Callable[[int], None]) -> None:
    import uvicorn

    async def asgi(scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        if scope["method"] == "POST":
            code, out, ctype = app.post(scope["path"], body)
        else:
            code, out, ctype = app.get(scope["path"])
        headers = [(b"content-type", ctype.encode()), (b"content-length", str(len(out)).encode())]
        await send({"type": "http.response.start", "status": code, "headers": headers})
        await send({"type": "http.response.body", "body": out})

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(BACKLOG)
    config = uvicorn.Config(
        asgi,
        ssl_certfile=tls.cert,
        ssl_keyfile=tls.key,
        ssl_ca_certs=tls.client_ca,
        ssl_cert_reqs=ssl.CERT_REQUIRED,
        backlog=BACKLOG,
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_keep_alive=int(server.IDLE_TIMEOUT),
    )
    ready(sock.getsockname()[1])
    uvicorn.Server(config).run(sockets=[sock])


def serve_crihook(app: server.App, tls: server.TlsFiles, ready: Callable[[int], None]) -> None:
    srv = server.make_server(app, "127.0.0.1", 0, tls)
    ready(srv.server_address[1])
    srv.serve_forever()


SERVE = {"crihook": serve_crihook, "stdlib-5": serve_stdlib5, "aiohttp": serve_aiohttp, "uvicorn": serve_uvicorn}


def cert_files(d: str) -> Certs:
    return Certs(*(str(Path(d) / n) for n in ("ca.crt", "server.crt", "server.key", "client.crt", "client.key")))


def child(stack: str, nodes: int, certs: Certs) -> None:
    plugin, _ = loaded_cluster(nodes, 8)
    app = server.App(Extender(plugin), webhook.WebhookConfig(), lambda: True)

    def ready(port: int) -> None:
        print(f"PORT {port}", flush=True)

    SERVE[stack](app, server.TlsFiles(certs.server_cert, certs.server_key, certs.ca), ready)


class Child:
    """One stack serving `nodes` nodes in its own process; memory and CPU read from /proc."""

    def __init__(self, stack: str, nodes: int, certdir: str) -> None:
        self.stack = stack
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--child", stack, "--nodes", str(nodes), "--certdir", certdir],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("PORT "):
            raise RuntimeError(f"{stack} did not start")
        self.port = int(line.split()[1])

    def wait_serving(self, ctx: ssl.SSLContext) -> None:
        """Until a GET /healthz is answered: a stack may report its port before it serves."""
        deadline = time.monotonic() + 30
        while True:
            try:
                with connect(self.port, ctx) as s:
                    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                    if read_response(s, bytearray())[0] == 200:
                        return
            except OSError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.1)

    def status(self, field: str) -> float:
        """VmRSS or VmHWM in MiB."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
        raise KeyError(field)

    def cpu(self) -> float:
        """Seconds of CPU the process used (user + system)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


# --- the client side -------------------------------------------------------------------------------


def extender_calls(port: int, ctx: ssl.SSLContext, nodes: int, requests: int, prefix: str = "bench") -> list[float]:
    """filter then prioritize over the nodes that passed, one kept-alive connection (kube-scheduler's)."""
    names = [f"node-{i:05d}" for i in range(nodes)]
    sock = connect(port, ctx, 30)
    buf = bytearray()
    out = []
    for i in range(requests + 5):
        p = pod(f"{prefix}-{i}", SHAPES[i % len(SHAPES)])
        t0 = time.perf_counter()
        sock.sendall(http_request("/filter", json.dumps({"Pod": p, "Nodes": None, "NodeNames": names}).encode()))
        code, body = read_response(sock, buf)
        fit = json.loads(body)["NodeNames"] or []
        sock.sendall(http_request("/prioritize", json.dumps({"Pod": p, "Nodes": None, "NodeNames": fit}).encode()))
        code2, _ = read_response(sock, buf)
        if code != 200 or code2 != 200:
            raise RuntimeError(f"extender answered {code}/{code2}")
        if i >= 5:  # the first few warm the caches
            out.append(time.perf_counter() - t0)
    sock.close()
    return out


def interleaved(children: dict[str, Child], ctx: ssl.SSLContext, nodes: int, requests: int) -> dict[str, list[float]]:
    """Extender cycles in chunks of 25, stacks taking turns, so a busy moment of the machine hits all."""
    out: dict[str, list[float]] = {s: [] for s in children}
    for chunk in range(0, requests, 25):
        for stack, c in children.items():
            out[stack] += extender_calls(c.port, ctx, nodes, min(25, requests - chunk), f"c{chunk}")
    return out


@dataclass
class Round:
    latencies: list[float]
    failed: int
    server_cpu: float  # seconds
    client_cpu: float


def burst_line(label: str, runs: list[Round]) -> str:
    """Median over rounds of p50, p99 and max; failures summed; mean server and client CPU."""
    med = [statistics.median(pct(r.latencies, q) for r in runs) * 1000 for q in (0.5, 0.99, 1.0)]
    fails = sum(r.failed for r in runs)
    cpu = statistics.mean(r.server_cpu for r in runs)
    client = statistics.mean(r.client_cpu for r in runs)
    return f"{label} {med[0]:7.1f} {med[1]:7.1f} {med[2]:7.1f} {fails:>5} {cpu:9.2f} {client:9.2f}"


def run_burst(c: Child, certs: Certs, requests: int, conns: int) -> Round:
    cpu0 = c.cpu()
    res = burst(c.port, certs, requests, conns)
    if res.failures:
        print(f"  {c.stack}: {len(res.failures)} failed, first: {res.failures[0]}", flush=True)
    return Round(res.latencies, len(res.failures), c.cpu() - cpu0, res.client_cpu)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stacks", default=",".join(STACKS))
    ap.add_argument("--key", choices=("rsa", "ec"), default="rsa", help="certificate keys: RSA 2048 or ECDSA P-256")
    ap.add_argument("--nodes", default="1000,5000", help="extender cluster sizes (8 GPUs per node)")
    ap.add_argument("--requests", type=int, default=200, help="extender filter+prioritize cycles per size")
    ap.add_argument("--rounds", type=int, default=3, help="bursts per stack, stacks taking turns")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    ap.add_argument("--certdir", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = [int(n) for n in args.nodes.split(",") if n]
    if args.child:
        child(args.child, sizes[0], cert_files(args.certdir))
        return 0
    stacks = [s for s in args.stacks.split(",") if s]
    with tempfile.TemporaryDirectory() as d:
        certs = make_certs(Path(d), args.key)
        ctx = certs.client_context()
        print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; {args.key} keys; mutual TLS")
        children = {s: Child(s, sizes[0], d) for s in stacks}
        try:
            for c in children.values():
                c.wait_serving(ctx)
            rss0 = {s: c.status("VmRSS") for s, c in children.items()}
            runs: dict[tuple[str, int, int], list[Round]] = {}
            for r in range(args.rounds):  # stacks take turns, so a busy minute on the machine hits all
                for stack in stacks[r % len(stacks) :] + stacks[: r % len(stacks)]:
                    for requests, conns in BURSTS:
                        runs.setdefault((stack, requests, conns), []).append(
                            run_burst(children[stack], certs, requests, conns)
                        )
            grown = {s: c.status("VmHWM") - rss0[s] for s, c in children.items()}
            ext = {s: {sizes[0]: v} for s, v in interleaved(children, ctx, sizes[0], args.requests).items()}
        finally:
            for c in children.values():
                c.stop()
        mixed: dict[str, list[Round]] = {}
        for n in sizes[1:]:
            children = {s: Child(s, n, d) for s in stacks}
            try:
                for c in children.values():
                    c.wait_serving(ctx)
                for stack, v in interleaved(children, ctx, n, args.requests).items():
                    ext[stack][n] = v
                for stack, c in children.items():
                    # a burst of pod creations while kube-scheduler is filtering on the same server
                    calls = threading.Thread(target=extender_calls, args=(c.port, ctx, n, 40, "mixed"))
                    calls.start()
                    mixed[stack] = [run_burst(c, certs, 500, 50)]
                    calls.join()
            finally:
                for c in children.values():
                    c.stop()
    print(f"\nbursts: median of {args.rounds} rounds")
    print(f"{'stack':<9} {'burst':>13} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7} {'fail':>5}", end="")
    print(f" {'srv CPU s':>9} {'cli CPU s':>9}")
    for (stack, requests, conns), r in runs.items():
        print(burst_line(f"{stack:<9} {requests:>5} over {conns:>3}", r))
    for stack, r in mixed.items():
        print(burst_line(f"{stack:<9} 500/50+ext{sizes[-1]}", r))
    print(f"\n{'stack':<9} {'RSS MiB':>8} {'burst +MiB':>10}  extender filter+prioritize p50 / p99 ms")
    for stack in stacks:
        figures = "   ".join(
            f"{n} nodes {statistics.median(v) * 1000:5.1f} / {pct(v, 0.99) * 1000:5.1f}" for n, v in ext[stack].items()
        )
        print(f"{stack:<9} {rss0[stack]:8.0f} {grown[stack]:10.1f}  {figures}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
