"""The scheduler's serving stack under load: bursts of AdmissionReviews over new mutual-TLS connections,
extender filter+prioritize latency at 1,000 and 5,000 nodes, and memory.

    .venv/bin/python bench/serving_bench.py [--key rsa|ec] [--nodes 1000,5000] [--requests 200] [--rounds 3]
    git show REV:scheduler/server.py > other_server.py
    .venv/bin/python bench/serving_bench.py --nodes 1000 --rounds 7 --compare other_server.py

`scheduler/server.py` serves the scheduler's `server.App` (its verbs, JSON handling and /metrics
counting) in a process of its own, with a client certificate required, as `crihook scheduler` runs it.

A burst is what the API server does when a Deployment scales up: many pods created at once, each
an AdmissionReview, spread over connections it opens for the purpose (Go's client reuses no TLS
session, so every connection is a full handshake). All connections start together; a request's
latency runs from the moment its client is ready to send it (for the first one on a connection,
before connect()) to the last byte of the answer. A failure is an error, a timeout (5 s, the
webhooks' timeoutSeconds) or a wrong answer. The client runs in this process on threads, so it
shares the machine's cores with the server: the figures are this machine's, and the server's and
the client's CPU per burst are printed beside them.

`--compare FILE` serves another version of `scheduler/server.py` in a second process beside this
one and alternates the bursts between the two (the order swapped every round), so a change to the
server is measured side by side under the same load; the server's CPU per burst is the steadiest
figure on a shared machine. Each round's figures are printed, then the medians and ranges.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from extender_bench import SHAPES, loaded_cluster, pct, pod

from crihook.scheduler import server, webhook
from crihook.scheduler.extender import Extender
from tests.support.tlsburst import Certs, burst, connect, http_request, make_certs, read_response

ROOT = Path(__file__).resolve().parent.parent
BURSTS = ((500, 50), (2000, 400))


# --- the server side: a child process -------------------------------------------------


def cert_files(d: str) -> Certs:
    return Certs(*(str(Path(d) / n) for n in ("ca.crt", "server.crt", "server.key", "client.crt", "client.key")))


def server_module(path: str) -> ModuleType:
    """`scheduler/server.py`, or the version of it at `path`."""
    if not path:
        return server
    spec = importlib.util.spec_from_file_location("compared_server", path)
    assert spec is not None and spec.loader is not None
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up
    spec.loader.exec_module(module)
    return module


def child(nodes: int, certs: Certs, server_file: str) -> None:
    mod = server_module(server_file)
    plugin, _ = loaded_cluster(nodes, 8)
    app = mod.App(Extender(plugin), webhook.WebhookConfig(), lambda: True)
    srv = mod.make_server(app, "127.0.0.1", 0, mod.TlsFiles(certs.server_cert, certs.server_key, certs.ca))
    print(f"PORT {srv.server_address[1]}", flush=True)
    srv.serve_forever()


class Child:
    """The server with `nodes` nodes in its own process; memory and CPU read from /proc."""

    def __init__(self, nodes: int, certdir: str, server_file: str = "") -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--child",
                "--nodes",
                str(nodes),
                "--certdir",
                certdir,
                "--compare",
                server_file,
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("PORT "):
            raise RuntimeError("the server did not start")
        self.port = int(line.split()[1])

    def wait_serving(self, ctx: ssl.SSLContext) -> None:
        """Until a GET /healthz is answered: the port is reported before the server serves."""
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
        print(f"  {len(res.failures)} failed, first: {res.failures[0]}", flush=True)
    return Round(res.latencies, len(res.failures), c.cpu() - cpu0, res.client_cpu)


def compare(args: argparse.Namespace, nodes: int) -> None:
    """The bursts against this server and the one in `args.compare`, alternating; see the docstring."""
    runs: dict[tuple[str, int, int], list[Round]] = {}
    with tempfile.TemporaryDirectory() as d:
        certs = make_certs(Path(d), args.key)
        print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; {args.key} keys; mutual TLS")
        servers: dict[str, Child] = {}
        try:
            for label, path in (("this", ""), ("other", args.compare)):
                servers[label] = Child(nodes, d, path)
                servers[label].wait_serving(certs.client_context())
            for i in range(args.rounds):
                order = list(servers.items()) if i % 2 == 0 else list(servers.items())[::-1]
                for requests, conns in BURSTS:
                    for label, c in order:
                        r = run_burst(c, certs, requests, conns)
                        runs.setdefault((label, requests, conns), []).append(r)
                        print(burst_line(f"{label:>5} {requests:>4}/{conns:<3}", [r]), flush=True)
        finally:
            for c in servers.values():
                c.stop()
    print(f"\nmedian [range] of {args.rounds} rounds; server CPU s per burst")
    for (label, requests, conns), rs in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0] != "this")):
        cols = []
        for q in (0.5, 0.99):
            v = [pct(r.latencies, q) * 1000 for r in rs]
            cols.append(f"p{round(q * 100)} {statistics.median(v):6.1f} [{min(v):.1f}-{max(v):.1f}] ms")
        cpu = [r.server_cpu for r in rs]
        fails = sum(r.failed for r in rs)
        line = f"{label:>5} {requests:>4} over {conns:<3} {'  '.join(cols)}"
        print(f"{line}  cpu {statistics.median(cpu):.3f} [{min(cpu):.2f}-{max(cpu):.2f}]  failed {fails}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--key", choices=("rsa", "ec"), default="rsa", help="certificate keys: RSA 2048 or ECDSA P-256")
    ap.add_argument("--nodes", default="1000,5000", help="extender cluster sizes (8 GPUs per node)")
    ap.add_argument("--requests", type=int, default=200, help="extender filter+prioritize cycles per size")
    ap.add_argument("--rounds", type=int, default=3, help="bursts of each size")
    ap.add_argument("--compare", default="", metavar="FILE", help="another scheduler/server.py, bursts alternating")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--certdir", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = [int(n) for n in args.nodes.split(",") if n]
    if args.child:
        child(sizes[0], cert_files(args.certdir), args.compare)
        return 0
    if args.compare:
        compare(args, sizes[0])
        return 0
    runs: dict[tuple[int, int], list[Round]] = {}
    ext: dict[int, list[float]] = {}
    mixed: list[Round] = []
    with tempfile.TemporaryDirectory() as d:
        certs = make_certs(Path(d), args.key)
        ctx = certs.client_context()
        print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; {args.key} keys; mutual TLS")
        c = Child(sizes[0], d)
        try:
            c.wait_serving(ctx)
            rss0 = c.status("VmRSS")
            for _ in range(args.rounds):
                for requests, conns in BURSTS:
                    runs.setdefault((requests, conns), []).append(run_burst(c, certs, requests, conns))
            grown = c.status("VmHWM") - rss0
            ext[sizes[0]] = extender_calls(c.port, ctx, sizes[0], args.requests)
        finally:
            c.stop()
        for n in sizes[1:]:
            c = Child(n, d)
            try:
                c.wait_serving(ctx)
                ext[n] = extender_calls(c.port, ctx, n, args.requests)
                # a burst of pod creations while kube-scheduler is filtering on the same server
                calls = threading.Thread(target=extender_calls, args=(c.port, ctx, n, 40, "mixed"))
                calls.start()
                mixed.append(run_burst(c, certs, 500, 50))
                calls.join()
            finally:
                c.stop()
    print(f"\nbursts: median of {args.rounds} rounds")
    print(f"{'burst':>14} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7} {'fail':>5} {'srv CPU s':>9} {'cli CPU s':>9}")
    for (requests, conns), r in runs.items():
        print(burst_line(f"{requests:>5} over {conns:>3} ", r))
    if mixed:
        print(burst_line(f"500/50+ext{sizes[-1]:<4}", mixed))
    print(f"\nRSS {rss0:.0f} MiB, {grown:.1f} MiB more after the bursts")
    for n, v in ext.items():
        p50, p99 = statistics.median(v) * 1000, pct(v, 0.99) * 1000
        print(f"extender filter+prioritize, {n} nodes: p50 / p99 {p50:5.1f} / {p99:5.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
