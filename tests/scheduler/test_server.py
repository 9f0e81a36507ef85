"""`crihook scheduler`'s HTTP server: HTTP/1.1 framing and errors, idle kept-alive connections that
hold no worker, the connection cap, certificate rotation under load, and a burst of AdmissionReviews
over new mutual-TLS connections against a real `crihook scheduler` process."""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from crihook.scheduler import server as srv
from crihook.scheduler import webhook
from crihook.scheduler.extender import Extender
from crihook.scheduler.plugin import DeviceShare
from tests.support.fakekube import FakeKube
from tests.support.tlsburst import (
    Certs,
    burst,
    check_review,
    connect,
    http_request,
    make_ca,
    make_cert,
    make_certs,
    read_answer,
    read_response,
    review,
)

needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


def app() -> srv.App:
    return srv.App(Extender(DeviceShare()), webhook.WebhookConfig(), lambda: True)


def serve(tls: srv.TlsFiles | None = None, **kw: int) -> srv.Server:
    server = srv.make_server(app(), "127.0.0.1", 0, tls, **kw)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    return server


@pytest.fixture
def plain() -> Iterator[srv.Server]:
    server = serve(workers=2)
    yield server
    server.shutdown()
    server.server_close()


def dial(server: srv.Server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=5)


def exchange(sock: socket.socket, raw: bytes) -> tuple[int, bytes]:
    sock.sendall(raw)
    return read_response(sock, bytearray())


def test_requests_on_one_connection_including_pipelined(plain: srv.Server) -> None:
    s = dial(plain)
    assert exchange(s, http_request("/validate", review("uid-1")))[0] == 200
    time.sleep(0.2)  # the connection is parked with the selector meanwhile
    buf = bytearray()
    s.sendall(http_request("/validate", review("uid-2")) + http_request("/mutate", review("uid-3")))
    assert check_review(2, *read_response(s, buf)) == ""
    assert check_review(3, *read_response(s, buf)) == ""
    assert exchange(s, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n") == (200, b"ok\n")


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (b"GARBAGE\r\n\r\n", 400),
        (b"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Length: x\r\n\r\n", 400),
        (b"POST /filter HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n", 400),
        (f"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Length: {srv.MAX_BODY + 1}\r\n\r\n".encode(), 413),
        (b"POST /filter HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n", 411),
        (b"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n{}", 411),
        (b"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}", 400),
        (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX: a\r\n b\r\n\r\n", 400),  # obs-fold
        (b"GET /healthz HTTP/1.1\r\n\r\n", 400),  # no Host
        (b"GET /healthz HTTP/2.0\r\nHost: x\r\n\r\n", 505),
        (b"GET / HTTP/1.1\r\nHost: x\r\nX: " + b"a" * (srv.MAX_HEAD + 10) + b"\r\n\r\n", 431),
        (b"PUT /filter HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", 405),
        (b"GET /nothing HTTP/1.1\r\nHost: x\r\n\r\n", 404),
        (b"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n{nope", 400),
    ],
)
def test_bad_requests_are_refused(plain: srv.Server, raw: bytes, code: int) -> None:
    assert exchange(dial(plain), raw)[0] == code


