"""A small blocking CRI v1 client playing kubelet, for `crihook demo`, the tests and benchmarks, and
builders for the configs kubelet sends.

The builders fill what kubelet fills for a real pod (metadata, the `io.kubernetes.*` labels, a
cgroup parent), so a hook sees the shape it will see on a node. Pods share the host's network
namespace: the private containerd the demo and tests run has no CNI. tests/support/cri.py binds the test
containerd's image and cgroup root as defaults.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

import grpc

from crihook.proto import runtime_v1_pb2 as api
from crihook.proto import runtime_v1_pb2_grpc as api_grpc

MAX_MESSAGE = 16 * 1024 * 1024  # kubelet's limit, both ways
CALL_TIMEOUT = 60.0  # a hung runtime fails the caller instead of hanging it
# kubelet's cgroupfs parent for BestEffort pods (pkg/kubelet/cm: /kubepods/besteffort/pod<uid>)
KUBEPODS = "/kubepods/besteffort"
REMOVE_ATTEMPTS = 5  # StopPodSandbox + RemovePodSandbox rounds before a leftover pod is an error

# The container labels kubelet sets; the checkpoint's PodUID/ContainerName match them.
POD_NAME = "io.kubernetes.pod.name"
POD_NAMESPACE = "io.kubernetes.pod.namespace"
POD_UID = "io.kubernetes.pod.uid"
CONTAINER_NAME = "io.kubernetes.container.name"

# busybox sh as PID 1 ignores SIGTERM unless it traps it; this exits on StopContainer's SIGTERM at
# once, so stopping takes milliseconds, not the grace period.
SLEEP_FOREVER = ("sh", "-c", "trap 'exit 0' TERM; sleep 86400 & wait")


@dataclass(frozen=True)
class DeviceSpec:
    """A host device node to hand to a container, as CRI's Device message carries it."""

    container_path: str
    host_path: str
    permissions: str = "rw"


def pod_config(
    name: str,
    *,
    namespace: str = "default",
    uid: str | None = None,
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
    cgroup_root: str = KUBEPODS,
    attempt: int = 0,
) -> api.PodSandboxConfig:
    """A host-network PodSandboxConfig the way kubelet (cgroupfs driver) builds it: pod labels plus
    kubelet's own, every pod annotation, cgroup parent `<cgroup_root>/pod<uid>`, and no hostname
    (a host-network pod shares the node's UTS namespace; runc refuses to set a hostname there)."""
    uid = uid or str(uuid.uuid4())
    all_labels = {POD_NAME: name, POD_NAMESPACE: namespace, POD_UID: uid, **(labels or {})}
    config = api.PodSandboxConfig(
        metadata=api.PodSandboxMetadata(name=name, uid=uid, namespace=namespace, attempt=attempt),
        labels=all_labels,
        annotations=dict(annotations or {}),
    )
    config.linux.cgroup_parent = f"{cgroup_root}/pod{uid}"
    config.linux.security_context.namespace_options.network = api.NODE
    return config


def container_config(
    name: str,
    pod: api.PodSandboxConfig,
    *,
    image: str = "busybox",
    command: Sequence[str] = SLEEP_FOREVER,
    envs: Mapping[str, str] | None = None,
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
    devices: Sequence[DeviceSpec] = (),
    attempt: int = 0,
) -> api.ContainerConfig:
    """A ContainerConfig for `pod` with kubelet's container labels added to `labels`."""
    meta = pod.metadata
    kubelet_labels = {POD_NAME: meta.name, POD_NAMESPACE: meta.namespace, POD_UID: meta.uid, CONTAINER_NAME: name}
    return api.ContainerConfig(
        metadata=api.ContainerMetadata(name=name, attempt=attempt),
        image=api.ImageSpec(image=image),
        command=list(command),
        # KeyValue fields are bytes (see proto/runtime_v1.proto)
        envs=[api.KeyValue(key=k.encode(), value=v.encode()) for k, v in (envs or {}).items()],
        labels={**kubelet_labels, **(labels or {})},
        annotations=dict(annotations or {}),
        devices=[
            api.Device(container_path=d.container_path, host_path=d.host_path, permissions=d.permissions)
            for d in devices
        ],
    )


class CriError(RuntimeError):
    """A CRI call failed; `code` and `details` are the gRPC status the runtime returned."""

    def __init__(self, method: str, error: grpc.RpcError) -> None:
        self.code: grpc.StatusCode = error.code()
        self.details: str = error.details() or ""
        super().__init__(f"{method}: {self.code.name}: {self.details}")


