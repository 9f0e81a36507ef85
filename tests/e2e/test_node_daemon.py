"""The node daemon the same in both modes, against a real containerd: `crihook nri` reloads its hooks
on SIGHUP under the same pid as `crihook serve` does (systemd's `reload` sends SIGHUP), starts the
device reporter when a kubeconfig is configured, and registers again when the runtime did not take
its Synchronize answer."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest

from crihook.simnode.fakenvml import CONFIG_ENV
from tests.e2e.test_gpu_nri import free_port, scrape
from tests.proxy.test_serve import TEST_HOOK
from tests.proxy.test_serve_reporter import NODE, node_config, wait_for
from tests.support.containerd import Containerd
from tests.support.cri import Cri, container_config, pod_config
from tests.support.daemon import Crihook, install_hook_package, running_crihook
from tests.support.fakekube import FakeKube
from tests.support.nrirelay import LateSynchronize

pytestmark = [pytest.mark.containerd, pytest.mark.runtimes("1.7", "2")]


def stamped(cri: Cri, name: str) -> str:
    """What the stamp hook put in a container of a new pod `name`."""
    pod = pod_config(name)
    with cri.pod(pod) as pod_id, cri.container(pod_id, container_config("main", pod), pod) as cid:
        env = dict(line.split("=", 1) for line in cri.output(cid, "env").splitlines() if "=" in line)
    return env.get("CRIHOOK_STAMP", "")


def until_logged(plugin: Crihook, line: str, count: int = 1) -> None:
    deadline = time.monotonic() + 20
    while plugin.log_text().count(line) < count:
        assert plugin.pid is not None, f"crihook exited:\n{plugin.log_tail()}"
        assert time.monotonic() < deadline, plugin.log_tail()
        time.sleep(0.05)


def test_sighup_reloads_the_hooks_under_the_same_pid_in_nri_mode(
    containerd: Containerd, nri_socket: Path, containerd_cri: Cri, tmp_path: Path
) -> None:
    env = install_hook_package(tmp_path / "site", "stamp", TEST_HOOK)
    config = '[hooks.stamp]\nvalue = "v1"\n'
    with running_crihook(containerd.address, tmp_path / "crihook", config, env, nri_socket) as plugin:
        pid = plugin.pid
        assert stamped(containerd_cri, "before") == "v1"
        plugin.config_path.write_text(plugin.config_path.read_text().replace('value = "v1"', 'value = "v2"'))
        plugin.signal(signal.SIGHUP)
        until_logged(plugin, "configuration reloaded")
        assert plugin.pid == pid
        assert stamped(containerd_cri, "after") == "v2"
        # a wrong file keeps the running configuration, and the process
        plugin.config_path.write_text(plugin.config_path.read_text().replace('value = "v2"', "value = 3"))
        plugin.signal(signal.SIGHUP)
        until_logged(plugin, "reload failed, keeping the running configuration")
        assert plugin.pid == pid
        assert stamped(containerd_cri, "kept") == "v2"
        assert plugin.log_text().count("registered with the runtime") == 1  # never dropped the runtime


def test_nri_mode_starts_the_device_reporter(
    containerd: Containerd, nri_socket: Path, fake_nvml: Any, tmp_path: Path
) -> None:
    fake = fake_nvml("dgx-h100")
    with FakeKube() as kube:
        kube.create("nodes", {"metadata": {"name": NODE}, "status": {"capacity": {}, "allocatable": {}}})
        kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig")
        config = node_config(fake, tmp_path, str(kubeconfig))
        env = {CONFIG_ENV: str(fake.config)}
        with running_crihook(containerd.address, tmp_path / "crihook", config, env, nri_socket) as plugin:
            assert wait_for(lambda: kube.get("devices", NODE).get("status", {}).get("gpuCount")) == 8
            assert plugin.log_text().count("device reporter started") == 1


def test_a_synchronize_answer_the_runtime_did_not_take_is_noticed_and_crihook_registers_again(
    containerd: Containerd, nri_socket: Path, containerd_cri: Cri, tmp_path: Path
) -> None:
    """The answer reaches the runtime after its 2 s request timeout. containerd 2.x (NRI v0.8) closes
    the connection and crihook dials again; 1.7.24 (NRI v0.6.1) neither takes the plugin nor closes
    it, so crihook, answered in time as far as it knows, must see that the runtime creates containers
    without calling it, say so, and register again. Either way it ends registered, hooking containers."""
    env = install_hook_package(tmp_path / "site", "stamp", TEST_HOOK)
    relay = LateSynchronize(tmp_path / "relay.sock", nri_socket, hold=3.0)
    plugin = Crihook(tmp_path / "crihook", containerd.address, '[hooks.stamp]\nvalue = "v1"\n', env, relay.listen)
    plugin.metrics_listen = f"127.0.0.1:{free_port()}"
    with relay.running():
        plugin.start()  # READY=1 follows crihook's own answer, not the runtime's taking it
        try:
            assert relay.held.wait(30)
            deadline = time.monotonic() + 60
            probes = 0
            while plugin.log_text().count("synchronized with the runtime") < 2:
                assert time.monotonic() < deadline, plugin.log_tail()
                stamped(containerd_cri, f"probe-{probes}")  # created unhooked while the runtime ignores crihook
                probes += 1
                time.sleep(0.5)
            assert stamped(containerd_cri, "after") == "v1"
            assert plugin.pid is not None and relay.connections == 2
            given_up = scrape(plugin.metrics_listen).get(("crihook_nri_unregistered_total", (("reason", "unproven"),)))
            if containerd.runtime.name == "1.7":
                assert "the runtime did not take crihook as its plugin" in plugin.log_text()
                assert given_up == 1
        finally:
            plugin.stop()