def test_an_answer_to_head_has_no_body(plain: srv.Server) -> None:
    s = dial(plain)
    s.sendall(b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\nGET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    buf = bytearray()
    while not buf.endswith(b"ok\n"):
        buf += s.recv(1000)
    first, _, second = bytes(buf).partition(b"\r\n\r\n")
    assert first.startswith(b"HTTP/1.1 405 ") and second.startswith(b"HTTP/1.1 200 ")


def test_connection_close_and_http10_close(plain: srv.Server) -> None:
    for raw in (
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        b"GET /healthz HTTP/1.0\r\n\r\n",
    ):
        s = dial(plain)
        assert exchange(s, raw) == (200, b"ok\n")
        assert s.recv(10) == b""  # closed by the server


def test_a_standby_answers_webhooks_on_kept_connections_and_sends_extender_calls_away() -> None:
    """Every replica answers the webhooks (their own Service selects them all): a standby keeps the
    API server's connection; an extender verb there is refused and the connection closed, so a
    kept-alive kube-scheduler reconnects through the leader's Service."""
    standby = srv.App(Extender(DeviceShare(), ready=lambda: False), webhook.WebhookConfig(), lambda: False)
    server = srv.make_server(standby, "127.0.0.1", 0, None, workers=2)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        s = dial(server)
        buf = bytearray()
        for i in range(3):
            s.sendall(http_request("/validate", review(f"uid-{i}")))
            answer = read_answer(s, buf)
            assert not answer.closes and check_review(i, answer.status, answer.body) == ""
        s.sendall(http_request("/filter", b'{"Pod": {}, "NodeNames": ["n"]}'))
        assert read_answer(s, buf).closes
        assert s.recv(10) == b""
    finally:
        server.shutdown()
        server.server_close()


def test_the_any_address_serves_both_families() -> None:
    """`--listen [::]:PORT` (the chart's): IPv4 clients reach it as mapped addresses, IPv6 ones
    directly, so one default fits IPv4, IPv6 and dual-stack clusters."""
    if not socket.has_ipv6:
        pytest.skip("no IPv6 in this Python")
    server = srv.make_server(app(), "::", 0, None, workers=2)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    port = server.server_address[1]
    try:
        for host in ("127.0.0.1", "::1"):
            try:
                s = socket.create_connection((host, port), timeout=5)
            except OSError as e:  # a host without IPv6 on loopback
                assert host == "::1", e
                continue
            assert exchange(s, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n") == (200, b"ok\n"), host
            s.close()
    finally:
        server.shutdown()
        server.server_close()


def test_expect_100_continue(plain: srv.Server) -> None:
    s = dial(plain)
    body = review("uid-7")
    head = f"POST /validate HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: {len(body)}\r\n\r\n"
    s.sendall(head.encode())
    buf = bytearray()
    assert read_response(s, buf)[0] == 100
    s.sendall(body)
    assert check_review(7, *read_response(s, buf)) == ""


def test_idle_connections_hold_no_worker(plain: srv.Server) -> None:
    """Two workers, twenty kept-alive connections left idle: a new caller is still answered."""
    idle = [dial(plain) for _ in range(20)]
    for s in idle:
        assert exchange(s, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")[0] == 200
    assert exchange(dial(plain), b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n") == (200, b"ok\n")
    assert all(exchange(s, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")[0] == 200 for s in idle)


def test_connection_cap_leaves_new_connections_waiting() -> None:
    server = serve(workers=2, max_connections=2)
    try:
        a, b = dial(server), dial(server)
        for s in (a, b):
            assert exchange(s, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")[0] == 200
        c = dial(server)  # the kernel completes the handshake; we do not accept yet
        c.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        c.settimeout(0.5)
        with pytest.raises(TimeoutError):
            c.recv(100)
        a.close()
        c.settimeout(5)
        assert read_response(c, bytearray()) == (200, b"ok\n")
    finally:
        server.shutdown()
        server.server_close()


def test_idle_connections_are_closed_after_the_timeout(monkeypatch: pytest.MonkeyPatch, plain: srv.Server) -> None:
    monkeypatch.setattr(srv, "IDLE_TIMEOUT", 0.2)
    s = dial(plain)
    assert exchange(s, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")[0] == 200
    s.settimeout(5)
    assert s.recv(10) == b""


# --- certificate rotation ---------------------------------------------------------------------------


def secret_volume(mount: Path, files: dict[str, Path], version: int) -> None:
    """Lay out or update `mount` as the kubelet does for a Secret: the files live in a timestamped
    directory, `..data` points at it, and each key is a symlink through `..data`; an update writes a
    new directory and swaps `..data` with one rename (kubelet's atomic writer)."""
    target = mount / f"..2026_11_23_{version:02d}"
    target.mkdir()
    for name, src in files.items():
        shutil.copy(src, target / name)
    tmp = mount / "..data_tmp"
    tmp.symlink_to(target.name)
    os.replace(tmp, mount / "..data")
    for name in files:
        if not (mount / name).is_symlink():
            (mount / name).symlink_to(f"..data/{name}")


@needs_openssl
def test_certificate_rotated_under_load(tmp_path: Path) -> None:
    """The Secret is swapped while callers keep making calls on new and kept-alive connections: no
    call fails; new connections get the new certificate and the new client CA; a connection opened
    before keeps working on the old one."""
    ca_a, ca_b = make_ca(tmp_path, "ca-a"), make_ca(tmp_path, "ca-b")
    old = make_cert(tmp_path, "server-old", ca_a, "subjectAltName=IP:127.0.0.1")
    new = make_cert(tmp_path, "server-new", ca_b, "subjectAltName=IP:127.0.0.1")
    caller = make_cert(tmp_path, "caller", ca_a, "extendedKeyUsage=clientAuth")
    newcomer = make_cert(tmp_path, "newcomer", ca_b, "extendedKeyUsage=clientAuth")
    (tmp_path / "both.crt").write_text(ca_a[0].read_text() + ca_b[0].read_text())
    mount = tmp_path / "tls"
    mount.mkdir()
    secret_volume(mount, {"tls.crt": old[0], "tls.key": old[1], "ca.crt": ca_a[0]}, 1)
    server = serve(srv.TlsFiles(str(mount / "tls.crt"), str(mount / "tls.key"), str(mount / "ca.crt")))
    port = server.server_address[1]

    def ctx(cert: tuple[Path, Path]) -> ssl.SSLContext:
        c = ssl.create_default_context(cafile=str(tmp_path / "both.crt"))
        c.load_cert_chain(str(cert[0]), str(cert[1]))
        return c

    def issuer(sock: ssl.SSLSocket) -> str:
        cert = sock.getpeercert()
        assert cert is not None
        return dict(x[0] for x in cert["issuer"])["commonName"]

    stop = threading.Event()
    failures: list[str] = []
    calls = [0]

    def load(n: int) -> None:
        kept = connect(port, ctx(caller))
        buf = bytearray()
        i = n * 100_000
        while not stop.is_set():
            i += 1
            try:
                kept.sendall(http_request("/validate", review(f"uid-{i}")))
                if why := check_review(i, *read_response(kept, buf)):
                    failures.append(why)
                with connect(port, ctx(caller)) as fresh:  # and one on a new connection
                    fresh.sendall(http_request("/validate", review(f"uid-{i}")))
                    if why := check_review(i, *read_response(fresh, bytearray())):
                        failures.append(why)
                calls[0] += 2
            except (OSError, ValueError) as e:
                failures.append(repr(e))
        kept.close()

    try:
        before = connect(port, ctx(caller))
        assert issuer(before) == "ca-a"
        with pytest.raises((ssl.SSLError, ConnectionError)), connect(port, ctx(newcomer)) as s:  # not trusted yet
            s.sendall(http_request("/validate", review("uid-0")))
            read_response(s, bytearray())
        threads = [threading.Thread(target=load, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        secret_volume(mount, {"tls.crt": new[0], "tls.key": new[1], "ca.crt": tmp_path / "both.crt"}, 2)
        deadline = time.monotonic() + 10
        while True:
            with connect(port, ctx(caller)) as s:
                if issuer(s) == "ca-b":
                    break
            assert time.monotonic() < deadline, "the new certificate was never served"
            time.sleep(0.1)
        time.sleep(0.5)
        stop.set()
        for t in threads:
            t.join()
        assert failures == [] and calls[0] > 20
        with connect(port, ctx(newcomer)) as s:  # the new client CA is in force
            s.sendall(http_request("/validate", review("uid-1")))
            assert check_review(1, *read_response(s, bytearray())) == ""
        assert issuer(before) == "ca-a"  # opened before the swap: still the old session
        before.sendall(http_request("/validate", review("uid-2")))
        assert check_review(2, *read_response(before, bytearray())) == ""
    finally:
        stop.set()
        server.shutdown()
        server.server_close()


@needs_openssl
def test_half_written_certificate_keeps_the_old_one(tmp_path: Path) -> None:
    certs = make_certs(tmp_path, "ec")
    (tmp_path / "other").mkdir()
    other = make_certs(tmp_path / "other", "ec")
    cert = tmp_path / "serving.crt"
    shutil.copy(certs.server_cert, cert)
    loaded = srv.Certificates(srv.TlsFiles(str(cert), certs.server_key), check_every=0)
    first = loaded.context()
    shutil.copy(other.server_cert, cert)  # the certificate is new, its key not yet: they do not match
    assert loaded.context() is first
    shutil.copy(certs.server_cert, cert)
    os.utime(cert, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert loaded.context() is not first  # changed again, and loads


@needs_openssl
@pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1_3, ssl.TLSVersion.TLSv1_2], ids=["1.3", "1.2"])
def test_no_session_tickets(tmp_path: Path, version: ssl.TLSVersion) -> None:
    """Go's clients keep no TLS session cache, so a ticket would be CPU spent on every handshake
    for nothing; a TLS 1.3 server sends its tickets after the handshake, read here with the answer."""
    certs = make_certs(tmp_path, "ec")
    server = serve(srv.TlsFiles(certs.server_cert, certs.server_key, certs.ca))
    ctx = certs.client_context()
    ctx.maximum_version = version
    try:
        with connect(server.server_address[1], ctx) as sock:
            assert exchange(sock, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")[0] == 200
            assert sock.version() == ("TLSv1.3" if version == ssl.TLSVersion.TLSv1_3 else "TLSv1.2")
            assert sock.session is not None and not sock.session.has_ticket
    finally:
        server.shutdown()
        server.server_close()


# --- a burst against the real command -----------------------------------------------------------------


@needs_openssl
def test_burst_of_admission_reviews_against_crihook_scheduler(tmp_path: Path) -> None:
    """300 AdmissionReviews over 100 new mutual-TLS connections, all at once, against a `crihook
    scheduler` process: every one answered, and answered right (correctness; latency is the bench's)."""
    certs: Certs = make_certs(tmp_path, "ec")
    with FakeKube() as kube:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "crihook.cli", "scheduler", "--listen", f"127.0.0.1:{port}",
                "--tls-cert", certs.server_cert, "--tls-key", certs.server_key, "--client-ca", certs.ca,
                "--kubeconfig", str(kube.write_kubeconfig(tmp_path / "kubeconfig")), "--log-level", "warning",
            ],
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        try:
            ctx = certs.client_context()
            deadline = time.monotonic() + 30
            while True:
                try:
                    with connect(port, ctx) as s:
                        assert exchange(s, b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")[0] == 200
                        break
                except (OSError, AssertionError):
                    assert proc.poll() is None and time.monotonic() < deadline, "crihook scheduler did not start"
                    time.sleep(0.2)
            result = burst(port, certs, 300, 100, processes=1)
            assert result.failures == []
            assert len(result.latencies) == 300
        finally:
            proc.terminate()
            _, err = proc.communicate(timeout=10)
        assert proc.returncode == 0, err
