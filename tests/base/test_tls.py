"""Serving certificates: the self-signed one a listener makes for itself, and files swapped under a
server that takes one fixed context (asyncio's), on both event loops the daemons run."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import ssl
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
import uvloop
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from crihook.base import tls


def test_self_signed_names_every_name_and_signs_itself() -> None:
    cert_pem, key_pem = tls.self_signed_pem(["gpu-1", "10.0.0.7", "::1", "gpu-1"], days=30)
    cert = x509.load_pem_x509_certificate(cert_pem)
    assert cert.subject == cert.issuer
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "gpu-1"
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["gpu-1"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.0.0.7"), ipaddress.ip_address("::1")]
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.SERVER_AUTH]
    now = datetime.datetime.now(datetime.UTC)
    assert cert.not_valid_before_utc <= now < cert.not_valid_after_utc <= now + datetime.timedelta(days=30)
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
    cert.verify_directly_issued_by(cert)  # signed by its own key
    assert b"PRIVATE KEY" in key_pem
    assert tls.self_signed_pem(["gpu-1"])[1] != key_pem  # a new key each time


def test_self_signed_context_serves_and_leaves_no_file_open() -> None:
    before = set(os.listdir("/proc/self/fd"))
    ctx = tls.self_signed_context(["localhost"])
    assert isinstance(ctx, ssl.SSLContext) and ctx.minimum_version == ssl.TLSVersion.TLSv1_2
    assert set(os.listdir("/proc/self/fd")) <= before


def write_pair(directory: Path, name: str) -> tls.TlsFiles:
    cert, key = tls.self_signed_pem([name])
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tls.crt").write_bytes(cert)
    (directory / "tls.key").write_bytes(key)
    os.chmod(directory / "tls.key", stat.S_IRUSR | stat.S_IWUSR)
    return tls.TlsFiles(str(directory / "tls.crt"), str(directory / "tls.key"))


async def served_name(port: int) -> str:
    """The common name of the certificate a server presents to a client that sends no SNI (as
    Prometheus, dialling a pod's IP address, sends none)."""
    client = ssl.create_default_context()
    client.check_hostname, client.verify_mode = False, ssl.CERT_NONE
    _reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client, server_hostname=None)
    try:
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        name = x509.load_der_x509_certificate(der).subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
        return str(name)
    finally:
        writer.close()


def swap(directory: Path, name: str) -> None:
    """A Secret volume's update: a new directory of files, and the link renamed over the old one."""
    new = directory.parent / f"..{name}"
    write_pair(new, name)
    tmp_link = directory.parent / "..data_tmp"
    tmp_link.symlink_to(new.name)
    os.replace(tmp_link, directory)


@pytest.mark.parametrize("new_loop", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"])
def test_a_fixed_server_context_serves_the_files_as_they_are_now(
    tmp_path: Path, new_loop: Callable[[], asyncio.AbstractEventLoop]
) -> None:
    write_pair(tmp_path / "..first", "first")
    (tmp_path / "data").symlink_to("..first")
    reloads: list[int] = []
    files = tls.TlsFiles(str(tmp_path / "data" / "tls.crt"), str(tmp_path / "data" / "tls.key"))
    certs = tls.Certificates(files, check_every=0, reloaded=lambda: reloads.append(1))

    async def main() -> list[str]:
        async def nothing(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            w.close()

        server = await asyncio.start_server(nothing, "127.0.0.1", 0, ssl=certs.server_context())
        port = server.sockets[0].getsockname()[1]
        try:
            names = [await served_name(port)]
            swap(tmp_path / "data", "second")
            names.append(await served_name(port))
            return names
        finally:
            server.close()
            await server.wait_closed()

    loop = new_loop()
    try:
        assert loop.run_until_complete(main()) == ["first", "second"]
    finally:
        loop.close()
    assert reloads == [1]
