"""The node daemon's reload and configuration handling, on a front door that serves nothing: the
same code runs in proxy and NRI mode (node/daemon.py)."""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from crihook.base import config as cfgmod
from crihook.hooks.registry import build_chain
from crihook.node.daemon import NodeDaemon, serve_metrics
from crihook.node.lifecycle import Lifecycle
from crihook.node.store import Store
from tests.support.loop import assert_loop_keeps_ticking


class Idle:
    """A front door that serves nothing and records the settings it is given."""

    name = "idle"

    def __init__(self) -> None:
        self.reconfigured: list[cfgmod.Config] = []

    async def prepare(self) -> None: ...

    async def rebuild(self, store: Store) -> None: ...

    async def serve(self, lifecycle: Lifecycle, ready: Callable[[str], None]) -> int:
        return 0

    def stop(self) -> None: ...

    def reconfigure(self, cfg: cfgmod.Config) -> None:
        self.reconfigured.append(cfg)

    async def close(self) -> None: ...


def daemon_on(path: Path, state: Path) -> tuple[NodeDaemon, Idle]:
    door = Idle()
    daemon = NodeDaemon(cfgmod.load(str(path)), door, str(path))
    daemon.store = Store(state)
    daemon.lifecycle = Lifecycle(build_chain(daemon.cfg.hooks, daemon.cfg.node), daemon.store)
    return daemon, door


async def test_a_reload_stuck_on_the_file_system_never_freezes_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGHUP reads the configuration file and builds the hooks (which read their own directories)
    on a thread: a read that hangs leaves the loop serving with the running hooks, and the new ones
    take over once it returns."""
    path = tmp_path / "crihook.toml"
    path.write_text('[hooks]\ndisabled = ["remote"]\n[nri]\nsynchronize = "evict"\n')
    daemon, door = daemon_on(path, tmp_path / "state")
    assert daemon.lifecycle is not None and daemon.store is not None
    running = daemon.lifecycle.chain
    release, reading = threading.Event(), threading.Event()
    real_load = cfgmod.load

    def stalled_load(*args: object, **kwargs: object) -> cfgmod.Config:
        reading.set()
        release.wait(10)
        return real_load(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(cfgmod, "load", stalled_load)
    path.write_text('[hooks]\ndisabled = ["remote", "rdma"]\n[nri]\nsynchronize = "report"\n')
    try:
        daemon.reload()
        assert await asyncio.to_thread(reading.wait, 10), "the reload never read the file"
        await assert_loop_keeps_ticking()
        assert daemon.lifecycle.chain is running  # still serving with the running hooks
    finally:
        release.set()
    for _ in range(200):
        if daemon.lifecycle.chain is not running:
            break
        await asyncio.sleep(0.02)
    assert [r.hook.name for r in daemon.lifecycle.chain.hooks] == ["gpu"]
    assert [c.nri.synchronize for c in door.reconfigured] == ["report"]  # the front door's own settings
    for task in list(daemon._tasks):  # the running chain's close, due after its grace
        task.cancel()
    await running.close()
    await daemon.lifecycle.chain.close()
    await daemon.store.close()


async def test_a_wrong_file_at_reload_keeps_the_running_configuration(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "crihook.toml"
    path.write_text('[hooks]\ndisabled = ["remote"]\n')
    daemon, door = daemon_on(path, tmp_path / "state")
    assert daemon.lifecycle is not None and daemon.store is not None
    running = daemon.lifecycle.chain
    path.write_text("[hooks]\ndisabled = 3\n")
    with caplog.at_level(logging.ERROR, "crihook.node"):
        await daemon._reload()
    assert daemon.lifecycle.chain is running and door.reconfigured == []
    assert "reload failed, keeping the running configuration" in caplog.text
    await running.close()
    await daemon.store.close()


async def test_the_deprecated_runtime_endpoint_is_said_at_start_and_at_reload(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "crihook.toml"
    path.write_text(f'[proxy]\nruntime_endpoint = "unix:///old.sock"\nstate_dir = "{tmp_path}/state"\n')
    daemon, _ = daemon_on(path, tmp_path / "state")
    assert daemon.cfg.node.runtime_endpoint == "unix:///old.sock"
    assert daemon.lifecycle is not None and daemon.store is not None
    running = daemon.lifecycle.chain
    with caplog.at_level(logging.WARNING, "crihook.node"):
        await daemon._reload()
    (record,) = [r for r in caplog.records if r.getMessage() == "deprecated configuration"]
    assert "[proxy].runtime_endpoint is deprecated: move it to [node].runtime_endpoint" in record.__dict__["detail"]
    for task in list(daemon._tasks):
        task.cancel()
    await running.close()
    await daemon.lifecycle.chain.close()
    await daemon.store.close()


async def test_a_metrics_address_taken_is_said_and_the_daemon_serves_without(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        listen = f"127.0.0.1:{taken.getsockname()[1]}"
        with caplog.at_level(logging.ERROR, "crihook.node"):
            assert await serve_metrics(cfgmod.parse({"proxy": {"metrics_listen": listen}})) is None
    (record,) = [r for r in caplog.records if r.getMessage() == "metrics endpoint not started"]
    assert record.__dict__["listen"] == listen and "in use" in record.__dict__["error"]
    with pytest.raises(cfgmod.ConfigError, match=r"\[proxy\]\.metrics_listen: .*not a loopback address"):
        await serve_metrics(cfgmod.parse({"proxy": {"metrics_listen": "0.0.0.0:9317"}}))


async def _scrape_tls(port: int, token: str) -> tuple[bytes, str]:
    """(the answer's status line, the served certificate's common name), with no verification and no
    server name, as Prometheus scrapes a pod's IP address with insecureSkipVerify."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    client = ssl.create_default_context()
    client.check_hostname, client.verify_mode = False, ssl.CERT_NONE
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client, server_hostname=None)
    der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    name = x509.load_der_x509_certificate(der).subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
    writer.write(f"GET /metrics HTTP/1.1\r\nAuthorization: Bearer {token}\r\n\r\n".encode())
    reply = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return reply.split(b"\r\n", 1)[0], str(name)


