"""The scheduler image, built offline by deploy/image/build-offline.py (Debian from Debian's
packages, crihook's wheel and its dependencies from PyPI), imported into the suite's containerd and
run through CRI as kubelet would run the Deployment's container: the image's own entrypoint and
user, a read-only root file system, `crihook scheduler` reaching the API server (the fake one, over
loopback: the test pods share the host's network) until /healthz and /readyz answer.

A cold build takes minutes (docs/testing.md has the figure); the archive is cached by its inputs."""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import time
from pathlib import Path

import pytest

from crihook.proto import runtime_v1_pb2 as api
from tests.support.containerd import Containerd
from tests.support.cri import Cri, container_config, pod_config
from tests.support.fakekube import FakeKube
from tests.support.image_build import offline

# one release is enough to show the image runs; the system's 1.6 is always there
pytestmark = [pytest.mark.slow, pytest.mark.containerd, pytest.mark.runtimes("1.6")]
IMPORT_TIMEOUT = 300.0  # about 450 MB unpacked into overlayfs on a busy machine


@pytest.fixture(scope="module")
def archive() -> Path:
    if shutil.which("mmdebstrap") is None:
        pytest.skip("needs mmdebstrap (tests/run.sh installs it)")
    return offline.build()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(port: int, path: str) -> int | None:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", path)
        return conn.getresponse().status
    except OSError:
        return None


def test_scheduler_runs_from_the_offline_image(
    archive: Path, containerd: Containerd, containerd_cri: Cri, tmp_path: Path
) -> None:
    ref = offline.ref()
    containerd.ctr("images", "import", "--snapshotter", "overlayfs", str(archive), timeout=IMPORT_TIMEOUT)
    deadline = time.monotonic() + 10
    while not containerd_cri.image_present(ref):
        assert time.monotonic() < deadline, f"CRI does not list {ref} after the import"
        time.sleep(0.1)
    port = free_port()
    with FakeKube() as kube:
        kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig")
        kubeconfig.chmod(0o644)  # the image's user (65532) reads it
        pod = pod_config("crihook-scheduler", namespace="kube-system")
        pod.log_directory = str(tmp_path / "logs")
        config = container_config("scheduler", pod, image=ref, command=())  # the image's entrypoint
        config.log_path = "scheduler.log"
        config.args.extend(["scheduler", f"--listen=127.0.0.1:{port}", "--kubeconfig=/etc/crihook/kubeconfig"])
        config.mounts.append(
            api.Mount(container_path="/etc/crihook/kubeconfig", host_path=str(kubeconfig), readonly=True)
        )
        config.linux.security_context.readonly_rootfs = True  # as deploy/scheduler/deployment.yaml runs it
        pod_id = containerd_cri.run_pod(pod)
        cid = containerd_cri.create_container(pod_id, config, pod)
        containerd_cri.start_container(cid)
        spec = json.loads(containerd_cri.container_status(cid, verbose=True).info["info"])["runtimeSpec"]
        assert spec["process"]["user"]["uid"] == 65532 and spec["process"]["args"][0] == "/opt/crihook/bin/crihook"
        deadline = time.monotonic() + 60
        while get(port, "/healthz") != 200 or get(port, "/readyz") != 200:
            status = containerd_cri.container_status(cid).status
            assert status.state == api.CONTAINER_RUNNING, (
                f"crihook scheduler exited {status.exit_code}: {(tmp_path / 'logs' / 'scheduler.log').read_text()}"
            )
            assert time.monotonic() < deadline, "crihook scheduler in the image never became healthy and ready"
            time.sleep(0.5)
