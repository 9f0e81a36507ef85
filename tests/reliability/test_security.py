"""Security properties of the running daemon, checked from outside as an attacker or auditor would:
hooks can not hand containers host paths outside the allowlist, a container without a GPU
allocation never reaches a GPU whatever its image or pod says, and nothing listens beyond loopback.
(The socket's 0600 mode and the refusal of a directory others can write: test_proxy_containerd.py.)
"""

from __future__ import annotations

import os
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.support.containerd import BUSYBOX_IMAGE, Containerd, LayerFile, layer_tar, oci_archive
from tests.support.cri import Cri, CriError, DeviceSpec, container_config, pod_config
from tests.support.daemon import Crihook, install_hook_package, running_crihook

pytestmark = pytest.mark.containerd

# A hook that tries to hand out the host path its container annotation names, as a device or mount.
GRABBER = textwrap.dedent(
    """
    from crihook.hooks.base import Edit, Stage
    from crihook.base.spec import Device, Mount

    class Grabber:
        name = "grabber"
        stages = frozenset({Stage.PRE_CREATE_CONTAINER})
        priority = 50

        def handle(self, ctx):
            path = ctx.container.annotations.get("crihook.test/grab-device")
            if path:
                return Edit(add_devices=[Device("/dev/grabbed", path, "rwm")])
            path = ctx.container.annotations.get("crihook.test/grab-mount")
            if path:
                return Edit(add_mounts=[Mount("/grabbed", path)])
            return None

    def factory(options, node):
        return Grabber()
    """
)

OUTSIDE = ["/dev/sda", "/etc", "/", "/dev/nvidia0/../sda", "dev/nvidia0", "/dev/nvidia-caps/../../etc/shadow"]


@pytest.fixture
def grabbing(containerd: Containerd, tmp_path: Path) -> Iterator[Crihook]:
    env = install_hook_package(tmp_path / "site", "grabber", GRABBER)
    with running_crihook(containerd.address, tmp_path / "crihook", "", env) as proxy:
        yield proxy


@pytest.mark.parametrize("kind", ["device", "mount"])
def test_hook_can_not_grant_paths_outside_the_allowlist(grabbing: Crihook, containerd_cri: Cri, kind: str) -> None:
    with Cri(grabbing.address) as client:
        pod = pod_config(f"grab-{kind}")
        with client.pod(pod) as pod_id:
            for path in OUTSIDE:
                config = container_config("c", pod, annotations={f"crihook.test/grab-{kind}": path})
                with pytest.raises(CriError) as err:
                    client.create_container(pod_id, config, pod)
                assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
                assert f"hook grabber: pod default/grab-{kind} container c: host path {path!r} is outside" in (
                    err.value.details
                )
            assert containerd_cri.list_containers(pod_id) == []


CUDA_LIKE_IMAGE = "localhost/crihook/cuda-like:test"


@pytest.fixture(scope="module")
def cuda_like_image(containerd: Containerd) -> str:
    """A busybox image whose config says NVIDIA_VISIBLE_DEVICES=all, as CUDA base images do."""
    busybox = Path(os.path.realpath("/bin/busybox")).read_bytes()
    entries = [LayerFile("bin"), LayerFile("bin/busybox", busybox)]
    entries += [LayerFile(f"bin/{a}", target="busybox") for a in ("sh", "env", "sleep", "ls", "cat")]
    entries += [LayerFile(d) for d in ("dev", "etc", "proc", "sys")]
    config = {"Env": ["PATH=/bin", "NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_DRIVER_CAPABILITIES=all"], "Cmd": ["sh"]}
    with tempfile.NamedTemporaryFile(suffix=".tar") as archive:
        archive.write(oci_archive(CUDA_LIKE_IMAGE, layer_tar(entries), config))
        archive.flush()
        containerd.import_image(Path(archive.name))
    deadline = time.monotonic() + 10
    while not containerd.cri_sees_image(CUDA_LIKE_IMAGE):
        assert time.monotonic() < deadline, "CRI does not list the imported image"
        time.sleep(0.05)
    return CUDA_LIKE_IMAGE


@pytest.mark.parametrize("image", ["cuda-like", BUSYBOX_IMAGE])
def test_no_gpu_without_an_allocation(proxy_cri: Cri, cuda_like_image: str, image: str) -> None:
    """The installed gpu hook (default config) voids what the image and the pod spec ask for, and
    drops a GPU device node the pod asked for directly."""
    pod = pod_config(f"no-gpu-{'cuda' if image == 'cuda-like' else 'plain'}")
    config = container_config(
        "main",
        pod,
        image=cuda_like_image if image == "cuda-like" else image,
        envs={"NVIDIA_VISIBLE_DEVICES": "all"} if image == BUSYBOX_IMAGE else None,
        devices=[DeviceSpec("/dev/nvidia0", "/dev/nvidia0")],
    )
    with proxy_cri.pod(pod) as pod_id, proxy_cri.container(pod_id, config, pod) as cid:
        env = proxy_cri.output(cid, "env").split()
        assert "NVIDIA_VISIBLE_DEVICES=void" in env
        assert not [e for e in env if e.startswith("NVIDIA_VISIBLE_DEVICES=") and e != "NVIDIA_VISIBLE_DEVICES=void"]
        assert "nvidia0" not in proxy_cri.output(cid, "ls", "/dev").split()


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except FileNotFoundError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def _inet_sockets(pid: int) -> list[tuple[str, str, str, str]]:
    """(table, local address hex, state hex, inode) of the process's TCP and UDP sockets."""
    mine = _socket_inodes(pid)
    found = []
    for table in ("tcp", "tcp6", "udp", "udp6"):
        lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        for line in lines:
            fields = line.split()
            if fields[9] in mine:
                found.append((table, fields[1], fields[3], fields[9]))
    return found


LOOPBACK = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1 and ::1, as /proc writes them


def test_nothing_listens_beyond_loopback_by_default(containerd: Containerd, tmp_path: Path) -> None:
    proxy = Crihook(tmp_path, containerd.address)
    proxy.write_config()
    text = proxy.config_path.read_text()
    proxy.config_path.write_text(text.replace('metrics_listen = ""\n', ""))  # the default metrics endpoint
    proxy.start()
    try:
        assert proxy.pid is not None
        sockets = _inet_sockets(proxy.pid)
        listening = [s for s in sockets if s[0].startswith("tcp") and s[2] == "0A"]
        assert listening, "the default metrics endpoint should be listening (on loopback)"
        for table, local, _, _ in sockets:
            address = local.split(":")[0]
            assert address in LOOPBACK, f"{table} socket bound to {local}"
    finally:
        proxy.stop()