class Cri:
    """Blocking client for `runtime.v1` RuntimeService and ImageService at a unix socket address."""

    def __init__(self, address: str, timeout: float = CALL_TIMEOUT) -> None:
        options = [("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE)]
        self.channel = grpc.insecure_channel(address, options=options)
        self.runtime = api_grpc.RuntimeServiceStub(self.channel)
        self.images = api_grpc.ImageServiceStub(self.channel)
        self.timeout = timeout

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Cri:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, stub: object, method: str, request: object, timeout: float | None = None) -> Any:
        """The method's reply; Any because the generated stubs are untyped (callers name the type)."""
        try:
            return getattr(stub, method)(request, timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            raise CriError(method, e) from None

    # -- runtime

    def version(self) -> api.VersionResponse:
        reply: api.VersionResponse = self._call(self.runtime, "Version", api.VersionRequest())
        return reply

    def run_pod(self, config: api.PodSandboxConfig) -> str:
        reply: api.RunPodSandboxResponse = self._call(
            self.runtime, "RunPodSandbox", api.RunPodSandboxRequest(config=config)
        )
        return reply.pod_sandbox_id

    def stop_pod(self, pod_id: str) -> None:
        self._call(self.runtime, "StopPodSandbox", api.StopPodSandboxRequest(pod_sandbox_id=pod_id))

    def remove_pod(self, pod_id: str) -> None:
        self._call(self.runtime, "RemovePodSandbox", api.RemovePodSandboxRequest(pod_sandbox_id=pod_id))

    def pod_status(self, pod_id: str, verbose: bool = False) -> api.PodSandboxStatusResponse:
        request = api.PodSandboxStatusRequest(pod_sandbox_id=pod_id, verbose=verbose)
        reply: api.PodSandboxStatusResponse = self._call(self.runtime, "PodSandboxStatus", request)
        return reply

    def list_pods(self) -> list[api.PodSandbox]:
        reply: api.ListPodSandboxResponse = self._call(self.runtime, "ListPodSandbox", api.ListPodSandboxRequest())
        return list(reply.items)

    def create_container(self, pod_id: str, config: api.ContainerConfig, pod: api.PodSandboxConfig) -> str:
        request = api.CreateContainerRequest(pod_sandbox_id=pod_id, config=config, sandbox_config=pod)
        reply: api.CreateContainerResponse = self._call(self.runtime, "CreateContainer", request)
        return reply.container_id

    def start_container(self, container_id: str) -> None:
        self._call(self.runtime, "StartContainer", api.StartContainerRequest(container_id=container_id))

    def stop_container(self, container_id: str, grace: int = 10) -> None:
        request = api.StopContainerRequest(container_id=container_id, timeout=grace)
        self._call(self.runtime, "StopContainer", request, timeout=grace + self.timeout)

    def remove_container(self, container_id: str) -> None:
        self._call(self.runtime, "RemoveContainer", api.RemoveContainerRequest(container_id=container_id))

    def container_status(self, container_id: str, verbose: bool = False) -> api.ContainerStatusResponse:
        request = api.ContainerStatusRequest(container_id=container_id, verbose=verbose)
        reply: api.ContainerStatusResponse = self._call(self.runtime, "ContainerStatus", request)
        return reply

    def list_containers(self, pod_id: str = "") -> list[api.Container]:
        request = api.ListContainersRequest(filter=api.ContainerFilter(pod_sandbox_id=pod_id))
        reply: api.ListContainersResponse = self._call(self.runtime, "ListContainers", request)
        return list(reply.containers)

    def exec_sync(self, container_id: str, *cmd: str, timeout: int = 10) -> api.ExecSyncResponse:
        """Run `cmd` in the container and wait; the response has exit_code, stdout and stderr."""
        request = api.ExecSyncRequest(container_id=container_id, cmd=list(cmd), timeout=timeout)
        reply: api.ExecSyncResponse = self._call(self.runtime, "ExecSync", request, timeout=timeout + self.timeout)
        return reply

    def output(self, container_id: str, *cmd: str) -> str:
        """stdout of `cmd` in the container; AssertionError with its stderr when it exits non-zero."""
        reply = self.exec_sync(container_id, *cmd)
        if reply.exit_code != 0:
            raise AssertionError(f"{cmd} exited {reply.exit_code}: {reply.stderr.decode(errors='replace')}")
        return reply.stdout.decode()

    # -- images

    def image_present(self, ref: str) -> bool:
        request = api.ImageStatusRequest(image=api.ImageSpec(image=ref))
        reply: api.ImageStatusResponse = self._call(self.images, "ImageStatus", request)
        return reply.HasField("image")

    # -- whole lifecycles

    @contextmanager
    def pod(self, config: api.PodSandboxConfig) -> Iterator[str]:
        """A running pod sandbox, stopped and removed (with its containers) on exit."""
        pod_id = self.run_pod(config)
        try:
            yield pod_id
        finally:
            self.stop_pod(pod_id)
            self.remove_pod(pod_id)

    @contextmanager
    def container(self, pod_id: str, config: api.ContainerConfig, pod: api.PodSandboxConfig) -> Iterator[str]:
        """A created and started container, stopped and removed on exit."""
        container_id = self.create_container(pod_id, config, pod)
        try:
            self.start_container(container_id)
            yield container_id
        finally:
            self.stop_container(container_id)
            self.remove_container(container_id)

    def remove_all(self, delete_task: Callable[[str], None] | None = None) -> None:
        """Stop and remove every pod (and so every container): a clean runtime for the next test. A
        container whose start raced a killed caller can still have a task after StopPodSandbox
        ("cannot delete running task"): its containers are then stopped one by one, their tasks
        deleted with `delete_task` (containerd's own API, see `Containerd.delete_task`) when given,
        and the removal retried, so one test's leftovers never fail the next tests' setup."""
        for pod in self.list_pods():
            for attempt in range(REMOVE_ATTEMPTS):
                self.stop_pod(pod.id)
                try:
                    self.remove_pod(pod.id)
                    break
                except CriError:
                    if attempt == REMOVE_ATTEMPTS - 1:
                        raise
                for c in self.list_containers(pod.id):
                    with suppress(CriError):  # gone meanwhile, or still stuck: the next round tells
                        self.stop_container(c.id, grace=0)
                    if delete_task is not None:
                        delete_task(c.id)
                time.sleep(0.2 * (attempt + 1))
