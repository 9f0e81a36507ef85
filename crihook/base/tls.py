"""Serving certificates: files an operator provides (a mounted Secret, which cert-manager may keep),
reloaded when they change, or a self-signed one made at start for a listener that has none.

A self-signed certificate is what kubelet and kube-rbac-proxy serve when they are given none: the
channel is encrypted, so a bearer token does not cross the network in the clear, but the client
cannot verify whom it talks to (Prometheus scrapes it with insecureSkipVerify). Its key lives in
memory only.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

log = logging.getLogger("crihook.tls")

TLS_CHECK_EVERY = 1.0  # seconds between looks at the certificate files
SELF_SIGNED_DAYS = 365  # as kubelet's and kube-rbac-proxy's; made anew at each start


@dataclass(frozen=True)
class TlsFiles:
    cert: str
    key: str
    client_ca: str = ""

    def context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        # no session tickets: the API server's, kube-scheduler's and Prometheus' Go clients keep no
        # session cache, so a ticket is never used, and issuing two per TLS 1.3 handshake cost the
        # scheduler 0.3 ms of its 1.0 ms of CPU per mutual-TLS handshake (docs/scheduler.md, "Serving")
        ctx.num_tickets = 0
        ctx.options |= ssl.OP_NO_TICKET
        ctx.load_cert_chain(self.cert, self.key)
        if self.client_ca:
            # asked for, checked when given, required per path by the server: the API server calls
            # the scheduler's webhooks without one
            ctx.load_verify_locations(self.client_ca)
            ctx.verify_mode = ssl.CERT_OPTIONAL
        return ctx

    def signature(self) -> tuple[tuple[int, int, int, int], ...]:
        """What changes when a file is replaced: a Secret volume swaps its `..data` symlink to a new
        directory, so the files behind the links are new inodes; an editor or `cp` changes mtime."""
        out = []
        for path in (self.cert, self.key, self.client_ca):
            if path:
                st = os.stat(path)
                out.append((st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size))
        return tuple(out)


class Certificates:
    """The TLS context for new connections, rebuilt when the files change.

    A connection keeps the context it was accepted with, so calls in flight finish on the old
    certificate. Files caught half-written (a key that does not match the certificate) keep the old
    context and are tried again at the next look. `reloaded` is called after each reload (a metric).
    """

    def __init__(
        self, files: TlsFiles, check_every: float = TLS_CHECK_EVERY, reloaded: Callable[[], object] = lambda: None
    ) -> None:
        self.files = files
        self.check_every = check_every
        self.reloaded = reloaded
        self._lock = threading.Lock()
        self._signature = files.signature()
        self._context = files.context()
        self._next_check = time.monotonic() + check_every
        self._failed = ""  # the last load error, logged once

    def context(self) -> ssl.SSLContext:
        now = time.monotonic()
        if now < self._next_check:
            return self._context
        with self._lock:
            if now >= self._next_check:
                self._next_check = now + self.check_every
                self._reload()
            return self._context

    def _reload(self) -> None:
        try:
            sig = self.files.signature()
            if sig == self._signature:
                return
            ctx = self.files.context()
        except (OSError, ssl.SSLError, ValueError) as e:
            if str(e) != self._failed:  # once per distinct failure, not every second
                self._failed = str(e)
                log.warning("changed certificate files do not load; serving the previous ones", extra={"error": str(e)})
            return
        self._signature, self._context, self._failed = sig, ctx, ""
        self.reloaded()
        log.info("certificate files reloaded", extra={"cert": self.files.cert})

    def server_context(self) -> ssl.SSLContext:
        """One context for a server that takes a fixed one (asyncio's): each handshake is switched,
        from the server-name callback that OpenSSL calls for every ClientHello, with or without SNI,
        to the context of the files as they are now."""
        ctx = self.files.context()

        def switch(sock: ssl.SSLObject | ssl.SSLSocket, _name: str | None, _ctx: ssl.SSLContext) -> None:
            sock.context = self.context()

        ctx.sni_callback = switch
        return ctx


def self_signed_pem(names: Sequence[str], days: int = SELF_SIGNED_DAYS) -> tuple[bytes, bytes]:
    """(certificate, key) in PEM: an ECDSA P-256 key and a certificate for `names` (host names or IP
    addresses; the first is the common name) that signs itself, valid from a minute ago."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])])
    alt: list[x509.GeneralName] = []
    for name in dict.fromkeys(names):
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alt.append(x509.DNSName(name))
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def self_signed_context(names: Sequence[str]) -> ssl.SSLContext:
    """A server context with a self-signed certificate made now. OpenSSL reads files only, so the
    two are handed to it as anonymous memory files (memfd): the key touches no disk, and a read-only
    root file system (the chart's node pods) is no obstacle."""
    cert, key = self_signed_pem(names)
    fds = [os.memfd_create(name, os.MFD_CLOEXEC) for name in ("tls.crt", "tls.key")]
    try:
        for fd, data in zip(fds, (cert, key), strict=True):
            with open(fd, "wb", closefd=False) as f:
                f.write(data)
        return TlsFiles(*(f"/proc/self/fd/{fd}" for fd in fds)).context()
    finally:
        for fd in fds:
            os.close(fd)
