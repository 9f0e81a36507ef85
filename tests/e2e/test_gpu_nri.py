"""The gpu hook in NRI mode: `crihook nri` (a real process) registered with the test containerd
(1.7.24 with NRI turned on, and sid's 2.x), kubelet's part played over CRI straight to containerd,
the same simulated node as the proxy-mode tests (tests/e2e/test_gpu_containerd.py). What crihook
decides reaches the container whenever the runtime can apply it; what it can not apply is refused,
never dropped (docs/nri.md)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from crihook.devices import usage
from crihook.simnode import fakenvml
from crihook.simnode.node import make_sim_node
from tests.e2e import test_gpu_containerd as proxy_mode
from tests.e2e.test_gpu_containerd import (
    TOPOLOGY,
    GpuNode,
    allocated,
    allowed,
    check_privileged,
    env_of,
    gpu_devices,
    gpu_nodes,
    leaky,
    spec_of,
)
from tests.support.containerd import Containerd
from tests.support.cri import Cri, CriError, container_config, pod_config
from tests.support.daemon import running_crihook
from tests.support.gpu_fixtures import Entry, write_checkpoint

pytestmark = [pytest.mark.containerd, pytest.mark.runtimes("1.7", "2")]
cri = proxy_mode.cri  # the proxy tests' client fixture, here on this module's gpu_node


@pytest.fixture(scope="module")
def gpu_node(containerd: Containerd, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GpuNode]:
    if not containerd.nri:
        pytest.skip(f"containerd {containerd.runtime.name} has no NRI")
    node = make_sim_node(tmp_path_factory.mktemp("nri-node"), TOPOLOGY, char_devices=True)
    env = {fakenvml.CONFIG_ENV: str(node.config)}
    config = node.proxy_config(fakenvml.build())
    with running_crihook(containerd.address, node.root / "crihook", config, env, containerd.nri_socket) as plugin:
        yield GpuNode(node, plugin)


def refused(cri: Cri, pod_id: str, config: object, pod: object) -> str:
    with pytest.raises(CriError) as err:
        cri.create_container(pod_id, config, pod)  # type: ignore[arg-type]
    assert cri.list_containers(pod_id) == []  # containerd created nothing
    return err.value.details


def test_scheduled_gpus_reach_the_container_and_an_image_all_is_overwritten(gpu_node: GpuNode, cri: Cri) -> None:
    node = gpu_node.node
    pod = pod_config("trainer", annotations=allocated({"minor": 0, "id": node.uuid(0)}, {"minor": 3}))
    cuda = container_config("cuda", pod, envs={"NVIDIA_VISIBLE_DEVICES": "all"})
    with cri.pod(pod) as pod_id, cri.container(pod_id, cuda, pod) as cid:
        assert env_of(cri, cid)["NVIDIA_VISIBLE_DEVICES"] == f"{node.uuid(3)},{node.uuid(0)}"
        spec = spec_of(cri, cid)
        assert gpu_devices(spec) == gpu_nodes(3, 0)
        assert {(major, minor) for major, minor, _ in allowed(spec)} == {
            (major, minor) for _, major, minor in gpu_nodes(3, 0).values()
        }
        assert {"nvidia0", "nvidia3"} <= set(cri.output(cid, "ls", "/dev").split())
    assert "container created" in gpu_node.proxy.log_text()


def test_pod_without_allocation_gets_void(gpu_node: GpuNode, cri: Cri) -> None:
    pod = pod_config("web")
    with cri.pod(pod) as pod_id:
        app = container_config("app", pod, envs={"NVIDIA_VISIBLE_DEVICES": "all"})
        with cri.container(pod_id, app, pod) as cid:
            assert env_of(cri, cid)["NVIDIA_VISIBLE_DEVICES"] == "void"
            assert gpu_devices(spec_of(cri, cid)) == {}


def test_a_device_the_runtime_can_not_take_away_is_refused(gpu_node: GpuNode, containerd: Containerd, cri: Cri) -> None:
    """A device plugin's node for a GPU the scheduler did not choose: NRI drops device removals and
    can not touch its cgroup rule, so the container is refused, naming the runtime."""
    pod = pod_config("trainer", annotations=allocated({"minor": 2}))
    with cri.pod(pod) as pod_id:
        why = refused(cri, pod_id, leaky("cuda", pod, gpu_node.node.dev_root), pod)
    assert "removing device /dev/nvidia1 (no NRI version applies device removals)" in why
    assert "c 195:1" in why and "proxy mode can" in why
    assert "container cuda of pod default/trainer" in why
    assert "containerd 1.7.24" in why or "containerd 2." in why


def test_a_privileged_container_is_not_refused_for_the_devices_its_privilege_gives(gpu_node: GpuNode, cri: Cri) -> None:
    """The same container unprivileged is refused (the test above): privilege alone lets it in."""
    check_privileged(gpu_node, cri)
    pod = pod_config("plain-agent")
    with cri.pod(pod) as pod_id:
        why = refused(cri, pod_id, leaky("agent", pod, gpu_node.node.dev_root), pod)
    assert "removing device /dev/nvidia1" in why


def test_forged_allocation_is_refused_naming_the_pod(gpu_node: GpuNode, cri: Cri) -> None:
    pod = pod_config("forged", annotations=allocated({"minor": 7}))
    with cri.pod(pod) as pod_id:
        why = refused(cri, pod_id, container_config("main", pod), pod)
    assert "pod default/forged container main" in why and "gpu minor 7: no such GPU on this node" in why


def test_cdi_annotation_for_an_ungranted_gpu_does_not_reach_it(gpu_node: GpuNode, cdi_spec_dir: Path, cri: Cri) -> None:
    """containerd resolves the annotation before crihook is asked; its node and rule are refused."""
    node = gpu_node.node
    spec = {
        "cdiVersion": "0.5.0",
        "kind": "nvidia.com/gpu",
        "devices": [
            {
                "name": node.uuid(1),
                "containerEdits": {
                    "deviceNodes": [{"path": "/dev/nvidia1", "hostPath": str(node.dev_root / "nvidia1")}]
                },
            }
        ],
    }
    (cdi_spec_dir / "gpus.json").write_text(json.dumps(spec))
    pod = pod_config("cdi", annotations=allocated({"minor": 2}))
    sneaky = container_config("main", pod, annotations={"cdi.k8s.io/sneaky": f"nvidia.com/gpu={node.uuid(1)}"})
    with cri.pod(pod) as pod_id:
        # containerd picks a new spec up within about a second (runtimes.md); before, it refuses the
        # device as unresolvable itself
        deadline = time.monotonic() + 15
        while "c 195:1" not in (why := refused(cri, pod_id, sneaky, pod)) and time.monotonic() < deadline:
            time.sleep(0.2)
    assert "/dev/nvidia1" in why and "c 195:1" in why


def test_device_plugin_env_is_replaced_by_the_schedulers_choice(gpu_node: GpuNode, cri: Cri) -> None:
    """NVIDIA's device plugin in its default strategy injects only NVIDIA_VISIBLE_DEVICES."""
    node = gpu_node.node
    pod = pod_config("plugin", annotations=allocated({"minor": 2}))
    write_checkpoint(node.checkpoint, [Entry(pod.metadata.uid, "main", [node.uuid(1)])])
    (node.kubelet / "pods" / pod.metadata.uid).mkdir(parents=True, exist_ok=True)
    main = container_config("main", pod, envs={"NVIDIA_VISIBLE_DEVICES": node.uuid(1)})
    try:
        with cri.pod(pod) as pod_id, cri.container(pod_id, main, pod) as cid:
            assert env_of(cri, cid)["NVIDIA_VISIBLE_DEVICES"] == node.uuid(2)
            assert set(gpu_devices(spec_of(cri, cid))) & {"/dev/nvidia1", "/dev/nvidia2"} == {"/dev/nvidia2"}
    finally:
        os.rmdir(node.kubelet / "pods" / pod.metadata.uid)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def scrape(listen: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The metrics endpoint's samples: (name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://{listen}/metrics", timeout=30) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def top_rows(config: Path) -> list[dict[str, object]]:
    """`crihook top --once --json`'s rows; none while the daemon has not collected yet."""
    done = subprocess.run(
        [sys.executable, "-m", "crihook.cli", "top", "--config", str(config), "--once", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    rows: list[dict[str, object]] = json.loads(done.stdout)["rows"] if done.returncode == 0 else []
    return rows


def test_gpu_usage_is_collected_in_nri_mode(gpu_node: GpuNode, cri: Cri) -> None:
    """`crihook nri` starts the usage collector once Synchronize rebuilt the store: a process NVML
    reports on the container's granted GPU (the container's own, so its real cgroup names it) shows in
    `crihook top` and in the per-container series, under the pod crihook adopted at Synchronize."""
    plugin, node = gpu_node.proxy, gpu_node.node
    gpu = node.doc["gpus"][1]
    base = plugin.config_text
    pod = pod_config("trainer", namespace="ml", annotations=allocated({"minor": gpu["minor"], "id": gpu["uuid"]}))
    try:
        with cri.pod(pod) as pod_id, cri.container(pod_id, container_config("cuda", pod), pod) as cid:
            pid = json.loads(cri.container_status(cid, verbose=True).info["info"])["pid"]
            gpu["processes"] = [{"pid": pid, "used_memory": 3 << 30, "sm_util": 55}]
            node.config.write_text(json.dumps(node.doc))
            plugin.stop()
            plugin.metrics_listen = f"127.0.0.1:{free_port()}"
            plugin.write_config(base + "\n[usage]\ninterval_seconds = 0.2\n")
            (plugin.state_dir / usage.STATE_FILE).unlink(missing_ok=True)  # the last daemon's collection
            plugin.start()
            deadline = time.monotonic() + 30  # the first collection follows READY=1 at once; bounded wait
            while not (rows := top_rows(plugin.config_path)) and time.monotonic() < deadline:
                time.sleep(0.2)
            samples = scrape(plugin.metrics_listen)
    finally:
        gpu.pop("processes", None)
        node.config.write_text(json.dumps(node.doc))
        plugin.stop()
        plugin.metrics_listen = ""
        plugin.write_config(base)
        plugin.start()
    assert len(rows) == 1, rows
    row = rows[0]
    assert (row["namespace"], row["pod"], row["container"], row["container_id"]) == ("ml", "trainer", "cuda", cid)
    assert (row["used_memory"], row["sm_util"], row["granted_core"]) == (3 << 30, 55.0, 100)
    assert row["gpus"] == [str(gpu["minor"])] and row["pids"] == [pid]
    # dcgm-exporter's labels (gpu: the NVML index; UUID), and the node's name on every series
    assert all(dict(labels).get("node") for _, labels in samples)
    samples = {(name, tuple(kv for kv in labels if kv[0] != "node")): v for (name, labels), v in samples.items()}
    index = str(node.doc["gpus"].index(gpu))
    labels = (("UUID", gpu["uuid"]), ("container", "cuda"), ("gpu", index), ("namespace", "ml"), ("pod", "trainer"))
    assert samples[("crihook_gpu_memory_used_bytes", labels)] == 3 << 30
    assert samples[("crihook_gpu_sm_utilization_ratio", labels)] == 0.55
    assert samples[("crihook_gpu_granted_core_ratio", labels)] == 1
    assert samples[("crihook_gpu_granted_memory_bytes", labels)] == gpu["memory_total"]
