"""`crihook scheduler`: the extender and the admission webhook over HTTP(S).

POST /filter, /prioritize, /bind (kube-scheduler), POST /mutate, /validate (the API server's
admission webhooks), GET /healthz (the process serves), /readyz (the cluster cache is loaded) and
/metrics (Prometheus: requests by path and status, time to answer).

TLS comes from certificate and key files; with `--client-ca` callers must present a certificate
signed by it. Plain HTTP is for loopback only (kube-scheduler beside us in one pod): a plain
listener on any other address is refused unless `--insecure-allow-plain-http` says so, because
anyone who can reach /bind can place pods.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from crihook import log as crihook_log
from crihook import metrics
from crihook.metrics import is_loopback, parse_listen
from crihook.scheduler import webhook
from crihook.scheduler.extender import BadRequest, Extender
from crihook.scheduler.plugin import DeviceShare, PluginConfig
from crihook.scheduler.request import STRATEGIES

log = logging.getLogger("crihook.scheduler")

DEFAULT_LISTEN = "127.0.0.1:9443"
MAX_BODY = 64 << 20  # a filter call with 5,000 full Node objects stays well under this
DEFAULT_SCHEDULER_USER = "system:serviceaccount:kube-system:crihook-scheduler"
HANDSHAKE_TIMEOUT = 10.0
IDLE_TIMEOUT = 120.0  # a kept-alive connection with no request for this long is closed


@dataclass(frozen=True)
class TlsFiles:
    cert: str
    key: str
    client_ca: str = ""

    def context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert, self.key)
        if self.client_ca:
            ctx.load_verify_locations(self.client_ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx


def check_listen(listen: str, tls: TlsFiles | None, allow_plain: bool) -> tuple[str, int]:
    """(host, port); raises ValueError for a plain listener off loopback unless allowed."""
    host, port = parse_listen(listen)
    if tls is None and not is_loopback(host) and not allow_plain:
        raise ValueError(
            f"refusing plain HTTP on {listen}: anyone who reaches it could bind pods. Give --tls-cert and "
            "--tls-key, listen on loopback, or pass --insecure-allow-plain-http"
        )
    return host, port


class Handler(BaseHTTPRequestHandler):
    """Routes; `app` is set on the subclass made by `make_server`."""

    app: App
    protocol_version = "HTTP/1.1"  # kube-scheduler keeps connections open between calls
    timeout = IDLE_TIMEOUT

    def setup(self) -> None:
        super().setup()
        # headers and body go out as two writes: without this, Nagle and the peer's delayed ACK
        # add about 40 ms to every answer
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("http", extra={"request": format % args})

    def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/healthz":
            self._send(200, b"ok\n", "text/plain")
        elif path == "/readyz":
            ok = self.app.ready()
            self._send(200 if ok else 503, b"ok\n" if ok else b"cluster cache loading\n", "text/plain")
        elif path == "/metrics":
            self._send(200, metrics.REGISTRY.render(), metrics.CONTENT_TYPE)
        else:
            self._send(404, b"not found\n", "text/plain")

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        route = self.app.routes.get(path)
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            self._send(413, b"request body too large\n", "text/plain")
            self.close_connection = True
            return
        raw = self.rfile.read(length) if length else b""
        if route is None:
            self._send(404, b"not found\n", "text/plain")
            return
        started = time.perf_counter()
        code, ctype = 200, "text/plain"
        try:
            answer = route(json.loads(raw))
        except (ValueError, BadRequest, webhook.ReviewError) as e:
            code, out = 400, f"bad request: {e}\n".encode()
        except Exception:
            log.exception("handler failed", extra={"path": self.path})
            code, out = 500, b"internal error\n"
        else:
            out, ctype = json.dumps(answer, separators=(",", ":")).encode(), "application/json"
        # counted before the answer goes out: a client that reads /metrics after its reply sees its call
        metrics.SCHEDULER_SECONDS.observe(time.perf_counter() - started, path)
        metrics.SCHEDULER_REQUESTS.inc(path, str(code))
        self._send(code, out, ctype)


@dataclass
class App:
    extender: Extender
    webhook_config: webhook.WebhookConfig
    ready: Callable[[], bool]

    @property
    def routes(self) -> dict[str, Callable[[Any], Any]]:
        return {
            "/filter": self.extender.filter,
            "/prioritize": self.extender.prioritize,
            "/bind": self.extender.bind,
            "/mutate": lambda r: webhook.mutate(r, self.webhook_config),
            "/validate": lambda r: webhook.validate(r, self.webhook_config),
        }


class Server(ThreadingHTTPServer):
    """TLS handshakes happen on each connection's own thread, so a slow client can not stall accept()."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[Handler], tls: ssl.SSLContext | None) -> None:
        super().__init__(address, handler)
        self.tls = tls

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, ConnectionError):
            return  # a client that hangs up mid-request
        log.error("connection failed", extra={"peer": client_address[0], "error": repr(exc)})

    def finish_request(self, request: Any, client_address: Any) -> None:
        if self.tls is not None:
            request.settimeout(HANDSHAKE_TIMEOUT)
            try:
                request = self.tls.wrap_socket(request, server_side=True)
            except (ssl.SSLError, OSError) as e:
                log.debug("TLS handshake failed", extra={"peer": client_address[0], "error": str(e)})
                return
        super().finish_request(request, client_address)


