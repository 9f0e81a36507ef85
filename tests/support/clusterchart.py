"""crihook on the test cluster the way a user puts it on a GPU node that cannot pull: the images
imported into the node's containerd, charts/crihook installed with the real helm.

Images: crihook's is deploy/image/build-offline.py's archive; the second kube-scheduler of the
chart's deployment mode is `registry.k8s.io/kube-scheduler:<the cluster's version>`, here an image
holding the suite's own kube binary (tests/kube) and the C libraries it links, named as the
chart expects it.

Values: only what a user of such a node sets (docs/helm.md): one replica of each scheduler (one
node; the crihook scheduler's replicas may share it, `scheduler.antiAffinity: preferred`), where
containerd's NRI and CRI sockets, its CDI spec dir and kubelet's root dir are, the driver's root
(`node.driverRoot`, here the simulated node's directory: its fake libnvidia-ml.so.1 in
usr/lib/x86_64-linux-gnu, as Debian's driver packages put it, beside its topology), HAMi-core's
library and preload file (`node.hamiCore`, the simulated node's stand-ins), and a state dir. The
simulated node's device nodes and sysfs are in that directory too, so its `[node]` dev_root and
sys_root point there (`node.config`); a real node has them at /dev and /sys.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

from crihook.base.oci import LayerFile, layer_tar, oci_archive
from crihook.simnode.containerd import _cached, busybox_archive
from tests.support.cluster import ROOT, Cluster, ClusterError, eventually
from tests.support.helm import CHART, helm

NAMESPACE = "crihook"
RELEASE = "crihook"
DRIVER_MOUNT = "/run/crihook/driver"  # where the chart mounts node.driverRoot in the node pods
KUBE_SCHEDULER_REPOSITORY = "registry.k8s.io/kube-scheduler"


def crihook_archive() -> Path:
    """The crihook image as deploy/image/build-offline.py builds it (cached by its inputs)."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "deploy" / "image" / "build-offline.py")], capture_output=True, text=True, cwd=ROOT
    )
    if done.returncode != 0:
        raise ClusterError(f"deploy/image/build-offline.py failed: {done.stderr.strip()[-2000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def _libraries(binary: Path) -> list[Path]:
    """The shared libraries `binary` loads, from ldd (the loader included)."""
    out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        words = line.split()
        path = words[2] if "=>" in words and len(words) > 2 else words[0]
        if path.startswith("/"):
            found.append(Path(path))
    return found


def kube_scheduler_archive(kube: Path, version: str) -> Path:
    """`registry.k8s.io/kube-scheduler:<version>`: the kube binary, its libraries, and a
    `kube-scheduler` on PATH (the chart's command) that runs it as kube-scheduler."""
    ref = f"{KUBE_SCHEDULER_REPOSITORY}:{version}"

    def build() -> bytes:
        busybox = Path(shutil.which("busybox") or "/bin/busybox").read_bytes()
        entries = [LayerFile("bin"), LayerFile("bin/busybox", busybox), LayerFile("bin/sh", target="busybox")]
        entries += [LayerFile("usr"), LayerFile("usr/local"), LayerFile("usr/local/bin")]
        entries.append(LayerFile("usr/local/bin/kube", kube.read_bytes()))
        script = b'#!/bin/sh\nexec /usr/local/bin/kube kube-scheduler "$@"\n'
        entries.append(LayerFile("usr/local/bin/kube-scheduler", script))
        dirs: set[str] = set()
        for lib in _libraries(kube):
            for parent in reversed(lib.parents[:-1]):
                if str(parent) not in dirs:
                    dirs.add(str(parent))
                    entries.append(LayerFile(str(parent).lstrip("/")))
            entries.append(LayerFile(str(lib).lstrip("/"), lib.resolve().read_bytes()))
        entries += [LayerFile("tmp", mode=0o1777), LayerFile("etc")]
        return oci_archive(ref, layer_tar(entries), {"Env": ["PATH=/usr/local/bin:/bin"], "User": "65532"})

    return _cached("kube-scheduler", [str(kube).encode(), ref.encode()], build)


def import_images(cluster: Cluster) -> None:
    """crihook's image and the second kube-scheduler's, into the node's containerd."""
    assert cluster.containerd is not None
    cluster.containerd.import_image(crihook_archive())
    cluster.containerd.import_image(kube_scheduler_archive(cluster.kube, cluster.version))


def user_values(cluster: Cluster) -> dict[str, Any]:
    """The values a user of this node passes to `helm install` (module docstring)."""
    values: dict[str, Any] = {
        # one node: a second replica, where a test scales to two, may share it
        "scheduler": {"replicas": 1, "antiAffinity": "preferred"},
        "kubeScheduler": {"deployment": {"replicas": 1}},
        # the node pods use the host's network: a port of this cluster's own, as the clusters of two
        # checkouts on one machine are two nodes sharing one host
        "metrics": {"node": {"port": cluster.node_metrics_port}},
    }
    if cluster.mode == "proxy":  # the node runs `crihook serve` itself (install.sh): no node pods
        values["node"] = {"enabled": False}
        return values
    assert cluster.containerd is not None and cluster.sim is not None
    values["node"] = {
        "nri": {"socket": str(cluster.containerd.nri_socket)},
        "runtimeSocket": str(cluster.containerd.socket),
        "cdiSpecDirs": [str(cluster.containerd.cdi_spec_dir)],
        "kubeletRootDir": str(cluster.kubelet_root),
        "driverRoot": str(cluster.sim.root),
        "stateDir": str(cluster.base / "crihook-state"),
        # where the simulated node has HAMi-core's library and preload file, as HAMi installs them
        "hamiCore": {
            "library": str(cluster.sim.hami / "libvgpu.so"),
            "preloadFile": str(cluster.sim.hami / "ld.so.preload"),
        },
        "config": {"node": {"dev_root": f"{DRIVER_MOUNT}/dev", "sys_root": f"{DRIVER_MOUNT}/sys"}},
    }
    return values


def run_helm(cluster: Cluster, *args: str, timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
    cmd = [helm(), f"--kubeconfig={cluster.kubeconfig}", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise ClusterError(f"helm {' '.join(args)} failed: {done.stderr.strip()}\n{cluster.logs()}")
    return done


def values_args(values: dict[str, Any]) -> list[str]:
    return [a for k, v in values.items() for a in ("--set-json", f"{k}={json.dumps(v)}")]


def install(cluster: Cluster, values: dict[str, Any]) -> None:
    """`helm install --wait`: returns once every object the chart made is ready."""
    run_helm(
        cluster, "install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--create-namespace",
        "--wait", "--timeout=240s", *values_args(values),
    )  # fmt: skip


def wait_node_plugin(cluster: Cluster, timeout: float = 60.0) -> None:
    """In NRI mode, until the node pod's plugin has registered with containerd and synchronized.
    The node pods have no readiness probe: `helm install --wait` returns once they run, and a GPU
    container created before the plugin registered gets no GPUs."""
    if cluster.mode != "nri":
        return
    core = cluster.core()

    def synchronized() -> bool:
        pods = core.list_namespaced_pod(NAMESPACE, label_selector="app.kubernetes.io/component=node").items
        logs = [core.read_namespaced_pod_log(p.metadata.name, NAMESPACE, container="nri") for p in pods]
        return bool(logs) and all("synchronized with the runtime" in log for log in logs)

    if not eventually(synchronized, True, timeout):
        said = []
        for pod in core.list_namespaced_pod(NAMESPACE, label_selector="app.kubernetes.io/component=node").items:
            log = core.read_namespaced_pod_log(pod.metadata.name, NAMESPACE, container="nri", tail_lines=20)
            said.append(f"{pod.metadata.name}: {pod.status.container_statuses}\n{log}")
        raise ClusterError(f"crihook's NRI plugin did not synchronize within {timeout}s:\n" + "\n".join(said))


def uninstall(cluster: Cluster) -> None:
    run_helm(cluster, "uninstall", RELEASE, "--namespace", NAMESPACE, "--wait", "--timeout=120s")


def upgrade(cluster: Cluster, values: dict[str, Any]) -> None:
    """`helm upgrade --wait` to exactly these values (not merged with the last ones)."""
    run_helm(
        cluster, "upgrade", RELEASE, str(CHART), "--namespace", NAMESPACE, "--reset-values",
        "--wait", "--timeout=240s", *values_args(values),
    )  # fmt: skip


def extender_values(cluster: Cluster, values: dict[str, Any] | None = None) -> dict[str, Any]:
    """The user's values (or `values`) for extender mode: their own kube-scheduler (the cluster's)
    reads the extender stanza from the chart's ConfigMap, with the CA copied to `caFile` on its host."""
    values = user_values(cluster) if values is None else values
    files = cluster.base / "extender"
    values["kubeScheduler"] = {
        "mode": "extender",
        "caFile": str(files / "ca.crt"),
        "certFile": str(files / "client.crt"),
        "keyFile": str(files / "client.key"),
        "kubeconfig": str(cluster.base / "scheduler.kubeconfig"),
    }
    return values


def use_extender(cluster: Cluster, values: dict[str, Any] | None = None) -> None:
    """Switch the release to extender mode (with `values`, from extender_values) and restart the
    cluster's kube-scheduler with the stanza, its CA and its client certificate copied from the
    chart's Secret, as docs/helm.md tells a user to."""
    values = extender_values(cluster) if values is None else values
    upgrade(cluster, values)
    core = cluster.core()
    stanza = core.read_namespaced_config_map(f"{RELEASE}-kube-scheduler", NAMESPACE).data["config.yaml"]
    secret = core.read_namespaced_secret(f"{RELEASE}-scheduler-tls", NAMESPACE).data
    files = values["kubeScheduler"]
    for key, path in (("ca.crt", files["caFile"]), ("client.crt", files["certFile"]), ("client.key", files["keyFile"])):
        Path(path).parent.mkdir(exist_ok=True)
        Path(path).write_bytes(base64.b64decode(secret[key]))
    config = Path(files["caFile"]).parent / "config.yaml"
    config.write_text(stanza)
    cluster.start_scheduler(config)


def use_second_scheduler(cluster: Cluster) -> None:
    """Back to the chart's default (deployment mode) and the stock kube-scheduler."""
    upgrade(cluster, user_values(cluster))
    cluster.start_scheduler()


def kubectl(cluster: Cluster, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    """kubectl v1.37 (tests/helm.sh keeps it beside helm) as the cluster's admin; not checked."""
    binary = Path(helm()).parent / "kubectl"
    cmd = [str(binary), f"--kubeconfig={cluster.kubeconfig}", *args]
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=60)


CUDA_ALL_IMAGE = "localhost/crihook/cuda-all:test"


def cuda_all_archive() -> Path:
    """The busybox test image as a CUDA base image ships: NVIDIA_VISIBLE_DEVICES=all in its config."""
    busybox = busybox_archive()

    def build() -> bytes:
        with tarfile.open(busybox) as tar:
            blobs = [m for m in tar.getmembers() if m.name.startswith("blobs/") and m.isfile()]
            biggest = max(blobs, key=lambda m: m.size)  # the layer: the manifest and config are small
            extracted = tar.extractfile(biggest)
            assert extracted is not None
            layer = extracted.read()
        env = ["PATH=/bin", "NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_DRIVER_CAPABILITIES=compute,utility"]
        return oci_archive(CUDA_ALL_IMAGE, layer, {"Env": env, "Cmd": ["sh"]})

    return _cached("cuda-all", [busybox.read_bytes()], build)