async def test_metrics_that_take_tokens_are_served_over_tls_with_a_certificate_of_its_own(tmp_path: Path) -> None:
    from tests.support.fakekube import FakeKube

    with FakeKube() as kube:
        kube.tokens = {"prom": {"username": "system:serviceaccount:monitoring:prometheus", "groups": []}}
        kube.allowed = {("system:serviceaccount:monitoring:prometheus", "/metrics", "get")}
        proxy = {"metrics_listen": "0.0.0.0:0", "metrics_auth_kubeconfig": str(kube.write_kubeconfig(tmp_path / "kc"))}
        server = await serve_metrics(cfgmod.parse({"proxy": proxy, "node": {"name": "gpu-7"}}))
        port = server.sockets[0].getsockname()[1]
        try:
            assert await _scrape_tls(port, "prom") == (b"HTTP/1.1 200 OK", "gpu-7")
            assert (await _scrape_tls(port, "forged"))[0] == b"HTTP/1.1 401 Unauthorized"
            reader, writer = await asyncio.open_connection("127.0.0.1", port)  # plain HTTP: no answer
            writer.write(b"GET /metrics HTTP/1.1\r\nAuthorization: Bearer prom\r\n\r\n")
            assert await asyncio.wait_for(reader.read(), 5) == b""
            writer.close()
        finally:
            server.close()
            await server.wait_closed()


async def test_metrics_served_with_the_operators_certificate(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from crihook.base.tls import self_signed_pem

    cert, key = self_signed_pem(["crihook-node-metrics"])
    (tmp_path / "tls.crt").write_bytes(cert)
    (tmp_path / "tls.key").write_bytes(key)
    files = {"metrics_tls_cert": str(tmp_path / "tls.crt"), "metrics_tls_key": str(tmp_path / "tls.key")}
    server = await serve_metrics(cfgmod.parse({"proxy": {"metrics_listen": "127.0.0.1:0", **files}}))
    try:
        assert await _scrape_tls(server.sockets[0].getsockname()[1], "") == (b"HTTP/1.1 200 OK", "crihook-node-metrics")
    finally:
        server.close()
        await server.wait_closed()
    with pytest.raises(cfgmod.ConfigError, match=r"\[proxy\]\.metrics_tls_key: give the certificate and its key"):
        cfgmod.parse({"proxy": {"metrics_tls_cert": files["metrics_tls_cert"]}})
    (tmp_path / "tls.key").write_bytes(b"not a key")
    with caplog.at_level(logging.ERROR, "crihook.node"):
        assert await serve_metrics(cfgmod.parse({"proxy": {"metrics_listen": "127.0.0.1:0", **files}})) is None
    (record,) = [r for r in caplog.records if r.getMessage() == "metrics endpoint not started"]
    assert "PEM lib" in record.__dict__["error"]
