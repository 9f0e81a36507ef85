"""The node daemon's reload and configuration handling, on a front door that serves nothing: the
same code runs in proxy and NRI mode (node/daemon.py)."""

from __future__ import annotations

import asyncio
import logging
import socket
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
