"""The node daemon the same in both modes, against a real containerd: `crihook nri` reloads its hooks
on SIGHUP under the same pid as `crihook serve` does (systemd's `reload` sends SIGHUP), and starts
the device reporter when a kubeconfig is configured."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest

from crihook.simnode.fakenvml import CONFIG_ENV
from tests.proxy.test_serve import TEST_HOOK
from tests.proxy.test_serve_reporter import NODE, node_config, wait_for
from tests.support.containerd import Containerd
from tests.support.cri import Cri, container_config, pod_config
from tests.support.daemon import Crihook, install_hook_package, running_crihook
from tests.support.fakekube import FakeKube

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
