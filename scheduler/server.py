"""`crihook scheduler`: the extender and the admission webhook over HTTP(S).

POST /filter, /prioritize, /prioritize-claims, /preempt, /bind (kube-scheduler), POST /mutate, /validate (the API
server's admission webhooks), GET /healthz (the process serves), /readyz (this replica leads and
its cluster cache is loaded: scheduler/ha.py) and /metrics (Prometheus: requests by path and
status, time to answer).

TLS comes from certificate and key files. With `--client-ca`, the extender verbs (EXTENDER_PATHS:
bind places pods, past taints) answer only callers that presented a certificate signed by it, and
with `--extender-client` one of those names; the API server's webhook calls, which carry no client
certificate by default, and the GETs need none. The files are read again when they change (a
mounted Secret is swapped in place), so a rotated certificate needs no restart. Plain HTTP, and
HTTPS without a client CA, are for loopback only (kube-scheduler beside us in one pod): on any other
address they are refused unless `--insecure-allow-plain-http` or
`--insecure-allow-anonymous-extender` says so, because anyone who can reach /bind can place pods.

The HTTP server is a small server on threads, chosen by measurement over aiohttp and uvicorn
(docs/scheduler.md, "Serving"): a deep listen backlog, so a burst of new connections is queued
instead of dropped into TCP's one-second SYN retry; a bounded pool of worker threads that run TLS
handshakes (OpenSSL releases the GIL, so both cores work on a burst) and requests; and one selector
thread that accepts and holds idle kept-alive connections, so an idle connection costs a file
descriptor, not a thread. Request heads are read by h11, a sans-I/O HTTP/1.1 parser (framing,
pipelining, malformed input), with one parser per request fed what the last one left over, and the
body is the Content-Length bytes after the head; on top of h11's rules this server refuses what a
peer in front of it could frame differently: any Transfer-Encoding, header lines folded onto the
next line (obs-fold), versions other than 1.0 and 1.1. Answers, whose every byte this server
chooses, are written directly: through h11 they cost more CPU than the parsing.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import logging
import queue
import select
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import h11

from crihook.base import metrics
from crihook.base.metrics import is_loopback, parse_listen
from crihook.base.tls import Certificates, TlsFiles
from crihook.scheduler import webhook
from crihook.scheduler.extender import BadRequest, Extender, HostPriorityList

log = logging.getLogger("crihook.scheduler")

DEFAULT_LISTEN = "127.0.0.1:9443"
MAX_BODY = 64 << 20  # a filter call with 5,000 full Node objects stays well under this
MAX_HEAD = 64 << 10  # request line and headers
DEFAULT_SCHEDULER_USER = "system:serviceaccount:kube-system:crihook-scheduler"
BACKLOG = 4096  # the kernel caps it at net.core.somaxconn; 5 (http.server's) drops bursts
WORKERS = 16  # threads for handshakes and requests; idle connections hold none
MAX_CONNECTIONS = 4096  # open connections; beyond it new ones wait in the backlog
HANDSHAKE_TIMEOUT = 10.0
REQUEST_TIMEOUT = 15.0  # to read one request, head and body
LINGER = 0.05  # seconds a worker waits for the next request on a connection before parking it
IDLE_TIMEOUT = 120.0  # a kept-alive connection with no request for this long is closed

Answer = tuple[int, bytes, str]  # HTTP status, body, content type
# kube-scheduler's verbs, which the leader alone answers (the others refuse them); the webhooks keep
# no state and every replica answers them
EXTENDER_PATHS = frozenset({"/filter", "/prioritize", "/prioritize-claims", "/preempt", "/bind"})
TEXT = "text/plain"
JSON_TYPE = "application/json"
REASONS = {
    200: "OK",
    400: "Bad Request",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    411: "Length Required",
    413: "Content Too Large",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    501: "Not Implemented",
    503: "Service Unavailable",
    505: "HTTP Version Not Supported",
}


def check_listen(
    listen: str, tls: TlsFiles | None, allow_plain: bool, allow_anonymous: bool = False
) -> tuple[str, int]:
    """(host, port); raises ValueError for a listener off loopback that would let anyone bind pods:
    plain HTTP unless allowed, HTTPS without a client CA unless anonymous extender calls are allowed."""
    host, port = parse_listen(listen)
    if is_loopback(host):
        return host, port
    if tls is None and not allow_plain:
        raise ValueError(
            f"refusing plain HTTP on {listen}: anyone who reaches it could bind pods. Give --tls-cert and "
            "--tls-key, listen on loopback, or pass --insecure-allow-plain-http"
        )
    if tls is not None and not tls.client_ca and not allow_anonymous:
        raise ValueError(
            f"refusing extender calls without a client certificate on {listen}: anyone who reaches it could "
            "bind pods. Give --client-ca (the CA of kube-scheduler's client certificate), listen on loopback, "
            "or pass --insecure-allow-anonymous-extender"
        )
    return host, port


def client_name(cert: dict[str, Any] | None) -> str:
    """The common name of a verified client certificate (ssl's getpeercert()); "" when none was given."""
    for rdn in (cert or {}).get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return "-" if cert else ""  # verified, but no common name


@dataclass
class App:
    """What the scheduler answers, apart from how HTTP carries it (the bench serves it on other stacks).

    `routes` are the JSON POST verbs and `get_routes` the plain GETs; a new verb is one more entry.
    `ready` is what /readyz reports.
    """

    extender: Extender
    webhook_config: webhook.WebhookConfig
    ready: Callable[[], bool]

    @property
    def routes(self) -> dict[str, Callable[[Any], Any]]:
        return {
            "/filter": self.extender.filter,
            "/prioritize": self.extender.prioritize,
            "/prioritize-claims": self.extender.prioritize_claims,
            "/preempt": self.extender.preempt,
            "/bind": self.extender.bind,
            "/mutate": lambda r: webhook.mutate(r, self.webhook_config),
            "/mutate-dra": lambda r: webhook.mutate(r, self.webhook_config, dra_all=True),
            "/validate": lambda r: webhook.validate(r, self.webhook_config),
        }

    @property
    def get_routes(self) -> dict[str, Callable[[], Answer]]:
        return {
            "/healthz": lambda: (200, b"ok\n", TEXT),
            "/readyz": lambda: (200, b"ok\n", TEXT) if self.ready() else (503, b"standby, or not ready\n", TEXT),
            "/metrics": lambda: (200, metrics.REGISTRY.render(), metrics.CONTENT_TYPE),
        }

    def get(self, path: str) -> Answer:
        route = self.get_routes.get(path)
        return route() if route is not None else (404, b"not found\n", TEXT)

    def post(self, path: str, raw: bytes) -> Answer:
        route = self.routes.get(path)
        if route is None:
            return 404, b"not found\n", TEXT
        started, cpu = time.perf_counter(), time.thread_time()
        try:
            out = route(json.loads(raw))
            body = out.json() if isinstance(out, HostPriorityList) else json.dumps(out, separators=(",", ":")).encode()
            answer: Answer = (200, body, JSON_TYPE)
        except (ValueError, BadRequest, webhook.ReviewError) as e:
            answer = 400, f"bad request: {e}\n".encode(), TEXT
        except Exception:
            log.exception("handler failed", extra={"path": path})
            answer = 500, b"internal error\n", TEXT
        # counted before the answer goes out: a client that reads /metrics after its reply sees its call
        metrics.SCHEDULER_SECONDS.observe(time.perf_counter() - started, path)
        metrics.SCHEDULER_CPU_SECONDS.observe(time.thread_time() - cpu, path)
        metrics.SCHEDULER_REQUESTS.inc(path, str(answer[0]))
        return answer


class HttpError(Exception):
    """A request this server refuses: answered with `code` and the message, then the connection closes."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Request:
    method: str
    path: str
    body: bytes
    keep_alive: bool


@dataclass
class Conn:
    """One client connection; `left` holds the bytes read past the last request."""

    sock: socket.socket
    peer: str
    client: str = ""  # the verified client certificate's common name ("-" without one); "" none
    left: bytes = b""
    idle_since: float = 0.0
    fresh: bool = True  # TLS handshake still to do

    def buffered(self) -> bool:
        """Bytes of a next request already read (pipelined), or held by TLS."""
        pending = self.sock.pending() if isinstance(self.sock, ssl.SSLSocket) else 0
        return bool(pending or self.left)


def _recv(conn: Conn, deadline: float) -> bytes:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    conn.sock.settimeout(left)
    return conn.sock.recv(1 << 16)


def _more(conn: Conn, deadline: float) -> bytes:
    """The next bytes of a request begun: a peer that closes mid-request ends the connection
    (ConnectionError), not with an answer."""
    if data := _recv(conn, deadline):
        return data
    raise ConnectionError("closed mid-request")


def _head_problem(head: bytes, request: h11.Request) -> HttpError | None:
    """What this server refuses beyond HTTP/1.1's own rules, where a proxy or a peer could frame the
    same bytes differently (request smuggling)."""
    if request.http_version not in (b"1.0", b"1.1"):  # h11 reads any digit.digit
        return HttpError(505, "HTTP/1.0 and HTTP/1.1 only")
    if len(head) > MAX_HEAD:  # h11 bounds a head that arrives in pieces; this bounds one read whole
        return HttpError(431, "request head too large")
    if b"\n " in head or b"\n\t" in head:  # RFC 9112 5.2: reject obs-fold, or replace it
        return HttpError(400, "header line folded onto the next line (obs-fold)")
    return None


@dataclass
class Framing:
    """What the head says about the body and the connection, from one pass over its headers."""

    length: int = 0  # h11 checked the digits, and that repeated Content-Lengths agree
    chunked: bool = False  # any Transfer-Encoding
    connection: frozenset[bytes] = frozenset()  # the Connection header's tokens, lower case

    @classmethod
    def of(cls, request: h11.Request) -> Framing:
        out = cls()
        for name, value in request.headers:  # h11 gives lower-case names
            if name == b"content-length":
                out.length = int(value)
            elif name == b"transfer-encoding":
                out.chunked = True
            elif name == b"connection":
                out.connection |= {t.strip().lower() for t in value.split(b",")}
        return out

    def keep_alive(self, version: bytes) -> bool:
        """HTTP/1.1 keeps the connection unless it says close; HTTP/1.0 closes it unless it says keep-alive."""
        return b"close" not in self.connection if version == b"1.1" else b"keep-alive" in self.connection


def read_request(conn: Conn) -> Request | None:
    """The next request on `conn`; None when the peer closed between requests.

    h11 reads the head, with a new parser per request given what the last request left over (h11
    would not read another request until it had written the answer, and a parser costs 1 µs). The
    body is then sliced here, not by h11's events: with any Transfer-Encoding refused, h11's framing
    is exactly Content-Length bytes (none without one), and slicing costs a fraction of the events.
    """
    deadline = time.monotonic() + REQUEST_TIMEOUT
    read = conn.left or _recv(conn, deadline)
    if not read:
        return None
    http = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
    http.receive_data(read)
    chunks = [read]  # joined once: a head dripped in small reads is not copied once per read
    while True:
        try:
            head = http.next_event()
        except h11.RemoteProtocolError as e:
            raise HttpError(e.error_status_hint, str(e)) from None
        if head is not h11.NEED_DATA:
            break
        chunks.append(data := _more(conn, deadline))
        http.receive_data(data)
    read = b"".join(chunks) if len(chunks) > 1 else read
    assert isinstance(head, h11.Request)  # a parser given bytes has no ConnectionClosed to report
    rest = http.trailing_data[0]
    framing = Framing.of(head)
    if problem := _head_problem(read[: len(read) - len(rest)], head):
        raise problem
    if framing.chunked:
        raise HttpError(411, "send the body with a Content-Length")  # Go's clients do for byte bodies
    if framing.length > MAX_BODY:
        raise HttpError(413, "request body too large")
    if http.they_are_waiting_for_100_continue:
        conn.sock.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
    if len(rest) < framing.length:
        body = bytearray(rest)  # (bytes += bytes would copy a large body once per read)
        while len(body) < framing.length:
            body += _more(conn, deadline)
        rest = bytes(body)
    conn.left = rest[framing.length :]
    path = head.target.split(b"?", 1)[0].decode("latin-1")
    keep = framing.keep_alive(head.http_version)
    return Request(head.method.decode("latin-1"), path, rest[: framing.length], keep)


def response(code: int, body: bytes, ctype: str, keep_alive: bool, with_body: bool = True) -> bytes:
    """An answer; without `keep_alive` it says the connection closes. An answer to HEAD has no body."""
    head = f"HTTP/1.1 {code} {REASONS.get(code, '')}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
    head += "\r\n" if keep_alive else "Connection: close\r\n\r\n"
    return head.encode() + body if with_body else head.encode()


def listen_socket(address: tuple[str, int]) -> socket.socket:
    """A listening socket; "::" is every address of both families (IPv6 and IPv4-mapped), so one
    default serves IPv4, IPv6 and dual-stack clusters alike, and falls back to IPv4's "0.0.0.0" on a
    kernel without IPv6."""
    host, port = address
    if ":" in host:
        try:
            sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        except OSError:
            if host != "::":
                raise
            log.warning("no IPv6 on this host: listening on 0.0.0.0 instead of ::", extra={"port": port})
            return listen_socket(("0.0.0.0", port))
        if host == "::":
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    else:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


class Server:
    """Accepts on one selector thread, works on a bounded pool; see the module docstring."""

    def __init__(
        self,
        app: App,
        address: tuple[str, int],
        tls: Certificates | None,
        workers: int = WORKERS,
        max_connections: int = MAX_CONNECTIONS,
        extender_clients: frozenset[str] = frozenset(),
    ) -> None:
        self.app = app
        self.tls = tls
        self.extender_clients = extender_clients  # allowed common names; empty: any the client CA signed
        self.max_connections = max_connections
        self.workers = workers
        self._lingering = 0
        self.socket = listen_socket(address)
        self.socket.setblocking(False)
        self.server_address = self.socket.getsockname()
        # requests on open connections go before new handshakes: an answer costs a fraction of a
        # handshake, and a burst of new connections must not stall the calls already connected
        self._work_q: queue.PriorityQueue[tuple[int, int, Conn | None]] = queue.PriorityQueue()
        self._seq = itertools.count()
        self._workers = [threading.Thread(target=self._worker, name=f"http-{i}", daemon=True) for i in range(workers)]
        for t in self._workers:
            t.start()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._parked: collections.deque[Conn] = collections.deque()  # from workers to the selector
        self._open = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._stopped = threading.Event()

    def serve_forever(self, poll_interval: float = 1.0) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._wake_r, selectors.EVENT_READ)
        listening = False
        idle: dict[int, Conn] = {}
        try:
            while not self._stop.is_set():
                with self._lock:
                    room = self._open < self.max_connections
                if room and not listening:
                    sel.register(self.socket, selectors.EVENT_READ)
                elif listening and not room:  # full: new connections wait in the backlog
                    sel.unregister(self.socket)
                listening = room
                for key, _ in sel.select(poll_interval):
                    if key.fileobj is self.socket:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        self._drain_wake(sel, idle)
                    else:
                        conn = idle.pop(key.fd)
                        sel.unregister(conn.sock)
                        self._submit(conn)
                self._close_idle(sel, idle)
        finally:
            for conn in idle.values():
                self._close(conn)
            sel.close()
            self._stopped.set()

    def _accept(self) -> None:
        while True:
            with self._lock:
                if self._open >= self.max_connections:
                    return
            try:
                sock, peer = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of file descriptors: wait for a close
                log.warning("accept failed", extra={"error": str(e)})
                return
            with self._lock:
                self._open += 1
            self._submit(Conn(sock, str(peer[0])))

    def _submit(self, conn: Conn) -> None:
        self._work_q.put((1 if conn.fresh else 0, next(self._seq), conn))

    def _worker(self) -> None:
        while (conn := self._work_q.get()[2]) is not None:
            self._work(conn)

    def _drain_wake(self, sel: selectors.BaseSelector, idle: dict[int, Conn]) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        while self._parked:
            conn = self._parked.popleft()
            conn.idle_since = time.monotonic()
            idle[conn.sock.fileno()] = conn
            sel.register(conn.sock, selectors.EVENT_READ)

    def _close_idle(self, sel: selectors.BaseSelector, idle: dict[int, Conn]) -> None:
        limit = time.monotonic() - IDLE_TIMEOUT
        for fd in [fd for fd, c in idle.items() if c.idle_since < limit]:
            conn = idle.pop(fd)
            sel.unregister(conn.sock)
            self._close(conn)

    def _close(self, conn: Conn) -> None:
        try:
            conn.sock.close()
        finally:
            with self._lock:
                was_full = self._open >= self.max_connections
                self._open -= 1
            if was_full:
                self._wake()  # the selector waits with the listener unregistered

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # the pipe is full: the selector wakes anyway
            self._wake_w.send(b"x")

    def _work(self, conn: Conn) -> None:
        """Handshake if new, then answer requests until none is waiting; then park or close."""
        try:
            if conn.fresh:
                conn.fresh = False
                conn.sock.setblocking(True)
                conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self.tls is not None:
                    conn.sock.settimeout(HANDSHAKE_TIMEOUT)
                    conn.sock = self.tls.context().wrap_socket(conn.sock, server_side=True)
                    assert isinstance(conn.sock, ssl.SSLSocket)
                    conn.client = client_name(conn.sock.getpeercert())
            while True:
                try:
                    req = read_request(conn)
                except HttpError as e:
                    conn.sock.sendall(response(e.code, f"{e}\n".encode(), TEXT, keep_alive=False))
                    break
                if req is None:
                    break
                code, body, ctype = self._answer(req, conn)
                # a replica that is not ready (a standby, a leader that lost its Lease) closes after
                # answering an extender verb, so a kept-alive kube-scheduler reconnects through the
                # leader's Service instead of staying pinned here; the API server's webhook calls,
                # which any replica answers, keep their connection
                keep = req.keep_alive and (req.path not in EXTENDER_PATHS or self.app.ready())
                conn.sock.sendall(response(code, body, ctype, keep, with_body=req.method != "HEAD"))
                if not keep or self._stop.is_set():
                    break
                if not conn.buffered() and not self._linger(conn):
                    self._parked.append(conn)
                    self._wake()
                    return
        except (OSError, ssl.SSLError) as e:  # timeouts, resets, failed handshakes
            log.debug("connection ended", extra={"peer": conn.peer, "error": repr(e)})
        except Exception:
            log.exception("connection failed", extra={"peer": conn.peer})
        self._close(conn)

    def _linger(self, conn: Conn) -> bool:
        """Wait a moment on this connection for its next request when no other work waits: kube-scheduler
        sends filter, prioritize and bind back to back, and each hand-off through the selector is two
        more thread wake-ups, which cost milliseconds on a busy machine. Half the workers at most."""
        with self._lock:
            if self._lingering >= self.workers // 2 or not self._work_q.empty():
                return False
            self._lingering += 1
        try:
            poll = select.poll()
            poll.register(conn.sock, select.POLLIN)
            return bool(poll.poll(LINGER * 1000))
        finally:
            with self._lock:
                self._lingering -= 1

    def _allowed(self, path: str, conn: Conn) -> bool:
        """Extender verbs only from a caller with a client certificate (of an allowed name), where a
        client CA is configured; everything else from anyone."""
        if path not in EXTENDER_PATHS or self.tls is None or not self.tls.files.client_ca:
            return True
        return bool(conn.client) and (not self.extender_clients or conn.client in self.extender_clients)

    def _answer(self, req: Request, conn: Conn) -> Answer:
        if req.method == "POST" and not self._allowed(req.path, conn):
            metrics.SCHEDULER_REQUESTS.inc(req.path, "403")
            log.warning(
                "extender call refused: no allowed client certificate",
                extra={"peer": conn.peer, "path": req.path, "client": conn.client or "<none>"},
            )
            return 403, b"forbidden: extender calls need kube-scheduler's client certificate\n", TEXT
        if req.method == "POST":
            return self.app.post(req.path, req.body)
        if req.method == "GET":
            return self.app.get(req.path)
        return 405, b"use GET or POST\n", TEXT

    def shutdown(self) -> None:
        self._stop.set()
        self._wake()
        self._stopped.wait(10)
        for _ in self._workers:
            self._work_q.put((2, next(self._seq), None))

    def server_close(self) -> None:
        self.socket.close()
        self._wake_r.close()
        self._wake_w.close()


def make_server(
    app: App,
    host: str,
    port: int,
    tls: TlsFiles | None,
    workers: int = WORKERS,
    max_connections: int = MAX_CONNECTIONS,
    extender_clients: frozenset[str] = frozenset(),
) -> Server:
    certs = Certificates(tls, reloaded=metrics.SCHEDULER_TLS_RELOADS.inc) if tls is not None else None
    return Server(app, (host, port), certs, workers, max_connections, extender_clients)
