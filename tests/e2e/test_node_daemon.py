"""The node daemon the same in both modes, against a real containerd: `crihook nri` reloads its hooks
on SIGHUP under the same pid as `crihook serve` does (systemd's `reload` sends SIGHUP), starts the
device reporter when a kubeconfig is configured, registers again when the runtime did not take its
Synchronize answer, and gives a HAMi-core share pod its directories from inside the unit's sandbox."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest

from crihook.base import allocation as al
from crihook.base.config import ProxyConfig
from crihook.hooks.grant import HamiCore
from crihook.simnode import fakenvml
from crihook.simnode.fakenvml import CONFIG_ENV
from crihook.simnode.node import make_sim_node
from tests.e2e.test_gpu_containerd import TOPOLOGY, allocated, env_of
from tests.e2e.test_gpu_nri import free_port, scrape
from tests.e2e.test_install import NRI_UNIT, UNIT
from tests.proxy.test_serve import TEST_HOOK
from tests.proxy.test_serve_reporter import NODE, node_config, wait_for
from tests.support.containerd import Containerd
from tests.support.cri import Cri, container_config, pod_config
from tests.support.daemon import Crihook, install_hook_package, running_crihook
from tests.support.fakekube import FakeKube
from tests.support.nrirelay import LateSynchronize
from tests.support.sandbox import sandboxed, unit_service

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
            given_up = [  # every series also carries the node's name
                v
                for (name, labels), v in scrape(plugin.metrics_listen).items()
                if name == "crihook_nri_unregistered_total" and dict(labels).get("reason") == "unproven"
            ]
            if containerd.runtime.name == "1.7":
                assert "the runtime did not take crihook as its plugin" in plugin.log_text()
                assert given_up == [1]
        finally:
            plugin.stop()


@pytest.mark.parametrize("unit", [UNIT, NRI_UNIT], ids=["proxy", "nri"])
def test_the_hami_core_defaults_are_where_the_units_let_crihook_write(unit: Path) -> None:
    """crihook makes the cache and lock directories itself: by default under the one host path the
    units (ReadWritePaths=) and the chart (a host-path volume) let it write, its state directory."""
    service = unit_service(unit)
    assert service["ProtectSystem"] == "strict"
    writable = service["ReadWritePaths"].split()
    assert ProxyConfig().state_dir in writable
    for path in (HamiCore().cache_root, HamiCore().lock_dir):
        assert path.startswith(ProxyConfig().state_dir + "/"), path


def test_a_hami_core_share_pod_is_created_under_the_units_sandbox(
    containerd: Containerd, nri_socket: Path, containerd_cri: Cri, tmp_path: Path
) -> None:
    """`crihook nri` with the unit's ProtectSystem=strict and ReadWritePaths= (its state directory,
    here the test's; tests/support/sandbox.py), HAMi-core's directories where they are by default
    relative to it: the share pod is created, its container (not root) writes its cache, and the
    file is on the host where HAMi-core's tools look."""
    service = unit_service(NRI_UNIT)
    assert service["ProtectSystem"] == "strict" and service["ReadWritePaths"] == ProxyConfig().state_dir
    node = make_sim_node(tmp_path / "node", TOPOLOGY, char_devices=True)
    plugin = Crihook(tmp_path / "crihook", containerd.address, "", {CONFIG_ENV: str(node.config)}, nri_socket)
    state = plugin.state_dir
    relocate = ProxyConfig().state_dir  # the unit's /var/lib/crihook is the test's state dir
    cache, lock = (p.replace(relocate, str(state), 1) for p in (HamiCore().cache_root, HamiCore().lock_dir))
    config = node.proxy_config(fakenvml.build())
    config = config.replace(f'cache_root = "{node.hami}/containers"', f'cache_root = "{cache}"')
    config = config.replace(f'lock_dir = "{node.hami}/lock"', f'lock_dir = "{lock}"')
    config = config.replace(f'"{node.hami}/*"]', f'"{node.hami}/*", "{state}/hami-core/*"]')
    plugin.config_text = config
    state.mkdir(parents=True)
    plugin.prefix = sandboxed([state])
    plugin.start()
    try:
        assert plugin.pid is not None
        root = next(
            line for line in Path(f"/proc/{plugin.pid}/mountinfo").read_text().splitlines() if line.split()[4] == "/"
        )
        assert "ro" in root.split()[5].split(","), root  # the daemon's / is read-only
        share = {al.GPU_CORE: "30", al.GPU_MEMORY_RATIO: "25"}
        pod = pod_config(
            "shared",
            labels={"koordinator.sh/gpu-isolation-provider": "HAMi-core"},
            annotations=allocated({"minor": 2, "resources": share}),
        )
        ctr = container_config("cuda", pod)
        ctr.linux.security_context.run_as_user.value = 1000  # HAMi-core's cache is written as the image's user
        with containerd_cri.pod(pod) as pod_id, containerd_cri.container(pod_id, ctr, pod) as cid:
            assert env_of(containerd_cri, cid)["CUDA_DEVICE_SM_LIMIT"] == "30"
            containerd_cri.output(cid, "touch", "/tmp/vgpu/cudevshr.cache", "/tmp/vgpulock/0")
            mine = Path(cache) / f"{pod.metadata.uid}_cuda"
            assert (mine / "cudevshr.cache").exists() and (Path(lock) / "0").exists()
    finally:
        plugin.stop()