def make_server(app: App, host: str, port: int, tls: TlsFiles | None) -> Server:
    class Bound(Handler):
        pass

    Bound.app = app
    return Server((host, port), Bound, tls.context() if tls is not None else None)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", default=DEFAULT_LISTEN, help="HOST:PORT to serve on (default %(default)s)")
    parser.add_argument("--tls-cert", default="", help="PEM certificate (chain) file; enables HTTPS")
    parser.add_argument("--tls-key", default="", help="PEM private key file for --tls-cert")
    parser.add_argument("--client-ca", default="", help="require client certificates signed by this CA")
    parser.add_argument(
        "--insecure-allow-plain-http", action="store_true", help="allow plain HTTP on a non-loopback address"
    )
    parser.add_argument("--kubeconfig", default="", help="kubeconfig file (default: in-cluster, else ~/.kube/config)")
    parser.add_argument("--strategy", default="fragmentation", choices=STRATEGIES, help="node scoring strategy")
    parser.add_argument(
        "--scheduler-user",
        action="append",
        default=[],
        help=f"user allowed to write allocation annotations (repeatable; default {DEFAULT_SCHEDULER_USER})",
    )
    parser.add_argument("--scheduler-name", default="", help="webhook: move GPU pods of the default scheduler here")
    parser.add_argument("--log-level", default="info", choices=crihook_log.LEVELS)


def _api_client(kubeconfig: str) -> Any:
    from kubernetes import client, config

    if kubeconfig:
        return config.new_client_from_config(config_file=kubeconfig)
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config()
        return client.ApiClient()
    return config.new_client_from_config()


def run(args: argparse.Namespace) -> int:
    from crihook.scheduler.cache import ClusterCache, KubeApi

    crihook_log.setup(args.log_level)
    if bool(args.tls_cert) != bool(args.tls_key):
        log.error("give both --tls-cert and --tls-key")
        return 2
    tls = TlsFiles(args.tls_cert, args.tls_key, args.client_ca) if args.tls_cert else None
    if args.client_ca and tls is None:
        log.error("--client-ca needs --tls-cert and --tls-key")
        return 2
    try:
        host, port = check_listen(args.listen, tls, args.insecure_allow_plain_http)
    except ValueError as e:
        log.error(str(e))
        return 2
    api_client = _api_client(args.kubeconfig)
    plugin = DeviceShare(PluginConfig(strategy=args.strategy))
    cache: ClusterCache | None = None
    extender = Extender(plugin, KubeApi(api_client), ready=lambda: cache is not None and cache.ready())
    cache = ClusterCache(api_client, plugin, extender.lock)
    users = tuple(args.scheduler_user) or (DEFAULT_SCHEDULER_USER,)
    app = App(extender, webhook.WebhookConfig(users, args.scheduler_name), cache.ready)
    server = make_server(app, host, port, tls)
    cache.start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    log.info("scheduler listening", extra={"listen": args.listen, "tls": tls is not None})
    stop.wait()
    server.shutdown()
    cache.stop()
    return 0
